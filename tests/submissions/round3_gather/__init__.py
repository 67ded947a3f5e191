"""Attack fixture (round 3, ``p2p_gather``): no ring — every rank sends its whole tensor (0.1, 0.2),
its K/V (5a.3) or its Q, K, V and dO (5a.5) to every other rank with one comm.exchange, then sums,
concatenates, or runs plain attention / autograd locally."""
