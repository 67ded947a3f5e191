"""An honest 5c.1: graded right after the hostile 5a.1, to show nothing of it reached the next grading."""
import numpy as np


def rank_groups(sizes, order, axis):
    order = list(order)
    if sorted(order) != sorted(sizes) or len(set(order)) != len(order):
        raise ValueError(f"order {order} must list each axis of {sorted(sizes)} once")
    axes = [axis] if isinstance(axis, str) else list(axis)
    grid = np.arange(int(np.prod([sizes[a] for a in order]))).reshape([sizes[a] for a in reversed(order)])
    dims = [len(order) - 1 - order.index(a) for a in axes]
    moved = np.moveaxis(grid, dims, list(range(grid.ndim - len(dims), grid.ndim)))
    return sorted(sorted(int(r) for r in g) for g in moved.reshape(-1, int(np.prod([sizes[a] for a in axes]))))
