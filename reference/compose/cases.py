"""Lecture 5c — the data exercises 5c.2 and 5c.3 are checked on, computed by the reference.

**5c.2: every rank's gradients before and after synchronisation.**

One training step of the tiny GPT on a grid, stopped between ``backward`` and the optimizer::

    rank r:  forward + backward on ITS tokens  ──▶  raw[r]     (the gradient of L_r, its own loss)
             sync_gradients(model)              ──▶  synced[r]  (the gradient of L = mean of the L_r)

``raw`` and ``synced`` hold this rank's local tensors (its tensor/expert shards) by their
single-process names, with the kind of each: "dense" (averaged over dp_cp), "expert" (summed over
edp, divided by dp·cp) or "sp" (summed over tp first, then as dense).  ``synced`` is checked here
against the single-process gradient (:func:`reference.gpt.batch_grads`), unsharded, so a case is
only handed out when the reference got it right.

The grader gives ``raw`` to the learner's ``sync_gradients`` on a world of the same grid
(:class:`GradView`: the parameters without the model), so exercise 5c.2 needs no other exercise:
the forward through lectures 4–5b's layers happened here, with the reference.

**5c.3: one rank's byte counts** (:func:`bytes_case`): the arguments :func:`.estimate.step_bytes`
takes for one rank of a grid, and the bytes that rank sends on dp_cp, cp and pp by
:func:`.train.expected_bytes` — the formula the full course's ``tests/compose/test_train.py`` holds equal to the
trace of real runs on every rank.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .. import comm
from ..gpt import batch_grads, get_batch
from ..mesh import AxisGroups, RankGrid
from ..pipeline import run_pipeline
from .parallel_gpt import ParallelGPT, full_state_dict
from .train import local_batch, sync_gradients
from .workers import build

__all__ = ["param_kinds", "raw_and_synced", "sync_case", "GradView", "bytes_case"]


def param_kinds(model: ParallelGPT) -> dict[str, str]:
    """Single-process name → "dense", "expert" or "sp" for every parameter this rank holds."""
    sp = {id(p) for p in model.sequence_parallel_params()}
    expert = {id(p) for p in model.expert_params()}
    return {name: "sp" if id(s.param) in sp else "expert" if id(s.param) in expert else "dense"
            for name, s in model.shards.items()}


def _grads(model: ParallelGPT) -> dict[str, torch.Tensor]:
    return {name: s.param.grad.detach().clone() for name, s in model.shards.items() if s.param.grad is not None}


def raw_and_synced(sizes: dict, *, batch_size: int = 4, seed: int = 0, sequence_parallel: bool = False,
                   num_microbatches: int = 1, schedule: str = "1f1b", step: int = 0, **config) -> dict:
    """Rank function: this rank's gradients of step ``step``'s batch, before and after
    :func:`reference.compose.train.sync_gradients`; and rank 0's unsharded synced gradients
    ("full": every parameter by name, gathered over tp, ep and pp) for the check against one process."""
    model, data = build(sizes, batch_size=batch_size, seed=seed, sequence_parallel=sequence_parallel,
                        num_microbatches=num_microbatches, **config)
    x, y = get_batch(data, step, batch_size, model.cfg.seq_len, seed)
    x, y = local_batch(x, y, model)
    if model.grid.pp == 1:
        model.loss(x, y).backward()
    else:
        run_pipeline(model, schedule, x, y, model.loss_fn, num_microbatches=num_microbatches,
                     group=model.groups["pp"], shapes=model.stage_shapes(x.shape[0] // num_microbatches))
    raw = _grads(model)
    sync_gradients(model)
    synced = _grads(model)
    for s in model.shards.values():                 # full_state_dict gathers .data: hand it the grads
        g = s.param.grad if s.param.grad is not None else torch.zeros_like(s.param)
        s.param.data, s.param.grad = g, None
    full = full_state_dict(model)
    return {"raw": raw, "synced": synced, "kinds": param_kinds(model), "coords": model.coords,
            "full": full if comm.rank() == 0 else None}


_CACHE: dict[tuple, dict] = {}      # one case's answer, by its canonical key (a grader grades many submissions)


def _key(sizes: dict, kw: dict) -> tuple:
    return tuple(sorted(dict(kw, sizes=tuple(sorted(sizes.items()))).items()))


def _world_size(sizes: dict) -> int:
    n = 1
    for a in ("tp", "cp", "dp", "pp"):
        n *= sizes.get(a, 1)
    return n


def _many(cases: list[tuple[dict, dict]]) -> list[dict]:
    """Rank function: :func:`raw_and_synced` for each (sizes, keywords), one after the other."""
    return [raw_and_synced(sizes, **kw) for sizes, kw in cases]


def sync_case(sizes: dict, *, together: tuple = (), tol: float = 1e-10, **kw) -> dict:
    """Run :func:`raw_and_synced` on a world of the grid; check the synced gradients against one
    process; return {"raw": [per rank], "synced": [per rank], "kinds": [per rank], "coords": [...]}.

    Keyword arguments as for :func:`raw_and_synced`.  ``together``: other cases ((sizes, keywords)
    pairs) of the same world size, computed in the same world and kept for their own calls — one
    world start instead of one per case.  Answers are cached by case.
    """
    from ..launch import run_world
    key = _key(sizes, kw)
    if key not in _CACHE:
        n = _world_size(sizes)
        todo = [(dict(sizes), dict(kw))] + [(dict(s), dict(k)) for s, k in together
                                            if _world_size(s) == n and _key(s, k) not in _CACHE and _key(s, k) != key]
        res = run_world(_many, n, todo, timeout=60)
        for i, (s_i, kw_i) in enumerate(todo):
            values = [v[i] for v in res.values]
            _check_against_one_process(values[0]["full"], tol, **kw_i)
            _CACHE[_key(s_i, kw_i)] = {k: [v[k] for v in values] for k in ("raw", "synced", "kinds", "coords")}
    return copy.deepcopy(_CACHE[key])


def _check_against_one_process(full: dict, tol: float, *, batch_size: int = 4, seed: int = 0,
                               sequence_parallel: bool = False, num_microbatches: int = 1, schedule: str = "1f1b",
                               step: int = 0, **config) -> None:
    truth = batch_grads(step, batch_size=batch_size, seed=seed, **config)
    for name, want in truth.items():
        err = (full[name] - want).abs().max().item()
        if err > tol:
            raise AssertionError(f"the reference's synchronised {name} is {err:.3g} from one process's")


class GradView(nn.Module):
    """What ``sync_gradients(model)`` may use of a :class:`ParallelGPT`, without the model: ``grid``,
    ``groups`` (every axis's process group, created in the same order on every rank), and the
    parameters by kind — each a tensor with ``.grad`` set to this rank's raw gradient.

    Built on every rank of a world whose size is the grid's (it creates groups)."""

    def __init__(self, sizes: dict, raw: dict[str, torch.Tensor], kinds: dict[str, str], *, moe: bool = False,
                 sequence_parallel: bool = False):
        super().__init__()
        self.grid = RankGrid(comm.world_size(), **sizes)
        axes = ["tp", "cp", "dp", "dp_cp", "pp"] + (["ep", "edp"] if moe else [])     # as ParallelGPT makes them
        self.groups = AxisGroups((axis, self.grid.group(axis)) for axis in axes)
        self.sequence_parallel = sequence_parallel and self.grid.tp > 1
        self.names = list(raw)
        self.kinds = dict(kinds)
        self.params = nn.ParameterList()
        for name in self.names:
            p = nn.Parameter(torch.zeros_like(raw[name]))
            p.grad = raw[name].clone()
            self.params.append(p)

    def _of(self, *kinds: str) -> list[nn.Parameter]:
        return [p for n, p in zip(self.names, self.params) if self.kinds[n] in kinds]

    def dense_params(self) -> list[nn.Parameter]:
        return self._of("dense", "sp")

    def expert_params(self) -> list[nn.Parameter]:
        return self._of("expert")

    def sequence_parallel_params(self) -> list[nn.Parameter]:
        return self._of("sp")

    def grads(self) -> dict[str, torch.Tensor | None]:
        return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in zip(self.names, self.params)}


