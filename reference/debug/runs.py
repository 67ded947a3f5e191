"""Lecture 6, part 2 — recorded runs: the same training on one process and on a grid, hooks on every module.

Two families, each run twice, the same way a learner would compare them:

    family     one process                                  a grid of ranks
    ─────────  ───────────────────────────────────────────  ──────────────────────────────────────────────
    "gpt"      reference.gpt.TinyGPT, Adam (lecture 5c's    reference.compose: ParallelGPT on any grid of
               ground truth), float64                       dp, tp, cp, pp, ep (+ ZeRO, clipping), stepped
                                                            by compose.train.train_step (overlap off: one
                                                            synchronisation call after backward)
    "blocks"   two of lecture 4a's Blocks with dropout      their ParallelBlocks over tp ranks: attention
               (attention probabilities and hidden),        dropout per head stream, hidden dropout from one
               a squared error, SGD                         stream every tp rank shares (reference.tensor)

:func:`record_single` records one process; :func:`record_grid` is the rank function (``plant=`` puts one
bug of :mod:`.plants` into it), :func:`record_parallel` runs it on a world and merges the ranks' records
into one :class:`.records.Run`.  Module names are the one-process model's on both sides.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from .. import comm
from .recorder import Layout, Recorder, RecordingOptimizer
from .records import Run

__all__ = ["TINY", "BATCH", "MOE", "record_single", "record_grid", "record_parallel", "record_many", "merge",
           "watched_modules", "BlockStack", "BLOCKS"]

# The recorded models are as small as every plant allows (two heads for tp 2, four tokens for cp 2's zigzag
# chunks, a batch of two for dp 2): a run keeps every module's tensors of every step, and the student release
# ships 6.2's runs among its recorded answers — 2.0 MB for its eleven runs and five one-process runs (26 MB at
# d_model 16, d_ff 32, 8 tokens, a batch of 4); they record in a third of the time, and every plant is still
# found where it is planted (the course's tests check each one).
TINY = dict(layers=2, d_model=4, heads=2, d_ff=8, seq_len=4)       # the recorded tiny GPT: every axis fits
BATCH = 2                                                          # its batch (dp 2: a row per rank)
MOE = dict(num_experts=4, top_k=2, moe_every=2)                    # its second block a MoE layer
BLOCKS = dict(layers=2, d_model=4, heads=2, d_ff=8, seq_len=4, batch=2, dropout_p=0.25, lr=0.1)

_WATCHED = re.compile(r"(tok_emb|ln_f|head|blocks\.\d+(\.(ln1|ln2|attn|attn\.qkv|attn\.proj|mlp|mlp\.fc1|mlp\.fc2"
                      r"|mlp\.moe\.router))?)")


def watched_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules a run is recorded at: embeddings, each block and its LayerNorms, attention (qkv, proj),
    MLP (fc1, fc2) or MoE router, the final LayerNorm and the head — by their one-process names."""
    return {name: m for name, m in model.named_modules() if _WATCHED.fullmatch(name)}


class BlockStack(nn.Module):
    """``blocks.0``, ``blocks.1``, …: x (S, B, d) through each block in turn (the "blocks" family)."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _blocks_data(cfg: dict, seed: int):
    """(x, target), each (S, B, d); x requires grad, so the first block's ∂L/∂input is recorded too."""
    g = torch.Generator().manual_seed(seed + 1)
    shape = (cfg["seq_len"], cfg["batch"], cfg["d_model"])
    x = torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_()
    return x, torch.randn(shape, generator=g, dtype=torch.float64)


def _blocks_model(cfg: dict, seed: int) -> BlockStack:
    from ..tensor import Block
    torch.manual_seed(seed)
    return BlockStack([Block(cfg["d_model"], cfg["heads"], cfg["d_ff"], dropout_p=cfg["dropout_p"],
                             dtype=torch.float64) for _ in range(cfg["layers"])])


def _sgd(params, lr: float) -> None:
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p -= lr * p.grad


# ----------------------------------------------------------------------------------------------
# One process


