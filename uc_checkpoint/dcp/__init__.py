"""The DCP adapters: everything that speaks torch.distributed.checkpoint's storage contract."""
