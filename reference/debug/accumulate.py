"""Lecture 6, exercise 6.3 — a given run with one silent bug: gradient accumulation over padded documents.

A batch of documents of different lengths is padded to one length; the padding's targets are
``IGNORE`` (-100), which ``F.cross_entropy(..., ignore_index=IGNORE)`` leaves out.  One process's
objective is the mean loss over every REAL token of the whole batch::

    L = Σ_tokens ℓ_t / N_real            N_real = real tokens of the global batch

A data-parallel rank with gradient accumulation sees only its micro-batches.  The given step
(:func:`accumulate_gradients_given`) does what most training loops did until late 2024: each
micro-batch's mean loss, divided by the number of micro-batches, then the gradients averaged over the
ranks — a mean of means.  With equal token counts everywhere it IS the one-process gradient; with
padding a micro-batch of 3 real tokens weighs as much as one of 30, and it is not (Hugging Face
transformers PR 34191 and torchtune PR 1875, October 2024: "(x1 / n1) + (x2 / n2) != (x1 + x2) / (n1 + n2)").
Nothing crashes and the loss curve looks like a loss curve.

:func:`accumulate_gradients` is the repaired step (exercise 6.3: find the bug with
:func:`reference.debug.first_divergence`, then write it).  :func:`padded_batch` makes the data,
:func:`microbatches` a rank's share of it, :func:`record_accumulation` records either step on ranks
and :func:`record_accumulation_single` one process, for the notebook's search.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import comm

__all__ = ["IGNORE", "padded_batch", "microbatches", "accumulate_gradients_given", "accumulate_gradients",
           "record_accumulation", "record_accumulation_single", "ACCUMULATION"]

IGNORE = -100
ACCUMULATION = dict(layers=1, d_model=16, heads=2, d_ff=32, seq_len=8)    # the tiny GPT of these runs


def padded_batch(batch: int, seq_len: int, *, seed: int = 0, vocab: int = 27, min_len: int = 0, empty: tuple = ()):
    """(x, y) of ``batch`` documents padded to ``seq_len``: x (batch, seq_len) token ids, y the next
    token or IGNORE past each document's length (drawn in min_len … seq_len; 0 real tokens allowed);
    the rows in ``empty`` hold no real token at all."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (batch, seq_len), generator=g)
    y = torch.randint(0, vocab, (batch, seq_len), generator=g)
    lengths = torch.randint(min_len, seq_len + 1, (batch,), generator=g)
    y[torch.arange(seq_len).expand(batch, -1) >= lengths[:, None]] = IGNORE
    y[list(empty)] = IGNORE
    return x, y


def microbatches(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int, num_microbatches: int) -> list:
    """Rank ``rank``'s micro-batches of the global (x, y): its B/W rows, cut into m equal groups."""
    n = x.shape[0] // world_size
    mine = slice(rank * n, (rank + 1) * n)
    return list(zip(x[mine].tensor_split(num_microbatches), y[mine].tensor_split(num_microbatches)))


def accumulate_gradients_given(model, microbatches: list, *, group=None) -> float:
    """The given step, WITH ITS BUG: accumulate this rank's micro-batches, average over the ranks.
    Returns the loss it reports.  (Exercise 6.3 asks for :func:`accumulate_gradients`.)"""
    total = 0.0
    for x, y in microbatches:
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        (loss / len(microbatches)).backward()
        total += loss.item() / len(microbatches)
    W = comm.world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            comm.all_reduce(p.grad, group=group, what="grads")
            p.grad /= W
    t = torch.tensor([total], dtype=torch.float64)
    comm.all_reduce(t, group=group, what="loss")
    return float(t) / W


