"""3.3 without the work: the gradients averaged with one all-reduce each, then PyTorch's
ZeroRedundancyOptimizer (built once, on the parameters) takes the step and shares the updated
shards — the sharding, the update of my shard and the all-gather are the library's."""
