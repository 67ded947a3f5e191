"""Lecture 5a's harness: rank functions around the learner's 5a.2–5a.5 (the rings' kernel calls are
counted here, by grader code, as feedback)."""
from __future__ import annotations

import contextlib
import importlib
import math
from typing import Any

import torch


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
    """Runs in the runner: shard_sequence for each (x, rank, W, layout, dim); exceptions come back as
    ``{"raised": type name, "message": ...}`` (NotImplementedError propagates)."""
    mod = importlib.import_module(module)
    out = []
    for x, r, W, layout, dim in cases:
        try:
            y = mod.shard_sequence(x, r, W, layout, dim)
            out.append({"value": y, "contiguous": bool(y.is_contiguous()) if isinstance(y, torch.Tensor) else None,
                        "input_intact": bool(torch.equal(x, tokens_tensor(tuple(x.shape), dim)))})
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001
            out.append({"raised": type(e).__name__, "message": str(e)[:300]})
    return out


def unshard_harness(module: str, cases: list[tuple]) -> list[Any]:
    mod = importlib.import_module(module)
    return [mod.unshard_sequence(list(shards), layout, dim) for shards, layout, dim in cases]


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
    """Within: the kernels ``names`` of the learner's module and of the given blockwise module count
    their calls into ``counter``; put back afterwards."""
    from reference.sequence import blockwise
    patched = []
    for owner in {id(mod): mod, id(blockwise): blockwise}.values():
        for name in names:
            if hasattr(owner, name):
                patched.append((owner, name, getattr(owner, name)))
                setattr(owner, name, counter.wrap(getattr(owner, name)))
    try:
        yield counter
    finally:
        for owner, name, fn in reversed(patched):
            setattr(owner, name, fn)


def ring_harness(module: str, shards: list[tuple], causal: bool, layout: str) -> dict[str, Any]:
    """On each rank: the learner's ring_attention_forward on its shard; also the kernel calls it made."""
    import torch.distributed as dist

    r = dist.get_rank()
    mod = importlib.import_module(module)
    q, k, v = shards[r]
    with _counting(mod, ("attention_block", "attention_block_explicit"), _Counter()) as counter:
        res = mod.ring_attention_forward(q, k, v, causal=causal, layout=layout)
    if not isinstance(res, (tuple, list)) or len(res) != 2:
        return {"bad_return": type(res).__name__}
    return {"out": res[0], "lse": res[1], "calls": counter.calls}


def ring_backward_harness(module: str, shards: list[tuple], causal: bool, layout: str) -> dict[str, Any]:
    """On each rank: the learner's ring_attention_backward on its shard ``(dout, q, k, v, out, lse)``
    (out and lse: the grader's float64 truth, in the inputs' dtype); also the block-backward calls."""
    import torch.distributed as dist

    r = dist.get_rank()
    mod = importlib.import_module(module)
    dout, q, k, v, out, lse = shards[r]
    names = ("attention_block_backward", "attention_block_backward_explicit")
    with _counting(mod, names, _Counter(first=1)) as counter:
        res = mod.ring_attention_backward(dout, q, k, v, out, lse, causal=causal, layout=layout)
    if not isinstance(res, (tuple, list)) or len(res) != 3:
        return {"bad_return": type(res).__name__}
    return {"dq": res[0], "dk": res[1], "dv": res[2], "calls": counter.calls}


def ulysses_harness(module: str, seq_shards: list[torch.Tensor], head_shards: list[torch.Tensor]) -> dict:
    import torch.distributed as dist
    mod = importlib.import_module(module)
    r = dist.get_rank()
    a = mod.seq_to_heads(seq_shards[r])
    b = mod.heads_to_seq(head_shards[r])
    back = mod.heads_to_seq(a) if isinstance(a, torch.Tensor) else None
    return {"seq_to_heads": a, "heads_to_seq": b, "round_trip": back}


def ulysses_error_harness(module: str, shards: list[torch.Tensor]) -> dict:
    import torch.distributed as dist
    mod = importlib.import_module(module)
    try:
        mod.seq_to_heads(shards[dist.get_rank()])
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "message": str(e)[:300]}
    return {"raised": None}