def accumulate_gradients(model, microbatches: list, *, group=None) -> float:
    """One step's gradient on this data-parallel rank, equal to one process's (exercise 6.3).

    microbatches: this rank's list of (x, y): x (b, S) token ids, y (b, S) targets, ``IGNORE`` (-100)
    at padding; ``model(x)`` returns logits (b, S, V).  The objective is one process's: the mean
    cross-entropy over every real (not IGNORE) token of the whole batch — all ranks of ``group``, all
    their micro-batches.  Afterwards every parameter's ``.grad`` (of every rank) holds ∂L/∂θ; returns
    L (a float, the same on every rank).  A micro-batch, a rank, even the whole batch may hold no
    real token: no NaN may come out of it (an empty batch's loss and gradients are 0).

    Graded on: every rank's returned loss and .grad against one process's on the whole padded batch (to 1e-9):
    2 ranks × 2 micro-batches, 1 rank × 4, 3 ranks × 1, and 2 ranks × 4 with micro-batches that hold no real
    token (4 ranks × 2 on fresh documents in a hidden check); each rank is given only its own micro-batches, and
    only all_reduce may communicate.
    """
    count = torch.tensor([float(sum(int((y != IGNORE).sum()) for _, y in microbatches))], dtype=torch.float64)
    comm.all_reduce(count, group=group, what="real_tokens")
    total = torch.zeros((), dtype=torch.float64)
    for x, y in microbatches:
        logits = model(x)
        summed = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        loss = summed / count.clamp(min=1.0)[0]            # this micro-batch's share of the GLOBAL mean
        loss.backward()
        total += loss.detach().double()
    for p in model.parameters():
        if p.grad is not None:
            comm.all_reduce(p.grad, group=group, what="grads")     # a sum: each share is already ÷ N_real
    t = total.reshape(1)
    comm.all_reduce(t, group=group, what="loss")
    return float(t)


def _model(seed: int, **config):
    from ..gpt import GPTConfig, TinyGPT
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(vocab=27, **{**ACCUMULATION, **config})).double()


def record_accumulation(step: str = "given", *, batch: int = 8, num_microbatches: int = 2, seed: int = 0,
                        data_seed: int = 1, steps: int = 1, lr: float = 3e-3, **config) -> dict:
    """Rank function: ``steps`` steps of the tiny GPT on padded documents, data parallel over the world,
    with the given step (``step="given"``) or the repaired one ("fixed"), every module recorded."""
    from ..compose.workers import Adam
    from .recorder import Layout, Recorder
    from .runs import watched_modules
    W, r = comm.world_size(), comm.rank()
    model = _model(seed, **config)
    S = model.cfg.seq_len
    layout = Layout(batch, S, rows=batch // W // num_microbatches, first_row=r * (batch // W))
    rec = Recorder(watched_modules(model), layout, rank=r)
    params = {n: (p, "replicated") for n, p in model.named_parameters()}
    whole = {n: tuple(p.shape) for n, p in model.named_parameters()}
    opt = Adam(model.parameters(), lr=lr)
    fn = accumulate_gradients_given if step == "given" else accumulate_gradients
    losses = []
    try:
        for i in range(steps):
            rec.start_step(i)
            opt.zero_grad()
            x, y = padded_batch(batch, S, seed=data_seed + i)
            losses.append(fn(model, microbatches(x, y, r, W, num_microbatches)))
            rec.record_params("grad", params, whole)
            opt.step()
            rec.record_params("param", params, whole)
    finally:
        rec.close()
    return {"records": rec.records, "losses": losses, "grad_norms": [], "coords": {"dp": r}}


def record_accumulation_single(*, batch: int = 8, seed: int = 0, data_seed: int = 1, steps: int = 1,
                               lr: float = 3e-3, **config):
    """One process's run of the same steps: the whole batch, its mean over real tokens."""
    from ..compose.workers import Adam
    from .recorder import Layout, Recorder
    from .records import Run
    from .runs import watched_modules
    model = _model(seed, **config)
    rec = Recorder(watched_modules(model), Layout(batch, model.cfg.seq_len, rows=batch))
    params = {n: (p, "replicated") for n, p in model.named_parameters()}
    whole = {n: tuple(p.shape) for n, p in model.named_parameters()}
    opt = Adam(model.parameters(), lr=lr)
    losses = []
    try:
        for i in range(steps):
            rec.start_step(i)
            opt.zero_grad()
            x, y = padded_batch(batch, model.cfg.seq_len, seed=data_seed + i)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
            loss.backward()
            rec.record_params("grad", params, whole)
            opt.step()
            rec.record_params("param", params, whole)
            losses.append(loss.item())
    finally:
        rec.close()
    return Run(rec.records, 1, {"losses": losses, "grad_norms": []})
