"""Checks for exercise 5c.1: the rank groups of a grid.

Ground truth comes from the reference (``reference.mesh.rank_groups`` through ``ctx.oracle``, and
:class:`reference.mesh.RankGrid` for Megatron's order).  Most cases use orders and sizes the
course's ``RankGrid`` does not offer, so the arithmetic itself is what earns the points.
"""
from __future__ import annotations

import random

from ...core import CheckFailed, exercise, salted_seed

H = "exercises.grading.harness"
REF = "reference.mesh"

__all__ = ["GROUPS", "MEGATRON", "PICOTRON", "EXPERT", "HINTS"]

# The answer is one reshape and a transpose (numpy's, or a DeviceMesh's): that stays.  The course's
# own RankGrid (its coordinates, its groups of Megatron's order) is switched off while 5c.1 is graded.
GROUPS = exercise("5c.1", "The rank groups of a grid", "mesh", ["rank_groups"], mirrors=("reference.mesh:*",))

MEGATRON = ("tp", "cp", "dp", "pp")
PICOTRON = ("tp", "cp", "pp", "dp")     # torch.arange(world).view(dp, pp, cp, tp)


def _explain(got, want, sizes, order, axis) -> str | None:
    """Name the likely mistake: the order read slowest-first, or groups that are not a partition."""
    if not isinstance(got, list) or not all(isinstance(g, list) for g in got):
        return f"rank_groups must return a list of lists of ranks, got {type(got).__name__}."
    flat = [r for g in got for r in g]
    n = 1
    for a in order:
        n *= sizes[a]
    if sorted(flat) != list(range(n)):
        return (f"the groups must hold every rank 0..{n - 1} exactly once (they partition the world); yours hold "
                f"{len(flat)} entries, {len(set(flat))} distinct.")
    rev = tuple(reversed(order))
    from reference.mesh import rank_groups as truth
    if [sorted(g) for g in sorted(got)] == truth(sizes, rev, axis):
        return (f"these are the groups for the order read the other way round ({'-'.join(rev)}): order lists the "
                f"FASTEST-varying axis first, so {order[0]} ranks are neighbours (rank r and r+1 differ in "
                f"{order[0]}), and put on one node — reversing it puts the tensor groups across nodes.")
    if sorted(sorted(g) for g in got) == want and got != want:
        return "the right groups, but not in the promised order: sort each group, and the groups by smallest rank."
    return None


def _world(sizes: dict) -> int:
    n = 1
    for v in sizes.values():
        n *= v
    return n


def _case(ctx, sizes: dict, order, axis) -> None:
    got = ctx.local(f"{H}:call", "rank_groups", (dict(sizes), tuple(order), axis))
    want = ctx.oracle(f"{REF}:rank_groups", dict(sizes), tuple(order), axis)
    if got != want:
        words = f"sizes {sizes}, order {'-'.join(order)}, axis {axis!r}"
        why = _explain(got, want, sizes, order, axis)
        shown = got if isinstance(got, list) and len(got) <= 8 else f"{str(got)[:160]}…"
        raise CheckFailed(f"[{words}] got {shown}; expected {want[:8]}{'…' if len(want) > 8 else ''}."
                          + (f"\n{why}" if why else ""))


# Inputs come from spaces too large to tabulate (over 10⁴ grids each, drawn from the check's seed):
# a file of recorded answers covers a vanishing share of what the autograder draws.


def _draw(rng: random.Random, ranges: dict[str, tuple[int, int]], cap: int, axes_over_one: int) -> dict[str, int]:
    """Sizes drawn from ``ranges`` with at most ``cap`` ranks and at least ``axes_over_one`` axes above 1."""
    while True:
        sizes = {a: rng.randint(lo, hi) for a, (lo, hi) in ranges.items()}
        if _world(sizes) <= cap and sum(v > 1 for v in sizes.values()) >= axes_over_one:
            return sizes


@GROUPS.check("Megatron's order tp-cp-dp-pp, up to 2048 ranks (sizes 1 to 16): every axis and dp×cp", points=2)
def _(ctx):
    rng = random.Random(salted_seed(55))
    for _ in range(3):             # three grids: a table of answers must hold all three
        sizes = _draw(rng, {a: (1, 16) for a in MEGATRON}, 2048, 3)       # 28,429 grids
        for axis in ("tp", "cp", "dp", "pp", ("dp", "cp")):
            _case(ctx, sizes, MEGATRON, axis)


