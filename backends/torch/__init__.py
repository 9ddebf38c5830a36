"""The torch backend: a finished Plan lowered onto the user's own eager module with PyTorch's engines (FSDP2
fully_shard, tensor parallelism by parallelize_module, activation checkpointing, torch.compile)."""
