"""Operations over checkpoints under a root: the manager, the catalog, retention, lineage, garbage collection, verification, summaries."""
