"""Lecture 5c, part 4 — checkpoints that outlive the grid: save on one layout, resume on another.

A long run stops: a node dies, the job's time is up, the cluster gives it more (or fewer) machines.
So every few steps the run writes what it needs to continue — the parameters, Adam's two moments
and step counts, and the step number, which here is the whole data position (the batch of step t
is a pure function of (seed, t), reference.gpt.get_batch; no random numbers are drawn after the
initialisation: no dropout, deterministic routing, so there is no RNG state to keep).

Nothing is gathered.  Each rank writes only its own slices, through PyTorch's distributed checkpoint
(``torch.distributed.checkpoint``, DCP), and describes each slice by its GLOBAL place: the single-
process tensor (the same name, :func:`.parallel_gpt.full_state_dict`'s, its unpadded shape) and the
offsets of the slice in it.  DCP writes one file per rank plus a ``.metadata`` listing every chunk;
loading is the same question asked the other way round — "which part of which saved chunk covers
my slice?" — so a checkpoint loads onto any grid, or onto one process::

    blocks.0.mlp.fc1.weight, global (32, 16), column-cut (parallel_gpt's "column"), saved on dp 2 × tp 2:

                 tp 0 (ranks 0, 2)   rows  0-15 ──▶ chunk offsets (0, 0),  sizes (16, 16)  one copy written
                 tp 1 (ranks 1, 3)   rows 16-31 ──▶ chunk offsets (16, 0), sizes (16, 16)  (DCP drops the
                                                                                          dp duplicates)
    resumed on tp 4:  tp 0 rows  0-7  ◀── rows 0-7  of chunk (0, 0)
                      tp 1 rows  8-15 ◀── rows 8-15 of chunk (0, 0)
                      tp 2 rows 16-23 ◀── rows 0-7  of chunk (16, 0)      (and one process: all four reads)
                      tp 3 rows 24-31 ◀── rows 8-15 of chunk (16, 0)

Each cut of parallel_gpt's shard table becomes boxes of the global tensor (:func:`_row_pieces`):

    kind        this tp rank r of W holds (local n rows, c columns)      chunks it writes (global offsets)
    replicated  the whole tensor                                          (0, 0)  — every copy the same box
    column      rows r·n … of the global                                  (r·n, 0)
    row         columns r·c …                                             (0, r·c)
    qkv         [q_r; k_r; v_r]: n/3 rows of each of q, k, v              (r·n/3, 0), (d + r·n/3, 0), (2d + r·n/3, 0)
    vocab       rows r·n … of the vocabulary padded to a multiple of W    (r·n, 0), minus the padding rows
    (pp stages and ep ranks hold different names: nothing to cut; dp and cp copies: identical boxes, deduplicated)

Adam's moments have their parameter's shape, so they are cut the same way.  Under ZeRO (.zero) a
dp·cp rank holds elements [r·S, (r+1)·S) of the FLAT concatenation of its dense shards: its range is
cut into rectangles of each parameter (a partial row, full rows, a partial row) and each rectangle
is placed like the parameter's slice, so ZeRO moments are saved per parameter, in the same global
layout — a ZeRO run resumes without ZeRO, with another dp, or on one process, and the other way::

    flat dense shards of tp rank 0:  │ ln1.w │ qkv.w (rows …) │ proj.w │ … │ pad │
    ZeRO over dp 2:                  │ dp 0: exp_avg[0, S)     │ dp 1: exp_avg[S, 2S) │
    dp 1 writes: the rest of a qkv row (1 × k), full rows after it, … each at its global offset

Keys (one DCP entry each): ``model.<name>``, ``optim.exp_avg.<name>``, ``optim.exp_avg_sq.<name>``,
``optim.step.<name>`` (0-d: torch.optim.Adam keeps one per parameter) and ``train`` (a small dict:
step, seed, batch size, lr, the model config, the grid it was saved on: a resume with another config,
seed or batch size is refused).

Why not DTensor: DTensor's placements (Shard(dim), Replicate() on a DeviceMesh) describe column,
row and vocab cuts (torch.chunk's uneven split is exactly the padded vocabulary's), but not qkv's
three slices per rank nor ZeRO's flat ranges; DCP's planner takes any list of boxes, so this module
hands it boxes, the form DTensor's own ``__create_write_items__`` produces (tests compare the two).

How the files are written and read — atomically (a ``.tmp`` directory renamed once complete),
with checksums, and refused on every rank when they do not fit or are damaged — is
:mod:`.checkpoint_files`.  :class:`Checkpoints` puts it together for a training loop
(``workers.train_worker`` and ``scripts/train_composed.py``: ``--checkpoint-dir``, ``--checkpoint-every``,
``--resume``).
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from .. import comm
from ..gpt import GPTConfig, TinyGPT
from .checkpoint_files import MANIFEST, CheckpointError, GlobalTensor, Saved, latest, load, save
from .parallel_gpt import ParallelGPT
from .zero import ComposedZero

__all__ = ["CheckpointError", "GlobalTensor", "Saved", "Checkpoints", "grid_state", "single_state", "run_meta",
           "global_shapes", "expected_keys", "save", "load", "latest", "save_due", "MANIFEST"]


# ----------------------------------------------------------------------------------------------
# Where this rank's slices lie in the global tensors


def global_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every single-process parameter's name → shape (a TinyGPT on the meta device: no memory, no RNG)."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return {n: tuple(p.shape) for n, p in TinyGPT(cfg).named_parameters()}


def bias_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The loss-free balancing biases (buffers, ``blocks.<i>.mlp.moe.expert_bias``) → shape: training
    state as much as Adam's moments, saved as ``model.<name>`` (none for the other balances)."""
    if not cfg.balance.startswith("loss_free"):
        return {}
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return {n: tuple(b.shape) for n, b in TinyGPT(cfg).named_buffers() if n.endswith("expert_bias")}


