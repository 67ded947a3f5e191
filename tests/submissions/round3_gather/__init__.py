"""Attack fixture (round 3, ``p2p_gather``): no ring — every rank sends its whole tensor (0.1, 0.2),
its K/V (5a.3) or its Q, K, V and dO (5a.5) to every other rank with one comm.exchange, then sums,
concatenates, or runs plain attention / autograd locally.

5c.1: ``space_table`` — answers looked up in a table of the old, small input spaces (see mesh.py)."""
