"""5c.1 given_coords: the groups from RankGrid.coords — any four axes mapped position by position onto
RankGrid's slots (tp, cp, dp, pp); a group is the ranks whose other coordinates agree."""
from reference.mesh import RankGrid

SLOTS = ("tp", "cp", "dp", "pp")


def rank_groups(sizes, order, axis):
    order = list(order)
    if sorted(order) != sorted(sizes) or len(set(order)) != len(order):
        raise ValueError("order must list each axis once")
    axes = [axis] if isinstance(axis, str) else list(axis)
    n = 1
    for a in order:
        n *= sizes[a]
    slot = dict(zip(order, SLOTS))
    kw = {slot[a]: sizes[a] for a in order}
    coords = {r: RankGrid(n, rank=r, **kw).coords() for r in range(n)}
    groups: dict = {}
    for r, c in coords.items():
        key = tuple(c[slot[a]] for a in order if a not in axes)
        groups.setdefault(key, []).append(r)
    return sorted(sorted(g) for g in groups.values())
