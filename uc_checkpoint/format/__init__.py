"""The on-volume format, torch-free: names and markers at a checkpoint location, the typed manifest, integrity records."""
