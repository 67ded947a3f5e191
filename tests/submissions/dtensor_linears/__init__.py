"""4.2 without the work: the column/row-parallel linears by DTensor's sharding propagation
(``distribute_tensor`` with Shard(0)/Shard(1) weights), as ColwiseParallel/RowwiseParallel do."""