def bytes_case(sizes: dict, rank: int, *, layers: int, d_model: int, heads: int, seq_len: int, batch: int,
               num_microbatches: int = 1) -> tuple[dict, dict]:
    """(the keyword arguments of ``step_bytes`` for ``rank`` of the dense tiny GPT on ``sizes``,
    {axis: bytes it sends per step} for dp_cp, cp and pp by :func:`.train.expected_bytes`)."""
    from ..gpt import GPTConfig
    from ..pipeline import balanced_sizes
    from .train import expected_bytes, param_counts
    n = 1
    for a in ("tp", "cp", "dp", "pp"):
        n *= sizes.get(a, 1)
    grid = RankGrid(n, rank=rank, **sizes)
    cfg = GPTConfig(vocab=27, layers=layers, d_model=d_model, heads=heads, d_ff=2 * d_model, seq_len=seq_len)
    coords = grid.coords()
    dense, _ = param_counts(cfg, grid, coords["pp"])
    dims = ("tp", "cp", "dp", "pp")
    args = dict(sizes={a: grid.sizes[a] for a in dims}, coords={a: coords[a] for a in dims},
                tokens=batch // grid.dp * (seq_len // grid.cp), d_model=d_model,
                layers=balanced_sizes(layers, grid.pp)[coords["pp"]], dense_params=dense,
                num_microbatches=num_microbatches)
    want = expected_bytes(cfg, grid, coords, batch)
    return args, {a: want[a] for a in ("dp_cp", "cp", "pp") if a in want}
