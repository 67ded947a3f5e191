"""Lecture 5a's harness: rank functions around the learner's 5a.2–5a.5 (the rings' kernel calls are
counted here, by grader code, as feedback).  Each rank gets its own shard only (``mine``)."""
from __future__ import annotations

import contextlib
import importlib
import math
from typing import Any

import torch

from reference.rank_program import return_freed_memory


def tokens_tensor(shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """A float64 tensor whose entries along ``dim`` at index 0 elsewhere are the token positions,
    and every entry is distinct: x[..., s, ...] = s + 1000·(flat index of the other coordinates)."""
    dim = dim % len(shape)
    n = shape[dim]
    others = [s for i, s in enumerate(shape) if i != dim]
    rest = torch.arange(math.prod(others), dtype=torch.float64).reshape(others) * 1000
    x = rest.unsqueeze(dim) + torch.arange(n, dtype=torch.float64).reshape([n if i == dim else 1
                                                                             for i in range(len(shape))])
    return x.contiguous()


def shard_harness(module: str, cases: list[tuple]) -> list[Any]:
    """Runs in one process: shard_sequence for each (x, rank, W, layout, dim); exceptions come back as
    ``{"raised": type name, "message": ...}`` (NotImplementedError propagates)."""
    from . import function
    shard = function(module, "shard_sequence")
    out = []
    for x, r, W, layout, dim in cases:
        try:
            y = shard(x, r, W, layout, dim)
            out.append({"value": y, "contiguous": bool(y.is_contiguous()) if isinstance(y, torch.Tensor) else None,
                        "input_intact": bool(torch.equal(x, tokens_tensor(tuple(x.shape), dim)))})
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001
            out.append({"raised": type(e).__name__, "message": str(e)[:300]})
    return out


def unshard_harness(module: str, cases: list[tuple]) -> list[Any]:
    from . import function
    unshard = function(module, "unshard_sequence")
    return [unshard(list(shards), layout, dim) for shards, layout, dim in cases]


class _Counter:
    """Counts the attention-kernel calls a rank makes (grader-side instrumentation in the rank).

    ``first``: where q is among the kernel's arguments (0 for the forward kernels, 1 for the
    backward ones, which take dout first); q, k are the two arguments from there."""

    def __init__(self, first: int = 0):
        self.calls: list[list[int]] = []
        self.depth = 0
        self.first = first

    def wrap(self, fn):
        def counted(*args, **kwargs):
            named = {**dict(zip(("dout", "q", "k")[1 - self.first:], args)), **kwargs}
            q, k = named.get("q"), named.get("k")
            if self.depth == 0 and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor):
                self.calls.append([int(q.shape[-2]), int(k.shape[-2]), int(bool(kwargs.get("causal", False)))])
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
        return counted


@contextlib.contextmanager
def _counting(mod, names: tuple[str, ...], counter: _Counter):
    """Within: the kernels ``names`` as the learner's module names them count their calls into
    ``counter``; put back afterwards.  (The given blockwise module is left alone: given code is not
    changed while learner code runs.  A ring that reaches the kernels another way is counted from
    its trace instead.)"""
    patched = []
    for owner in (mod,):
        for name in names:
            if hasattr(owner, name):
                patched.append((owner, name, getattr(owner, name)))
                setattr(owner, name, counter.wrap(getattr(owner, name)))
    try:
        yield counter
    finally:
        for owner, name, fn in reversed(patched):
            setattr(owner, name, fn)


def ring_harness(module: str, mine: tuple, causal: bool, layout: str, inputs: bool = True) -> dict[str, Any]:
    """On each rank: the learner's ring_attention_forward on this rank's shard ``mine = (q, k, v)``;
    also the kernel calls it made, and (``inputs``) its inputs as they are afterwards."""
    from . import _check
    mod = importlib.import_module(module)
    q, k, v = mine
    with _counting(mod, ("attention_block", "attention_block_explicit"), _Counter()) as counter:
        res = mod.ring_attention_forward(q, k, v, causal=causal, layout=layout)
    _check()                          # after the counters are off the given kernels again
    after = {"inputs": [q, k, v]} if inputs else {}
    if not isinstance(res, (tuple, list)) or len(res) != 2:
        return {"bad_return": type(res).__name__, **after}
    return {"out": res[0], "lse": res[1], "calls": counter.calls, **after}


