from reference.mesh import RankGrid


def rank_groups(sizes, order, axis):
    grid = RankGrid(sizes.get("tp", 1) * sizes.get("cp", 1) * sizes.get("dp", 1) * sizes.get("pp", 1),
                    **{a: sizes[a] for a in ("tp", "cp", "dp", "pp") if a in sizes})
    if isinstance(axis, str):
        return grid.all_groups(axis)
    return grid.all_groups("dp_cp")
