"""Operations on checkpoints under a root: manager, catalog, retention, preemption, lineage, gc, verify, summaries."""