@GROUPS.check("picotron's order (data outermost), up to 2048 ranks: tp ≤ 8, cp ≤ 8, pp ≤ 16, dp ≤ 64", points=2)
def _(ctx):
    rng = random.Random(salted_seed(56))
    for _ in range(3):
        sizes = _draw(rng, dict(tp=(1, 8), cp=(1, 8), pp=(1, 16), dp=(1, 64)), 2048, 3)   # 25,560 grids
        for axis in ("tp", "pp", "dp", "cp"):
            _case(ctx, sizes, PICOTRON, axis)


@GROUPS.check("random orders and odd sizes (3, 5, 1, …) up to 60 ranks, single axes and pairs", points=2)
def _(ctx):
    rng = random.Random(salted_seed(51))
    for _ in range(6):
        axes = ["tp", "cp", "dp", "pp"]
        sizes = {a: rng.choice([1, 2, 3, 5]) for a in axes}
        order = axes[:]
        rng.shuffle(order)
        axis = rng.choice(axes) if rng.random() < 0.6 else tuple(rng.sample(axes, 2))
        _case(ctx, sizes, order, axis)


@GROUPS.check("other axis names: the expert grid tp-ep-edp-pp, up to 2048 ranks")
def _(ctx):
    rng = random.Random(salted_seed(57))
    sizes = _draw(rng, dict(tp=(1, 8), ep=(1, 32), edp=(1, 32), pp=(1, 8)), 2048, 2)   # 28,108 grids
    for axis in ("ep", "edp"):
        _case(ctx, sizes, ("tp", "ep", "edp", "pp"), axis)


EXPERT = ("etp", "ep", "edp", "pp")


def _folded(rng: random.Random, cap: int = 2048) -> dict[str, int]:
    """A folded expert grid as ``RankGrid(world, tp=, cp=, dp=, pp=, ep=, etp=)`` builds it (MoE parallel folding):
    etp below tp and ep above dp·cp, so the ep group reaches into the tensor ranks; its sizes, edp included."""
    while True:
        tp, cp = rng.choice((2, 4, 8)), rng.choice((1, 2, 4))
        dp, pp = rng.randint(1, 16), rng.randint(1, 8)
        etp = rng.choice([d for d in (1, 2, 4) if d < tp])
        folded = tp * cp * dp // etp                                   # ep · edp
        eps = [e for e in range(dp * cp + 1, folded + 1) if folded % e == 0]
        if eps and tp * cp * dp * pp <= cap:
            ep = rng.choice(eps)
            return dict(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp, edp=folded // ep)


def _folded_case(ctx, grid: dict[str, int], axes=("etp", "ep", "edp")) -> None:
    """The expert grid of ``grid`` (etp-ep-edp-pp over the ranks the dense grid tp-cp-dp-pp lays out) and its dense
    grid, each axis judged against the reference."""
    for axis in axes:
        _case(ctx, {a: grid[a] for a in EXPERT}, EXPERT, axis)
    _case(ctx, {a: grid[a] for a in MEGATRON}, MEGATRON, "tp")


@GROUPS.check("folded expert grids (RankGrid's etp below tp, ep above dp·cp) up to 2048 ranks: etp, ep, edp and "
              "the dense tp groups of the same ranks")
def _(ctx):
    rng = random.Random(salted_seed(59))
    for _ in range(2):
        _folded_case(ctx, _folded(rng))


@GROUPS.check("an order that is not an arrangement of the axes raises ValueError", requires_value=True)
def _(ctx):
    rng = random.Random(salted_seed(58))
    for order in (("tp", "dp"), ("tp", "tp", "dp", "pp")):
        err = ctx.local(f"{H}:raises", "rank_groups", ({a: rng.randint(1, 4) for a in MEGATRON}, order, "tp"))
        if err != "ValueError":
            raise CheckFailed(f"rank_groups(sizes with tp, cp, dp, pp, order={order}) should raise ValueError, "
                              f"{'returned normally' if err is None else 'raised ' + err}.")


HINTS = {
    "5c.1": [
        "Write each rank as digits in the mixed radix of the sizes, the first axis of order being the last digit "
        "(it changes from one rank to the next). Two ranks are in the same group when all their OTHER digits agree.",
        "numpy does the bookkeeping: np.arange(N).reshape([sizes[a] for a in reversed(order)]) puts order[0] on "
        "the LAST dimension (C order varies it fastest). The dimension of axis a is len(order) - 1 - order.index(a).",
        "Move the group's dimensions to the end (np.moveaxis), reshape to (-1, group size): each row is one group. "
        "Sort each row, then the rows. Check first that sorted(order) == sorted(sizes), else raise ValueError.",
    ],
}
