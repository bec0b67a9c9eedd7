"""Unit tests: one module or function at a time, no server and no other process; seconds in all."""
