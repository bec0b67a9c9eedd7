"""The DCP adapters and everything that speaks DCP types."""