def _row_pieces(kind: str, r: int, local: tuple, full: tuple) -> list[tuple[int, int, tuple[int, ...]]]:
    """The local row ranges [lo, hi) of a shard (tp rank r) and the global offsets of row lo, column 0."""
    n, zero = local[0], (0,) * len(local)
    if kind == "replicated":
        return [(0, n, zero)]
    if kind == "column":
        return [(0, n, (r * n, *zero[1:]))]
    if kind == "row":
        return [(0, n, (0, r * local[1]))]
    if kind == "qkv":                                 # [q_r; k_r; v_r], each n/3 rows of a global third
        m = n // 3
        return [(j * m, (j + 1) * m, (j * full[0] // 3 + r * m, *zero[1:])) for j in range(3)]
    if kind == "vocab":                               # the rows past the real vocabulary are padding
        real = max(0, min(n, full[0] - r * n))
        return [(0, real, (r * n, *zero[1:]))] if real else []
    raise ValueError(f"unknown shard kind {kind!r}")


def _segments(shape: tuple, a: int, b: int) -> list[tuple[int, int, int, int]]:
    """Elements [a, b) of a row-major (rows, cols) tensor (1-D: cols = 1) as rectangles contiguous in
    memory, (row, col, rows, cols): a partial first row, the full rows, a partial last row."""
    C = shape[1] if len(shape) == 2 else 1
    out = []
    i, j = divmod(a, C)
    if j and a < b:
        e = min(b, (i + 1) * C)
        out.append((i, j, 1, e - a))
        a, i = e, i + 1
    if (full := (b - a) // C) > 0:
        out.append((i, 0, full, C))
        a, i = a + full * C, i + full
    if a < b:
        out.append((i, 0, 1, b - a))
    return out


def _pieces(kind: str, r: int, local: tuple, full: tuple, flat: torch.Tensor, base: int = 0, a: int = 0,
            b: int | None = None) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Elements [a, b) of a local shard of shape ``local`` (element f stored at ``flat[f - base]``) as
    (global offsets, view) boxes of the global tensor of shape ``full``."""
    if len(local) not in (1, 2):
        raise ValueError(f"only 1-D and 2-D tensors are placed here, got shape {local}")
    b = flat.numel() + base if b is None else b
    C = local[1] if len(local) == 2 else 1
    out = []
    for lo, hi, g in _row_pieces(kind, r, local, full):
        for i, j, h, w in _segments(local, a, b):
            top, bottom = max(i, lo), min(i + h, hi)
            if top >= bottom:
                continue
            start = top * C + j - base
            view = flat[start:start + (bottom - top) * w]
            if len(local) == 2:
                out.append(((g[0] + top - lo, g[1] + j), view.view(bottom - top, w)))
            else:
                out.append(((g[0] + top - lo,), view))
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(-1)                        # a view: loading writes into the tensor itself


def grid_state(model: ParallelGPT, optimizer) -> dict[str, GlobalTensor]:
    """What this rank of a composed run holds, by global key: its parameters (``model.shards``), and the
    state of ``optimizer`` — a :class:`reference.compose.workers.Adam` or a :class:`.zero.ComposedZero`
    (ZeRO flat shards placed per parameter).  Views: build it once, after the optimizer."""
    shapes = global_shapes(model.cfg)
    names = {id(s.param): n for n, s in model.shards.items()}
    state: dict[str, GlobalTensor] = {}

    def add(key: str, name: str, flat: torch.Tensor, **span) -> None:
        s = model.shards[name]
        r = model.coords["etp" if s.expert else "tp"]         # an expert is cut over etp (tp, or 1 when folded)
        pieces = _pieces(s.kind, r, tuple(s.param.shape), shapes[name], flat, **span)
        if pieces:
            state.setdefault(key, GlobalTensor(shapes[name])).pieces.extend(pieces)

    for name, s in model.shards.items():
        add(f"model.{name}", name, _flat(s.param))
    buffers = dict(model.named_buffers())
    for name, shape in bias_shapes(model.cfg).items():      # this stage's layers: replicated everywhere
        if name in buffers:
            state[f"model.{name}"] = GlobalTensor(shape, [((0,), buffers[name])])
    zero = isinstance(optimizer, ComposedZero)
    for adam in [optimizer.experts] if zero else [optimizer]:
        for i, p in enumerate(adam.params):
            name = names[id(p)]
            add(f"optim.exp_avg.{name}", name, _flat(adam.exp_avg[i]))
            add(f"optim.exp_avg_sq.{name}", name, _flat(adam.exp_avg_sq[i]))
            state[f"optim.step.{name}"] = GlobalTensor((), [((), adam.steps[i])])
    if zero:                                          # my range [lo, lo + S) of the flat dense shards
        d = optimizer.dense
        S = d.shard.numel()
        lo, offset, adam = comm.rank(d.group) * S, 0, d.optimizer
        for p in d.params:
            name, n = names[id(p)], p.numel()
            a, b = max(lo, offset) - offset, min(lo + S, offset + n) - offset
            if a < b:
                for moment in ("exp_avg", "exp_avg_sq"):
                    add(f"optim.{moment}.{name}", name, getattr(adam, moment)[0], base=lo - offset, a=a, b=b)
            state[f"optim.step.{name}"] = GlobalTensor((), [((), adam.steps[0])])     # one count for the shard
            offset += n
    return state


def single_state(model: TinyGPT, optimizer: torch.optim.Optimizer) -> dict[str, GlobalTensor]:
    """The same keys for one process: ``model`` and its ``torch.optim.Adam`` (whose state is created
    here as torch.optim.Adam would at its first step — zeros, step 0 — so it can be loaded into)."""
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    state = {}
    for name, p in model.named_parameters():
        st = optimizer.state[p]
        if not st:
            st.update(step=torch.tensor(0.0, dtype=scalar), exp_avg=torch.zeros_like(p),
                      exp_avg_sq=torch.zeros_like(p))
        zero = (0,) * p.dim()
        for key, t in (("model", p), ("optim.exp_avg", st["exp_avg"]), ("optim.exp_avg_sq", st["exp_avg_sq"])):
            state[f"{key}.{name}"] = GlobalTensor(tuple(p.shape), [(zero, t.detach())])
        state[f"optim.step.{name}"] = GlobalTensor((), [((), st["step"])])
    buffers = dict(model.named_buffers())
    for name, shape in bias_shapes(model.cfg).items():
        state[f"model.{name}"] = GlobalTensor(shape, [((0,), buffers[name])])
    return state


def run_meta(cfg: GPTConfig, *, step: int = 0, seed: int = 0, batch_size: int = 4, lr: float = 3e-3,
             grid: dict | None = None, zero: int = 0) -> dict:
    """The ``train`` entry: the data position (``step``) and what a resume must share with the saved run."""
    return dict(step=step, seed=seed, batch_size=batch_size, lr=lr, config=asdict(cfg), grid=dict(grid or {}),
                zero=zero)


def expected_keys(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every key a checkpoint of this model holds → its global shape (``train`` aside)."""
    shapes = global_shapes(cfg)                       # the parameters first: errors name them before their state
    kinds = ("model", "optim.exp_avg", "optim.exp_avg_sq")
    return ({f"{k}.{n}": s for k in kinds for n, s in shapes.items()} | {f"optim.step.{n}": () for n in shapes}
            | {f"model.{n}": s for n, s in bias_shapes(cfg).items()})


def save_due(done: int, total: int, every: int) -> bool:
    """After ``done`` of ``total`` steps: every ``every``-th step (0: never), and after the last."""
    return done == total or (every > 0 and done % every == 0)


class Checkpoints:
    """One run's checkpoint directory, for the ranks of ``group`` (or one process).

    ``resume()`` loads the newest complete checkpoint (rank 0 looks, every rank gets its answer) into
    ``state`` and returns its step, or 0 if there is none (``resumed``: its path, or None).
    ``after_step(done, total)`` saves when :func:`save_due` says so and returns the :class:`Saved`."""

    def __init__(self, directory, state: dict[str, GlobalTensor], meta: dict, *, every: int = 0, group=None):
        self.directory, self.state, self.meta = Path(directory), state, meta
        self.every, self.group = every, group
        self.resumed: Path | None = None

    def resume(self) -> int:
        distributed = dist.is_available() and dist.is_initialized()
        found: list = [None, None]                    # (path, error): rank 0's answer, for every rank
        if not distributed or comm.rank(self.group) == 0:
            try:
                found = [str(p) if (p := latest(self.directory)) else None, None]
            except OSError as e:
                found = [None, f"cannot look for checkpoints in {self.directory}: {type(e).__name__}: {e}"]
        if distributed:
            dist.broadcast_object_list(found, src=comm.global_rank(self.group, 0), group=self.group)
        if found[1] is not None:
            raise CheckpointError(found[1])
        if found[0] is None:
            return 0
        self.resumed = Path(found[0])
        expected = expected_keys(GPTConfig(**self.meta["config"]))
        return int(load(self.resumed, self.state, self.meta, expected, group=self.group)["step"])

    def after_step(self, done: int, total: int) -> Saved | None:
        if not save_due(done, total, self.every):
            return None
        return save(self.directory, self.state, dict(self.meta, step=done), group=self.group)
