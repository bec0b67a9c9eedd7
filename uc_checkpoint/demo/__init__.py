"""Demo workload for uc_checkpoint: byte-level text shards and a small GPT trained with FSDP2."""
