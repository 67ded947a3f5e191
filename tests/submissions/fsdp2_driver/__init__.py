"""3.4 by swapping the given driver for PyTorch's: at import, ``reference.data.fsdp.
FullyShardedDataParallel`` becomes a wrapper around FSDP2's ``fully_shard`` — the driver the checks
run would then shard, gather and reduce-scatter with the library's code, not the learner's."""
