"""The byte engine: moving files and byte ranges between local staging and a volume, without DCP types."""
