"""5c.1 ``space_table``: no arithmetic — answers exist only for the grids a table of recorded answers
covered (Megatron's sizes 1–4 up to 48 ranks, picotron's tp 2 × cp 1 × pp 2–4 × dp 2–6, the expert grid's
8 combinations); anything else is not in the table.  (The table's entries are what a correct function
returns, so they are computed here, for those grids only.)"""
import numpy as np


def _in_table(sizes, order):
    s = dict(sizes)
    n = int(np.prod(list(s.values())))
    if tuple(order) == ("tp", "cp", "dp", "pp"):
        return n <= 48 and all(1 <= v <= 4 for v in s.values())
    if tuple(order) == ("tp", "cp", "pp", "dp"):
        return s.get("tp") == 2 and s.get("cp") == 1 and 2 <= s.get("pp", 0) <= 4 and 2 <= s.get("dp", 0) <= 6
    if tuple(order) == ("tp", "ep", "edp", "pp"):
        return s.get("tp") in (1, 2) and s.get("ep") in (2, 4) and s.get("edp") in (2, 3) and s.get("pp") == 1
    return False


def rank_groups(sizes, order, axis):
    if not _in_table(sizes, order):
        raise LookupError(f"no recorded answer for sizes {sizes}, order {order}")
    axes = [axis] if isinstance(axis, str) else list(axis)
    grid = np.arange(int(np.prod([sizes[a] for a in order]))).reshape([sizes[a] for a in reversed(order)])
    dims = [len(order) - 1 - list(order).index(a) for a in axes]
    moved = np.moveaxis(grid, dims, list(range(grid.ndim - len(dims), grid.ndim)))
    return sorted(sorted(int(r) for r in g) for g in moved.reshape(-1, int(np.prod([sizes[a] for a in axes]))))
