from reference.collectives import ring_all_gather, ring_all_reduce  # noqa: F401
