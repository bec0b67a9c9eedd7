"""Integration tests: several real processes (torchrun with gloo, forked savers) and real kills."""