def record_single(family: str = "gpt", steps: int = 2, *, batch_size: int = BATCH, lr: float = 3e-3, seed: int = 0,
                  clip_grad_norm: float | None = None, **config) -> Run:
    """Record ``steps`` steps of ``family`` on one process (float64).  ``config``: GPTConfig fields
    over :data:`TINY` ("gpt") or :data:`BLOCKS` keys ("blocks")."""
    losses, norms = [], []
    if family == "blocks":
        cfg = {**BLOCKS, **config}
        model, (x, target) = _blocks_model(cfg, seed), _blocks_data(cfg, seed)
        layout = Layout(cfg["batch"], cfg["seq_len"], rows=cfg["batch"], seq_first=True)
    else:
        from ..compose.workers import Adam
        from ..gpt import GPTConfig, TinyGPT, corpus, encode, get_batch
        data, alphabet = encode(corpus())
        torch.manual_seed(seed)
        model = TinyGPT(GPTConfig(vocab=len(alphabet), **{**TINY, **config})).double()
        layout = Layout(batch_size, model.cfg.seq_len, rows=batch_size)
        opt = Adam(model.parameters(), lr=lr)
    rec = Recorder(watched_modules(model), layout)
    params = {n: (p, "replicated") for n, p in model.named_parameters()}
    whole = {n: tuple(p.shape) for n, p in model.named_parameters()}
    try:
        for step in range(steps):
            rec.start_step(step)
            for p in model.parameters():
                p.grad = None
            if family == "blocks":
                for i, b in enumerate(model.blocks):
                    b.seed = 1000 * step + i
                loss = (model(x) - target).pow(2).mean()
            else:
                x, y = get_batch(data, step, batch_size, model.cfg.seq_len, seed)
                loss = model.loss(x, y)
            loss.backward()
            if clip_grad_norm is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)))
            rec.record_params("grad", params, whole)
            _sgd(model.parameters(), cfg["lr"]) if family == "blocks" else opt.step()
            rec.record_params("param", params, whole)
            losses.append(loss.item())
    finally:
        rec.close()
    return Run(rec.records, 1, {"losses": losses, "grad_norms": [norms] if norms else []})


# ----------------------------------------------------------------------------------------------
# A grid of ranks