def ring_backward_harness(module: str, mine: tuple, causal: bool, layout: str, inputs: bool = True) -> dict[str, Any]:
    """On each rank: the learner's ring_attention_backward on this rank's shard ``mine = (dout, q, k,
    v, out, lse)`` (out and lse: the grader's float64 truth, in the inputs' dtype); also the
    block-backward calls, and (``inputs``) the inputs as they are afterwards."""
    from . import _check
    mod = importlib.import_module(module)
    dout, q, k, v, out, lse = mine
    names = ("attention_block_backward", "attention_block_backward_explicit")
    with _counting(mod, names, _Counter(first=1)) as counter:
        res = mod.ring_attention_backward(dout, q, k, v, out, lse, causal=causal, layout=layout)
    _check()
    after = {"inputs": list(mine)} if inputs else {}
    if not isinstance(res, (tuple, list)) or len(res) != 3:
        return {"bad_return": type(res).__name__, **after}
    return {"dq": res[0], "dk": res[1], "dv": res[2], "calls": counter.calls, **after}


def ulysses_harness(module: str, mine: tuple) -> dict:
    """On each rank: seq_to_heads of this rank's sequence shard, heads_to_seq of its head shard
    (``mine``), and the round trip; with the inputs as they are afterwards."""
    from . import function
    seq_shard, head_shard = mine
    a = function(module, "seq_to_heads")(seq_shard)
    b = function(module, "heads_to_seq")(head_shard)
    back = function(module, "heads_to_seq")(a) if isinstance(a, torch.Tensor) else None
    return {"seq_to_heads": a, "heads_to_seq": b, "round_trip": back, "inputs": [seq_shard, head_shard]}


def ulysses_error_harness(module: str, mine: torch.Tensor) -> dict:
    from . import function
    try:
        function(module, "seq_to_heads")(mine)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "message": str(e)[:300]}
    return {"raised": None}


def _shard_from_seed(seed: int, shape: tuple, count: int) -> list[torch.Tensor]:
    """``count`` float64 tensors of ``shape`` drawn from ``seed`` (a rank's own inputs, made in the
    rank itself: nothing of them travels)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(count)]


def ring_memory_harness(module: str, mine: tuple, causal: bool, shape: tuple) -> dict[str, Any]:
    """On each rank: q, k, v drawn from this rank's seed (``mine``: the seed, and a probe vector u),
    then the learner's ring_attention_forward (contiguous layout).  Returns out·u and lse: enough for
    the grader to check the values, little to send back (the runner caps this rank's memory)."""
    from . import function
    seed, u = mine
    return_freed_memory()
    q, k, v = _shard_from_seed(seed, shape, 3)
    res = function(module, "ring_attention_forward")(q, k, v, causal=causal, layout="contiguous")
    if not isinstance(res, (tuple, list)) or len(res) != 2 or not isinstance(res[0], torch.Tensor):
        return {"bad_return": type(res).__name__}
    return {"out_u": res[0].double() @ u, "lse": res[1]}


def ring_backward_memory_harness(module: str, mine: tuple, causal: bool, shape: tuple) -> dict[str, Any]:
    """On each rank: dout, q, k, v drawn from this rank's seed; out and lse (the forward's, from the
    grader) in ``mine`` with the seed and a probe vector u.  Returns dq·u, dk·u, dv·u."""
    from . import function
    seed, out, lse, u = mine
    return_freed_memory()
    dout, q, k, v = _shard_from_seed(seed, shape, 4)
    res = function(module, "ring_attention_backward")(dout, q, k, v, out, lse, causal=causal, layout="contiguous")
    if not isinstance(res, (tuple, list)) or len(res) != 3:
        return {"bad_return": type(res).__name__}
    return {f"{name}_u": g.double() @ u if isinstance(g, torch.Tensor) else g
            for name, g in zip(("dq", "dk", "dv"), res)}
