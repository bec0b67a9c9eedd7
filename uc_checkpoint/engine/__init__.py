"""Moving bytes and files between the local staging directory and a volume; no DCP types."""
