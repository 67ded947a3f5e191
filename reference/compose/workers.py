"""Lecture 5c, part 3 — rank functions that train the tiny GPT on a grid (for ``run_world``, tests,
the notebook and ``scripts/train_composed.py``).

    >>> from reference.launch import run_world
    >>> from reference.compose import workers
    >>> res = run_world(workers.train_worker, 4, {"dp": 2, "tp": 2}, 3, layers=2, d_model=16, heads=2,
    ...                 d_ff=32, seq_len=8)
    >>> res.values[0]["losses"]          # = reference.gpt.train_single(3, layers=2, d_model=16, ...)
    >>> res.values[0]["params"]          # every parameter, unsharded, by its single-process name

Every rank builds the single-process TinyGPT from the seed exactly as :func:`reference.gpt.train_single`
does (``torch.manual_seed(seed)``, float64), keeps its piece (:class:`.parallel_gpt.ParallelGPT`)
and trains it with the same Adam on the same batches (:func:`reference.gpt.get_batch`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..gpt import GPTConfig, TinyGPT, corpus, encode, get_batch
from ..mesh import RankGrid
from .parallel_gpt import ParallelGPT, check_sizes, full_state_dict
from .train import train_step
from .zero import ComposedZero

__all__ = ["Adam", "build", "make_optimizer", "fit", "train_worker", "size_errors"]


class Adam:
    """``torch.optim.Adam(params, lr)``'s step on this rank's shards, bit for bit: the same update
    function (``torch.optim.adam.adam``, the single-tensor path torch.optim.Adam takes on CPU) on
    the same state.  Adam is elementwise, so Adam on every shard is Adam on the full model.

    Why not torch.optim.Adam itself: constructing any torch.optim optimizer imports torch._dynamo,
    about 3 s of CPU per process — more than a whole run of this tiny model when 8 ranks share 2
    cores.  (the full course's ``tests/compose/test_train.py`` checks both give equal parameters.)
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        from torch.optim.adam import adam
        self._update, self.lr, self.betas, self.eps = adam, lr, betas, eps
        self.params = list(params)
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        self.steps = [torch.tensor(0.0, dtype=scalar) for _ in self.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    @torch.no_grad()
    def step(self) -> None:
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        pick = lambda xs: [xs[i] for i in live]                       # noqa: E731
        self._update(pick(self.params), [self.params[i].grad for i in live], pick(self.exp_avg),
                     pick(self.exp_avg_sq), [], pick(self.steps), foreach=False, amsgrad=False,
                     beta1=self.betas[0], beta2=self.betas[1], lr=self.lr, weight_decay=0.0, eps=self.eps,
                     maximize=False)


def build(sizes: dict, *, batch_size: int = 4, seed: int = 0, sequence_parallel: bool = False,
          num_microbatches: int = 1, zero: int = 0, dtype=torch.float64, device=None, text: str | None = None,
          recompute: str = "none", **config):
    """(model, data) on this rank: sizes (and the ZeRO stage ``fit`` will use) checked first (ValueError
    on every rank, before any message), then the single-process model from ``seed``, then this
    rank's piece of it (on ``device``; ``recompute``: "none", "selective" or "full", .parallel_gpt)."""
    data, alphabet = encode(text if text is not None else corpus())
    cfg = GPTConfig(vocab=len(alphabet), **config)
    grid = check_sizes(cfg, sizes, comm.world_size(), batch_size, sequence_parallel=sequence_parallel,
                       num_microbatches=num_microbatches, zero=zero)
    torch.manual_seed(seed)
    gpt = TinyGPT(cfg).to(dtype)
    return ParallelGPT(gpt, grid, sequence_parallel=sequence_parallel, recompute=recompute).to(device), data


def make_optimizer(model: ParallelGPT, zero: int = 0, lr: float = 3e-3):
    """:class:`Adam` on this rank's shards, or with ``zero`` 1 or 2 a :class:`.zero.ComposedZero` (collective)."""
    return ComposedZero(model, zero, Adam, lr=lr) if zero else Adam(model.parameters(), lr=lr)


def fit(model: ParallelGPT, data: torch.Tensor, steps: int, *, batch_size: int = 4, lr: float = 3e-3,
        seed: int = 0, schedule: str = "1f1b", num_microbatches: int = 1, zero: int = 0,
        clip_grad_norm: float | None = None, on_step=None, optimizer=None, start: int = 0,
        bucket_cap_mb: float = 1.0) -> list[float]:
    """Steps ``start`` … ``steps`` − 1 of :class:`Adam` (lr) on the batches :func:`reference.gpt.train_single`
    uses; the loss of each (the same on every rank).  ``zero`` 1 or 2: Adam's state sharded over dp_cp
    (:class:`.zero.ComposedZero`).  ``clip_grad_norm`` c: gradients clipped to global norm c before
    each step (.clip; the norm before clipping in ``model.grad_norm``).  ``on_step(step, loss)`` is
    called after each step.  ``optimizer``: one to keep using (e.g. restored from a checkpoint,
    .checkpoint, with ``start`` its step), else :func:`make_optimizer`'s.  The dp_cp gradient mean
    travels in buckets of ``bucket_cap_mb`` MiB during backward (.overlap)."""
    opt = optimizer if optimizer is not None else make_optimizer(model, zero, lr)
    device = next(model.parameters()).device
    losses = []
    for step in range(start, steps):
        x, y = (t.to(device) for t in get_batch(data, step, batch_size, model.cfg.seq_len, seed))
        losses.append(train_step(model, opt, x, y, schedule=schedule, num_microbatches=num_microbatches,
                                 clip_grad_norm=clip_grad_norm, bucket_cap_mb=bucket_cap_mb))
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def train_worker(sizes: dict, steps: int, *, batch_size: int = 4, lr: float = 3e-3, seed: int = 0,
                 sequence_parallel: bool = False, schedule: str = "1f1b", num_microbatches: int = 1,
                 zero: int = 0, params: str = "rank0", clip_grad_norm: float | None = None,
                 checkpoint_dir: str | None = None, checkpoint_every: int = 0, resume: bool = False,
                 recompute: str = "none", bucket_cap_mb: float = 1.0, **config) -> dict:
    """Train on the grid ``sizes`` (e.g. ``{"dp": 2, "tp": 2}``) for ``steps`` steps; every rank runs it.

    ``config``: GPTConfig fields, as for ``train_single``.  Returns {"losses": per step (equal on
    every rank), "coords": this rank's grid coordinates, "params": {single-process name: full
    tensor}}, "params" on rank 0 only by default (``params="all"``: on every rank, "none": nowhere).
    ``clip_grad_norm`` c: global-norm clipping (.clip), and "grad_norms": ‖g‖ of each step before it.
    The parameters are gathered after training (traced ``what="unshard"`` and raw events), outside
    every axis's step bytes.

    ``checkpoint_dir``: save there (.checkpoint) every ``checkpoint_every`` steps and after the last;
    ``resume``: first continue from its newest complete checkpoint.  Then also "start" (the first
    step run: "losses" are those of steps start … steps − 1), "resumed" (the path or None) and
    "saved" (one :class:`.checkpoint.Saved` per save).  ``recompute`` (.parallel_gpt) and
    ``bucket_cap_mb`` (.overlap) as for :func:`build` and :func:`fit`.
    """
    model, data = build(sizes, batch_size=batch_size, seed=seed, sequence_parallel=sequence_parallel,
                        num_microbatches=num_microbatches, zero=zero, recompute=recompute, **config)
    opt, start, norms, saved, ckpt = make_optimizer(model, zero, lr), 0, [], [], None
    if checkpoint_dir is not None:
        from . import checkpoint                      # (imports torch.distributed.checkpoint: ~0.5 s, only when used)
        meta = checkpoint.run_meta(model.cfg, seed=seed, batch_size=batch_size, lr=lr, grid=sizes, zero=zero)
        ckpt = checkpoint.Checkpoints(checkpoint_dir, checkpoint.grid_state(model, opt), meta, every=checkpoint_every)
        start = ckpt.resume() if resume else 0

    def after(step: int, loss: float) -> None:
        norms.append(model.grad_norm)
        if ckpt is not None and (s := ckpt.after_step(step + 1, steps)) is not None:
            saved.append(s)

    losses = fit(model, data, steps, batch_size=batch_size, lr=lr, seed=seed, schedule=schedule,
                 num_microbatches=num_microbatches, zero=zero, clip_grad_norm=clip_grad_norm, on_step=after,
                 optimizer=opt, start=start, bucket_cap_mb=bucket_cap_mb)
    out = {"losses": losses, "coords": model.coords}
    if ckpt is not None:
        out |= {"start": start, "resumed": ckpt.resumed and str(ckpt.resumed), "saved": saved}
    if clip_grad_norm is not None:
        out["grad_norms"] = norms
    if params != "none":
        full = full_state_dict(model)
        if params == "all" or comm.rank() == 0:
            out["params"] = full
    return out


def size_errors(cases: list[dict], **config) -> list[tuple[str, str]]:
    """For each case ``{"sizes": …, "batch_size": …, …}``: (exception type, message) of building the
    model, ("", "") if it builds.  Every rank runs every case: equal answers on every rank and no
    communication event in the run's trace show the checks run everywhere, before any message."""
    out = []
    for case in cases:
        case = dict(case)
        sizes = case.pop("sizes")
        try:
            build(sizes, **case, **config)
            out.append(("", ""))
        except Exception as e:                    # noqa: BLE001 - reported back to the caller
            out.append((type(e).__name__, str(e)))
    return out


# ----------------------------------------------------------------------------------------------
# The rank grid on a real world (the notebook's section 1, and the tests)


def group_sums(grids: list[dict], axes: list[str]) -> list[dict]:
    """For each grid (a dict of sizes), all-reduce 2**rank over ``grid.group(axis)`` for every axis.

    The sum's set bits are exactly the ranks that took part: ``bits == Σ 2**q for q in
    grid.ranks(axis)`` proves the process group and the arithmetic agree.  Also returns the
    members torch reports for the group and whether a second ``group(axis)`` call hit the cache.
    """
    r = dist.get_rank()
    out = []
    for sizes in grids:
        grid = RankGrid(dist.get_world_size(), **sizes)
        res = {}
        for axis in axes:
            g = grid.group(axis)
            t = torch.tensor([2 ** r], dtype=torch.int64)
            comm.all_reduce(t, group=g, what=f"grid_{axis}")
            members = sorted(dist.get_global_rank(g, i) for i in range(dist.get_world_size(g)))
            res[axis] = dict(bits=int(t.item()), members=members, cached=grid.group(axis) is g)
        out.append(res)
    return out


def device_mesh_groups(sizes: dict) -> dict[str, list[int]]:
    """This rank's groups in PyTorch's ``DeviceMesh`` over dims (pp, dp, cp, tp) — torchtitan's layout.

    The production peer of :class:`RankGrid`'s dense grid: the same sizes must give the same groups.
    """
    from torch.distributed.device_mesh import init_device_mesh
    names = ("pp", "dp", "cp", "tp")
    mesh = init_device_mesh("cpu", tuple(sizes.get(n, 1) for n in names), mesh_dim_names=names)
    return {n: sorted(dist.get_process_group_ranks(mesh.get_group(n))) for n in names}
