"""Integration tests: several real processes (torchrun with gloo, DataLoader workers, forked savers,
fresh interpreters) and real kills."""
