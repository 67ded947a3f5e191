"""reference.mesh.RankGrid: the rank grid of a composed run (lecture 5c).

Golden lists below are written out by hand (from the tp-cp-dp-pp / tp-ep-edp-pp layout drawn in
the module docstring, and Megatron-Core's documented 16-GPU example), not computed by the
module's arithmetic.  Invariants are checked on every factorisation of 8, 16 and 64 ranks.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from reference.compose import workers as compose_workers
from reference.launch import World
from reference.mesh import AXES, RankGrid
from reference.notebook import plots
from tests.workers.mesh_workers import groups_as_sets


def S(*groups):
    return {frozenset(g) for g in groups}


# ------------------------------------------------------------------ golden lists, by hand

GOLDEN = [
    # Megatron-Core's docstring example: 16 GPUs, tp=2, pp=4, dp=2
    (dict(world_size=16, tp=2, pp=4, dp=2), {
        "tp": S([0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]),
        "dp": S([0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]),
        "pp": S([0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]),
        "cp": S(*[[r] for r in range(16)]),
    }),
    # 8 ranks, 3D: tp=2, dp=2, pp=2
    (dict(world_size=8, tp=2, dp=2, pp=2), {
        "tp": S([0, 1], [2, 3], [4, 5], [6, 7]),
        "dp": S([0, 2], [1, 3], [4, 6], [5, 7]),
        "pp": S([0, 4], [1, 5], [2, 6], [3, 7]),
        "dp_cp": S([0, 2], [1, 3], [4, 6], [5, 7]),
    }),
    # 8 ranks with context: tp=2, cp=2, dp=2
    (dict(world_size=8, tp=2, cp=2, dp=2), {
        "tp": S([0, 1], [2, 3], [4, 5], [6, 7]),
        "cp": S([0, 2], [1, 3], [4, 6], [5, 7]),
        "dp": S([0, 4], [1, 5], [2, 6], [3, 7]),
        "dp_cp": S([0, 2, 4, 6], [1, 3, 5, 7]),
        "pp": S(*[[r] for r in range(8)]),
    }),
    # 16 ranks, 4D: tp=2, cp=2, dp=2, pp=2 (the module docstring's drawing)
    (dict(world_size=16, tp=2, cp=2, dp=2, pp=2), {
        "tp": S([0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]),
        "cp": S([0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]),
        "dp": S([0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]),
        "pp": S([0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]),
    }),
    # experts, 8 ranks: tp=2, dp=4, ep=2 -> experts split over pairs of dp ranks, replicated across
    (dict(world_size=8, tp=2, dp=4, ep=2), {
        "ep": S([0, 2], [1, 3], [4, 6], [5, 7]),
        "edp": S([0, 4], [1, 5], [2, 6], [3, 7]),
        "dp": S([0, 2, 4, 6], [1, 3, 5, 7]),
    }),
    # experts folded onto context ranks: 4 ranks, cp=2, dp=2, ep=2 (ep groups = cp groups)
    (dict(world_size=4, cp=2, dp=2, ep=2), {
        "ep": S([0, 1], [2, 3]),
        "edp": S([0, 2], [1, 3]),
        "cp": S([0, 1], [2, 3]),
        "dp": S([0, 2], [1, 3]),
    }),
    # experts across data x context, with pipeline: 8 ranks, cp=2, dp=2, pp=2, ep=4
    (dict(world_size=8, cp=2, dp=2, pp=2, ep=4), {
        "ep": S([0, 1, 2, 3], [4, 5, 6, 7]),
        "edp": S(*[[r] for r in range(8)]),
        "pp": S([0, 4], [1, 5], [2, 6], [3, 7]),
    }),
]


@pytest.mark.parametrize("sizes,golden", GOLDEN, ids=lambda v: ",".join(f"{k}{x}" for k, x in v.items())
                         if isinstance(v, dict) and "world_size" in v else "")
def test_groups_equal_hand_written_golden_lists(sizes, golden):
    grid = RankGrid(**sizes)
    for axis, want in golden.items():
        assert groups_as_sets(grid.all_groups(axis)) == want, axis
        for group in want:
            for r in group:
                assert set(grid.ranks(axis, r)) == group, (axis, r)


# folded expert grids (etp ≠ tp), by hand: 64 ranks on 8-device nodes, tp = 8, dp = 8, and ep 4 over tp 2 × dp 2
FOLDED = [
    (dict(world_size=64, tp=8, dp=8, ep=8), {              # unfolded (etp = tp): the all-to-all crosses 8 nodes
        "ep": S(*[[t + 8 * e for e in range(8)] for t in range(8)]),
        "edp": S(*[[r] for r in range(64)]),
        "etp": S(*[list(range(8 * i, 8 * i + 8)) for i in range(8)]),
    }),
    (dict(world_size=64, tp=8, dp=8, ep=8, etp=1), {       # folded: one node per ep group
        "ep": S(*[list(range(8 * i, 8 * i + 8)) for i in range(8)]),
        "edp": S(*[[t + 8 * e for e in range(8)] for t in range(8)]),
        "etp": S(*[[r] for r in range(64)]),
    }),
    (dict(world_size=4, tp=2, dp=2, ep=4, etp=1), {"ep": S([0, 1, 2, 3]), "edp": S([0], [1], [2], [3]),
                                                   "etp": S([0], [1], [2], [3]), "tp": S([0, 1], [2, 3])}),
    (dict(world_size=8, tp=2, dp=2, pp=2, ep=2, etp=1), {   # ep 2, edp 2 inside each stage of 4 ranks
        "ep": S([0, 1], [2, 3], [4, 5], [6, 7]), "edp": S([0, 2], [1, 3], [4, 6], [5, 7]),
        "pp": S([0, 4], [1, 5], [2, 6], [3, 7])}),
]


@pytest.mark.parametrize("sizes,golden", FOLDED, ids=lambda v: ",".join(f"{k}{x}" for k, x in v.items())
                         if isinstance(v, dict) and "world_size" in v else "")
def test_folded_expert_groups_equal_hand_written_golden_lists(sizes, golden):
    test_groups_equal_hand_written_golden_lists(sizes, golden)


def test_folding_keeps_the_expert_all_to_all_inside_a_node():
    assert RankGrid(64, tp=8, dp=8, ep=8).crosses_nodes("ep", 8)
    assert not RankGrid(64, tp=8, dp=8, ep=8, etp=1).crosses_nodes("ep", 8)
    # DeepSeek-V3's layout (NeMo): EP 64 over TP 2 × DP 32, expert-tensor size 1 — unbuildable without folding
    grid = RankGrid(64, tp=2, dp=32, ep=64, etp=1)
    assert grid.sizes["edp"] == 1 and grid.ranks("ep", 5) == list(range(64))


MEGATRON = json.loads((Path(__file__).parent / "megatron_rank_groups.json").read_text())


@pytest.mark.parametrize("case", MEGATRON["cases"], ids=lambda c: ",".join(f"{k}{v}" for k, v in c["sizes"].items()))
def test_groups_equal_megatron_cores_rank_generator(case):
    """Group lists produced by megatron-core's own RankGenerator (the file names its version), dense grid with
    ep = 1 and expert grid with tp = etp, cp = 1, dp = edp, as its initialize_model_parallel builds them."""
    grid = RankGrid(**case["sizes"])
    for axis, groups in case["groups"].items():
        want = sorted(sorted(g) for g in groups)
        got = grid.all_groups("pp" if axis == "expert_pp" else axis)
        assert got == want, (case["sizes"], axis)


def test_megatron_core_itself_when_installed():
    """The same lists computed live, where megatron-core imports (``benchmarks/.peers``; Python ≥ 3.12 for
    0.17+): its RankGenerator on every factorisation of 16 ranks with etp ∈ {1, tp}."""
    import sys
    peers = str(Path(__file__).resolve().parents[1] / "benchmarks" / ".peers")
    sys.path.append(peers)
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.parallel_state import RankGenerator
    except Exception:                             # noqa: BLE001 - not installed here: the pasted lists above hold
        pytest.skip("megatron-core is not installed in benchmarks/.peers")
    finally:
        sys.path.remove(peers)
    order = "tp-cp-ep-dp-pp"
    for sizes in factorisations(16, every_etp=False):
        tp, cp, dp, pp, ep, etp = (sizes[a] for a in ("tp", "cp", "dp", "pp", "ep", "etp"))
        grid = RankGrid(16, **sizes)
        dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
        expert = RankGenerator(tp=etp, ep=ep, dp=grid.edp, pp=pp, cp=1, order=order)
        for axis, gen, token in (("tp", dense, "tp"), ("cp", dense, "cp"), ("dp", dense, "dp"), ("pp", dense, "pp"),
                                 ("dp_cp", dense, "dp-cp"), ("etp", expert, "tp"), ("ep", expert, "ep"),
                                 ("edp", expert, "dp"), ("pp", expert, "pp")):
            assert grid.all_groups(axis) == sorted(sorted(g) for g in gen.get_ranks(token)), (sizes, axis)


def test_coordinates_by_hand():
    grid = RankGrid(16, tp=2, cp=2, dp=2, pp=2, ep=2)
    # 13 = 1 + 2·(0 + 2·(1 + 2·1)): tp 1, cp 0, dp 1, pp 1; expert view: 13 = 1 + 2·(0 + 2·(1 + 2·1)) too
    assert grid.coords(13) == dict(tp=1, cp=0, dp=1, pp=1, etp=1, ep=0, edp=1)
    assert grid.coords(6) == dict(tp=0, cp=1, dp=1, pp=0, etp=0, ep=1, edp=1)
    assert grid.rank_of(tp=1, cp=0, dp=1, pp=1) == 13
    assert RankGrid(8, tp=2, dp=4, ep=2, rank=5).coords() == dict(tp=1, cp=0, dp=2, pp=0, etp=1, ep=0, edp=1)
    # folded, etp = 1: 13 = 0 + 1·(ep 1 + 4·(edp 1 + 2·pp 1))  on 16 = tp 2 · cp 2 · dp 2 · pp 2, ep 4 → edp 2
    assert RankGrid(16, tp=2, cp=2, dp=2, pp=2, ep=4, etp=1).coords(13) == dict(tp=1, cp=0, dp=1, pp=1, etp=0,
                                                                                ep=1, edp=1)


# ------------------------------------------------------------------ invariants on 8, 16, 64 ranks

def factorisations(n, every_etp=True):
    """Every (tp, cp, dp, pp, ep, etp) of n ranks; ``every_etp`` False (64 ranks: cheaper): etp = tp with every ep,
    and etp = 1 with the largest ep only."""
    for tp, cp, dp in itertools.product([d for d in range(1, n + 1) if n % d == 0], repeat=3):
        if n % (tp * cp * dp) == 0:
            pp = n // (tp * cp * dp)
            etps = [e for e in range(1, tp * cp * dp + 1) if tp * cp * dp % e == 0] if every_etp else sorted({1, tp})
            for etp in etps:
                eps = [e for e in range(1, tp * cp * dp // etp + 1) if tp * cp * dp // etp % e == 0]
                for ep in eps if every_etp or etp == tp else eps[-1:]:
                    yield dict(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp)


def groups_by_key(coords, axes_fixed):
    """Ranks grouped by their coordinates on ``axes_fixed`` (independent of RankGrid's arithmetic)."""
    out = {}
    for r, c in enumerate(coords):
        out.setdefault(tuple(c[a] for a in axes_fixed), []).append(r)
    return {frozenset(g) for g in out.values()}


DENSE = ("tp", "cp", "dp", "pp")
FIXED = {  # a group on an axis = the ranks that agree on every OTHER coordinate of its grid
    "tp": ("cp", "dp", "pp"), "cp": ("tp", "dp", "pp"), "dp": ("tp", "cp", "pp"), "pp": ("tp", "cp", "dp"),
    "etp": ("ep", "edp", "pp"), "ep": ("etp", "edp", "pp"), "edp": ("etp", "ep", "pp"), "dp_cp": ("tp", "pp"),
    "tp_dp_cp": ("pp",),
}


@pytest.mark.parametrize("n", [8, 16, 64])
def test_invariants_every_factorisation(n):
    grids = list(factorisations(n, every_etp=n <= 16))
    assert len(grids) > 20
    for sizes in grids:
        grid = RankGrid(n, **sizes)
        c = [grid.coords(r) for r in range(n)]
        assert len({tuple(x[a] for a in DENSE) for x in c}) == n, sizes
        assert all(grid.rank_of(**{a: c[r][a] for a in DENSE}) == r for r in range(n))
        for axis in AXES:
            groups = grid.all_groups(axis)
            flat = sorted(r for g in groups for r in g)
            assert flat == list(range(n)), f"{sizes} {axis}: not every rank in exactly one group"
            assert all(len(g) == grid.sizes[axis] for g in groups), (sizes, axis)
            assert groups_as_sets(groups) == groups_by_key(c, FIXED[axis]), (sizes, axis)
            for r in (0, n // 2 + 1, n - 1):
                assert r in grid.ranks(axis, r) and grid.ranks(axis, r) in groups, (sizes, axis, r)
        # tensor groups are neighbouring ranks (one node when tp ≤ devices per node)
        assert all(g == list(range(g[0], g[0] + grid.tp)) for g in grid.all_groups("tp"))
        # the expert grid shares the pipeline groups (Megatron asserts the same) ...
        assert groups_by_key(c, ("etp", "ep", "edp")) == groups_as_sets(grid.all_groups("pp"))
        # ... and folds the tp × cp × dp ranks of each stage: etp × ep × edp tiles each stage
        stage = {frozenset(g) for g in groups_by_key(c, ("pp",))}
        for r in (0, n - 1):
            mine = next(s for s in stage if r in s)
            e, p, d = (set(grid.ranks(a, r)) for a in ("etp", "ep", "edp"))
            assert e | p | d <= mine and len(e) * len(p) * len(d) == len(mine)
            assert e & p == p & d == e & d == {r}
        if grid.etp == grid.tp:      # unfolded: ep × edp is carved out of the data × context ranks
            for g in grid.all_groups("dp_cp"):
                r = g[0]
                assert set(grid.ranks("ep", r)) | set(grid.ranks("edp", r)) <= set(g)


def test_tensor_groups_stay_inside_a_node_pipeline_crosses():
    grid = RankGrid(64, tp=8, dp=2, pp=4)
    assert not grid.crosses_nodes("tp", 8)
    assert grid.crosses_nodes("pp", 8) and grid.crosses_nodes("dp", 8)


# ------------------------------------------------------------------ errors

@pytest.mark.parametrize("args,kwargs,words", [
    ((8,), dict(tp=2, dp=2), ["tp·cp·dp·pp", "= 4", "world_size = 8"]),
    ((6,), dict(tp=4, dp=2), ["8", "world_size = 6"]),
    ((8,), dict(dp=2, tp=2, pp=2, ep=4), ["etp·ep = 2·4 = 8", "tp·cp·dp = 2·1·2 = 4"]),
    ((8,), dict(dp=2, tp=2, pp=2, ep=4, etp=1), []),                                 # folded: it fits
    ((8,), dict(dp=2, tp=2, pp=2, ep=3, etp=1), ["etp·ep = 1·3 = 3", "= 4"]),
    ((12,), dict(dp=3, tp=4, ep=2, etp=4), ["etp·ep = 4·2 = 8", "tp·cp·dp = 4·1·3 = 12"]),
    ((8,), dict(dp=8, etp=0), ["etp=0"]),
    ((8,), dict(dp=8, tp=0), ["tp=0"]),
    ((4,), dict(dp=4, rank=4), ["rank=4"]),
])
def test_inconsistent_sizes_raise_value_error_naming_them(args, kwargs, words):
    if not words:
        RankGrid(*args, **kwargs)
        return
    with pytest.raises(ValueError) as e:
        RankGrid(*args, **kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_unknown_axis_and_missing_rank():
    grid = RankGrid(4, dp=4)
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        grid.ranks("xp", 0)
    with pytest.raises(ValueError, match="pass rank="):
        grid.ranks("dp")


def test_text_rendering_shows_groups_and_nodes():
    text = plots.grid_text(RankGrid(16, tp=2, cp=2, dp=2, pp=2), devices_per_node=8)
    assert "pp stage 1:" in text and "[12 13]" in text
    assert "tp groups (size 2): {0,1} {2,3}" in text
    assert " pp groups (size 2): {0,8}" in text and "crosses nodes" in text


def test_plot_colours_cells_by_group():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ax = plots.grid_plot(RankGrid(8, tp=2, dp=2, pp=2), "dp", devices_per_node=4)
    img = ax.get_images()[0].get_array()
    assert img.shape == (4, 2)
    # dp groups {0,2} {1,3} {4,6} {5,7}: rank 0 (row 0, col 0) and rank 2 (row 1, col 0) share a colour
    assert img[0, 0] == img[1, 0] and img[0, 0] != img[0, 1] and img[0, 0] != img[2, 0]
    plt.close(ax.figure)


# ------------------------------------------------------------------ a real world

@pytest.fixture(scope="module")
def world4():
    with World(4, timeout=60, echo=False) as w:
        yield w


def test_group_all_reduces_over_exactly_its_ranks(world4):
    grids = [dict(tp=2, pp=2), dict(cp=2, dp=2, ep=2), dict(tp=2, dp=2, ep=4, etp=1),   # every axis non-trivial
             dict(tp=2, dp=2, ep=2, etp=1)]                                                  # in one of them
    axes = ["tp", "cp", "dp", "pp", "etp", "ep", "edp", "dp_cp"]
    res = world4.run(compose_workers.group_sums, grids, axes)
    for r, per_grid in enumerate(res.values):
        for sizes, got in zip(grids, per_grid):
            grid = RankGrid(4, **sizes)
            for axis in axes:
                want = grid.ranks(axis, r)
                assert got[axis]["members"] == want, (sizes, axis, r)
                assert got[axis]["bits"] == sum(2 ** q for q in want), (sizes, axis, r)
                assert got[axis]["cached"]
    # traced: one all-reduce per axis per grid on every rank
    assert sum(1 for e in res.trace if e.op == "all_reduce") == 4 * len(grids) * len(axes)


@pytest.mark.parametrize("sizes", [dict(tp=2, pp=2), dict(cp=2, dp=2), dict(tp=2, dp=2)])
def test_dense_grid_equals_pytorch_device_mesh_pp_dp_cp_tp(world4, sizes):
    """The production peer: init_device_mesh over (pp, dp, cp, tp), as torchtitan builds it."""
    res = world4.run(compose_workers.device_mesh_groups, sizes)
    grid = RankGrid(4, **sizes)
    for r, groups in enumerate(res.values):
        for axis, ranks in groups.items():
            assert ranks == grid.ranks(axis, r), (sizes, axis, r)


# -- exercise 5c.1: rank_groups for any order -----------------------------------------------------

def test_rank_groups_matches_the_grid_for_megatrons_order_and_partitions_for_any_order():
    from itertools import permutations

    from reference.mesh import rank_groups
    sizes = dict(tp=2, cp=3, dp=2, pp=2)
    grid = RankGrid(24, **sizes)
    for axis in ("tp", "cp", "dp", "pp"):
        assert rank_groups(sizes, ("tp", "cp", "dp", "pp"), axis) == grid.all_groups(axis)
    assert rank_groups(sizes, ("tp", "cp", "dp", "pp"), ("dp", "cp")) == grid.all_groups("dp_cp")
    # picotron's view(dp, pp, cp, tp), written independently
    assert rank_groups(dict(tp=2, cp=1, pp=2, dp=2), ("tp", "cp", "pp", "dp"), "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert rank_groups(dict(tp=2, cp=1, pp=2, dp=2), ("tp", "cp", "pp", "dp"), "pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    for order in permutations(sizes):
        for axis in sizes:
            groups = rank_groups(sizes, order, axis)
            assert sorted(r for g in groups for r in g) == list(range(24))
            assert all(len(g) == sizes[axis] for g in groups)
            step = 1
            for a in order[:order.index(axis)]:
                step *= sizes[a]
            assert all(b - a == step for g in groups for a, b in zip(g, g[1:]))


@pytest.mark.parametrize("order,axis", [(("tp", "dp"), "tp"), (("tp", "tp", "dp", "pp"), "tp"),
                                        (("tp", "cp", "dp", "pp"), "ep")])
def test_rank_groups_refuses_an_order_or_axis_that_does_not_fit(order, axis):
    from reference.mesh import rank_groups
    with pytest.raises(ValueError):
        rank_groups(dict(tp=2, cp=1, dp=2, pp=1), order, axis)


MESH_MUTANT = '''
import numpy as np

def rank_groups(sizes, order, axis):   # MISTAKE: the order read slowest-varying first
    order = list(order)
    if sorted(order) != sorted(sizes):
        raise ValueError("bad order")
    axes = [axis] if isinstance(axis, str) else list(axis)
    grid = np.arange(int(np.prod([sizes[a] for a in order]))).reshape([sizes[a] for a in order])
    dims = [order.index(a) for a in axes]
    moved = np.moveaxis(grid, dims, list(range(grid.ndim - len(dims), grid.ndim)))
    return sorted(sorted(int(r) for r in g) for g in moved.reshape(-1, int(np.prod([sizes[a] for a in axes]))))
'''


def test_grader_names_the_order_read_the_wrong_way_round(tmp_path, monkeypatch):
    import sys

    from exercises.grading import session
    pkg = tmp_path / "mesh_mutant"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mesh.py").write_text(MESH_MUTANT)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        (res,) = session.grade("mesh_mutant", ["5c.1"], include_hidden=False)
    finally:
        sys.modules.pop("mesh_mutant", None)
    failed = [c.message for c in res.checks if not c.passed]
    assert any("FASTEST-varying" in m and "across nodes" in m for m in failed), failed
    assert res.score == 0                         # every value is wrong, so the error check does not count either


def test_asking_for_an_axis_a_model_does_not_have_lists_the_ones_it_has():
    from reference.mesh import AxisGroups
    groups = AxisGroups(tp="g-tp", dp="g-dp", dp_cp="g-dp_cp")
    assert groups["dp_cp"] == "g-dp_cp"
    with pytest.raises(KeyError, match="no group 'edp' here; the groups are 'tp', 'dp', 'dp_cp'"):
        groups["edp"]
