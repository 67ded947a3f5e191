from reference.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter  # noqa: F401
