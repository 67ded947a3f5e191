"""Lecture 6, part 2 — what a recorded run holds: every module's tensors, placed in the one-process tensor.

A run is recorded by hooks (:mod:`.recorder`): for every step, in the order they happen,

    phase      tensor                       when
    ─────────  ───────────────────────────  ───────────────────────────────────────────────────────────
    forward    "input", "output"            a module's forward hook (one record per module call)
    backward   "grad_output", "grad_input"  its full backward hook: ∂L/∂output, ∂L/∂input
    grad       "<param>.grad"               just before the optimizer step: the gradient it will use
    param      "<param>"                    just after the optimizer step

Each :class:`Record` holds the WHOLE tensor's shape (one process's) and, for every rank, the pieces it
holds: ``(rank, offsets, block)`` — ``block`` lies at ``offsets`` of the whole tensor.  A replicated
tensor is one piece per rank at offset 0; a tensor-parallel output a column slice; a data-parallel
rank's activation its rows of the batch; a zigzag context-parallel rank's two chunks of the sequence;
a parameter shard the boxes the checkpoint's shard table gives (:func:`.recorder.param_pieces`)::

    record "blocks.0.mlp.fc1 output", whole (B=4, S=8, 64), dp 2 × tp 2:
        rank 0 ── rows 0-1, columns  0-31  ──▶ (0, 0, 0)      rank 1 ── rows 0-1, columns 32-63 ──▶ (0, 0, 32)
        rank 2 ── rows 2-3, columns  0-31  ──▶ (2, 0, 0)      rank 3 ── rows 2-3, columns 32-63 ──▶ (2, 0, 32)

Activations are laid out (B, S, features) whatever the model's own layout (Megatron's (S, B, d)
is transposed), a token-flattened (B·S, f) as (B, S, f).  Gradients of activations are those of the
WHOLE batch's loss (each rank's are scaled by its share, 1/(dp·cp)), so they compare with one process.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Record", "Run", "Divergence", "PHASES", "to_plain", "from_plain"]

PHASES = ("forward", "backward", "grad", "param")


@dataclass
class Record:
    """One tensor of one step: its whole (one-process) ``shape`` and every rank's pieces of it."""
    step: int
    phase: str
    module: str
    tensor: str
    shape: tuple[int, ...]
    pieces: list[tuple[int, tuple[int, ...], torch.Tensor]] = field(default_factory=list)

    @property
    def key(self) -> tuple[int, str, str, str]:
        return (self.step, self.phase, self.module, self.tensor)

    @property
    def name(self) -> str:
        return f"{self.module} {self.tensor}" if self.module else self.tensor

    def whole(self) -> torch.Tensor:
        """The one-process tensor put back together from the pieces (a later piece overwrites an
        earlier one where they overlap: replicas are assumed equal here)."""
        dtype = self.pieces[0][2].dtype if self.pieces else torch.float64
        out = torch.full(self.shape, float("nan"), dtype=dtype)
        for _, offsets, block in self.pieces:
            out[tuple(slice(o, o + n) for o, n in zip(offsets, block.shape))] = block
        return out


@dataclass
class Run:
    """A recorded run: its records in the order they happened (on one process; on many ranks, each
    rank's records merged by key), and what the run measured on the way (``losses`` per step, and
    whatever else: ``grad_norms`` per rank, the grid)."""
    records: list[Record]
    world_size: int = 1
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        self._index = {r.key: r for r in self.records}

    def get(self, key) -> Record | None:
        return self._index.get(tuple(key))

    def __len__(self) -> int:
        return len(self.records)

    def steps(self) -> list[int]:
        return sorted({r.step for r in self.records})


@dataclass
class Divergence:
    """Where a parallel run first parts from one process (what :func:`reference.debug.first_divergence`
    returns): the record (step, phase, module, tensor), the ranks whose pieces differ, the largest
    absolute difference, that difference over the largest entry of the one-process tensor, and
    where in the whole tensor the largest difference lies."""
    step: int
    phase: str
    module: str
    tensor: str
    ranks: list[int]
    max_abs: float
    max_rel: float = 0.0
    index: tuple[int, ...] = ()

    @property
    def rank(self) -> int:
        return self.ranks[0]

    def __str__(self) -> str:
        where = f" at [{', '.join(map(str, self.index))}]" if self.index else ""
        who = "rank" if len(self.ranks) == 1 else "ranks"
        return (f"step {self.step}, {self.phase}: {self.module or '(model)'} {self.tensor} differs on {who} "
                f"{', '.join(map(str, self.ranks))} by up to {self.max_abs:.3g} "
                f"({self.max_rel:.3g} of its largest entry){where}")


# ----------------------------------------------------------------------------------------------
# A run as plain data


def to_plain(run: Run) -> dict:
    """A Run as lists, tuples, numbers and one flat tensor per dtype (what crosses to the grader's runner
    and into a release's recorded answers): each piece is ``(rank, offsets, dtype, start, shape)``, its
    block ``data[dtype][start:start + numel].view(shape)`` — a few tensors instead of one per piece, and each
    name and shape one object (pickled once)."""
    chunks: dict[str, list] = {}
    sizes: dict[str, int] = {}
    records = []
    same: dict = {}                               # one object per distinct name and shape: pickled once
    one = lambda x: same.setdefault(x, x)         # noqa: E731
    for r in run.records:
        pieces = []
        for rank, o, b in r.pieces:
            key = one(str(b.dtype).removeprefix("torch."))
            pieces.append((rank, one(tuple(o)), key, sizes.get(key, 0), one(tuple(b.shape))))
            chunks.setdefault(key, []).append(b.detach().reshape(-1))
            sizes[key] = sizes.get(key, 0) + b.numel()
        records.append((r.step, one(r.phase), one(r.module), one(r.tensor), one(tuple(r.shape)), pieces))
    return {"records": records, "data": {k: torch.cat(v) for k, v in chunks.items()},
            "world_size": run.world_size, "info": run.info}


def _block(data: dict, piece) -> tuple:
    if len(piece) == 3:                           # (rank, offsets, block): a run written by hand
        rank, o, b = piece
        return rank, tuple(o), b
    rank, o, key, start, shape = piece
    n = 1
    for d in shape:
        n *= d
    return rank, tuple(o), data[key][start:start + n].view(shape).clone()


def from_plain(data: dict) -> Run:
    flat = data.get("data", {})
    return Run([Record(s, ph, m, t, tuple(shape), [_block(flat, p) for p in pieces])
                for s, ph, m, t, shape, pieces in data["records"]], data["world_size"], data.get("info", {}))