def record_grid(family: str = "gpt", sizes: dict | None = None, steps: int = 2, *, plant: str | None = None,
                where: dict | None = None, batch_size: int = BATCH, lr: float = 3e-3, seed: int = 0,
                num_microbatches: int = 1, zero: int = 0, clip_grad_norm: float | None = None, **config) -> dict:
    """Rank function: this rank's records of ``steps`` steps of ``family`` on the grid ``sizes`` ("blocks":
    tp over the whole world), with ``plant`` (a name of :data:`.plants.PLANTS`, at ``where``) planted.
    Returns {"records", "losses", "grad_norms", "coords"}."""
    from . import plants
    if family == "blocks":
        return _record_blocks(steps, plant=plant, where=where or {}, seed=seed, **config)
    from ..compose.checkpoint import global_shapes
    from ..compose.train import train_step
    from ..compose.workers import build, make_optimizer
    from ..gpt import get_batch
    from ..sequence import positions
    model, data = build(sizes or {}, batch_size=batch_size, seed=seed, num_microbatches=num_microbatches,
                        zero=zero, **{**TINY, **config})
    grid, c, cfg = model.grid, model.coords, model.cfg
    layout = Layout(batch_size, cfg.seq_len, rows=batch_size // grid.dp // num_microbatches,
                    first_row=c["dp"] * (batch_size // grid.dp), tp=grid.tp, tp_rank=c["tp"], seq_first=True,
                    positions=tuple(positions(cfg.seq_len, c["cp"], grid.cp, "zigzag" if grid.cp > 1 else
                                              "contiguous").tolist()), vocab=cfg.vocab)
    rec = Recorder(watched_modules(model), layout, rank=comm.rank(), grad_scale=1.0 / (grid.dp * grid.cp))
    params = {n: (s.param, s.kind) for n, s in model.shards.items()}
    whole = global_shapes(cfg)
    opt = make_optimizer(model, zero, lr)
    undo = plants.apply(plant, model, opt, where or {}) if plant else (lambda: None)
    ropt = RecordingOptimizer(opt, (lambda: None) if zero else (lambda: rec.record_params("grad", params, whole)),
                              lambda: rec.record_params("param", params, whole))
    losses, norms = [], []
    try:
        for step in range(steps):
            rec.start_step(step)
            x, y = get_batch(data, step, batch_size, cfg.seq_len, seed)
            losses.append(train_step(model, ropt, x, y, num_microbatches=num_microbatches,
                                     clip_grad_norm=clip_grad_norm, overlap=False))
            norms.append(model.grad_norm)
    finally:
        rec.close()
        undo()
    return {"records": rec.records, "losses": losses, "grad_norms": norms, "coords": c}


def _record_blocks(steps: int, *, plant: str | None, where: dict, seed: int = 0, **config) -> dict:
    from ..tensor import ParallelBlock
    from . import plants
    cfg = {**BLOCKS, **config}
    single, (x, target) = _blocks_model(cfg, seed), _blocks_data(cfg, seed)
    model = BlockStack([ParallelBlock.from_module(b) for b in single.blocks])
    W, r = comm.world_size(), comm.rank()
    rec = Recorder(watched_modules(model), Layout(cfg["batch"], cfg["seq_len"], rows=cfg["batch"], tp=W, tp_rank=r,
                                                  seq_first=True), rank=r)
    from ..compose.parallel_gpt import shard_table
    params = {n: (s.param, s.kind) for n, s in shard_table(model).items()}
    whole = {n: tuple(p.shape) for n, p in single.named_parameters()}
    undo = plants.apply(plant, model, None, where) if plant else (lambda: None)
    losses = []
    try:
        for step in range(steps):
            rec.start_step(step)
            for p in model.parameters():
                p.grad = None
            for i, b in enumerate(model.blocks):
                b.seed = 1000 * step + i
            loss = (model(x) - target).pow(2).mean()
            loss.backward()
            rec.record_params("grad", params, whole)
            _sgd(model.parameters(), cfg["lr"])
            rec.record_params("param", params, whole)
            losses.append(loss.item())
    finally:
        rec.close()
        undo()
    return {"records": rec.records, "losses": losses, "grad_norms": [], "coords": {"tp": r}}


def merge(values: list[dict], grid: dict | None = None) -> Run:
    """One :class:`.records.Run` from every rank's :func:`record_grid` result: records of the same key
    get every rank's pieces (in the order the ranks first recorded them)."""
    by_key: dict = {}
    for v in values:
        for rec in v["records"]:
            if rec.key in by_key:
                by_key[rec.key].pieces.extend(rec.pieces)
            else:
                by_key[rec.key] = rec
    info = {"losses": values[0]["losses"], "grad_norms": [v["grad_norms"] for v in values],
            "coords": [v["coords"] for v in values], "grid": dict(grid or {})}
    return Run(list(by_key.values()), len(values), info)


def _many(cases: list[dict]) -> list[dict]:
    return [record_grid(**case) for case in cases]


def record_many(cases: list[dict], world_size: int, world=None, timeout: float = 120.0) -> list[Run]:
    """Run :func:`record_grid` for each case (keyword dicts) on one world of ``world_size`` (``world``: a
    kept one), one after the other; the merged :class:`.records.Run` of each."""
    from ..launch import World
    own = world is None
    w = World(world_size, timeout=timeout, echo=False) if own else world
    try:
        values = w.run(_many, cases, timeout=timeout).values
    finally:
        if own:
            w.close()
    return [merge([v[i] for v in values], c.get("sizes")) for i, c in enumerate(cases)]


def record_parallel(family: str = "gpt", sizes: dict | None = None, steps: int = 2, *, world=None,
                    world_size: int | None = None, **kw) -> Run:
    """:func:`record_grid` on a world (``world``, or a fresh one of the grid's size) → a merged Run."""
    n = world_size or (world.world_size if world is not None else _grid_size(sizes or {}))
    return record_many([dict(family=family, sizes=sizes, steps=steps, **kw)], n, world)[0]


def _grid_size(sizes: dict) -> int:
    n = 1
    for a in ("tp", "cp", "dp", "pp"):
        n *= sizes.get(a, 1)
    return n
