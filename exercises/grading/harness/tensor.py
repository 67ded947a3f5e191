"""Lecture 4a's harness: rank functions that call the learner's 4.1–4.3 on this rank's slices (cut
by the grader and sent to this rank alone: ``mine``) and backpropagate; they return plain values."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import function as _fn


def fg_per_rank(module: str, mine: tuple, which: str):
    """f: ``mine = (x, grad)`` with x the replicated input and grad this rank's output gradient.
    g: x is this rank's partial sum and grad the (replicated) gradient of the sum."""
    x, grad = mine
    x = x.clone().requires_grad_(True)
    name = "copy_to_tensor_region" if which == "f" else "reduce_from_tensor_region"
    y = _fn(module, name)(x)
    out = {"out": y.detach().clone() if isinstance(y, torch.Tensor) else y, "grad": None,
           "has_graph": bool(getattr(y, "requires_grad", False))}
    if out["has_graph"]:
        y.backward(grad)
        out["grad"] = x.grad
    return out


def shard_per_rank(module: str, mine: None, weight, bias, style):
    w, b = _fn(module, "linear_shard")(weight, bias, style)
    return {"weight": w, "bias": b}


def mlp_per_rank(module: str, mine: tuple):
    """The learner's column → GELU → row on this rank's slices ``mine = (w1, b1, w2, b2, x, dout)``:
    rows r·n … (r+1)·n − 1 of fc1, the same columns of fc2, fc2's whole bias, the replicated x."""
    w1, b1, w2, b2, x, dout = (t.clone().requires_grad_(True) if i < 5 else t for i, t in enumerate(mine))
    h = _fn(module, "column_parallel_linear")(x, w1, b1)
    if not isinstance(h, torch.Tensor):
        return {"out": h}
    y = _fn(module, "row_parallel_linear")(F.gelu(h), w2, b2)
    res = {"out": y.detach() if isinstance(y, torch.Tensor) else y,
           "has_graph": bool(getattr(y, "requires_grad", False))}
    if res["has_graph"]:
        y.backward(dout)
        res.update(dx=x.grad, w1=w1.grad, b1=b1.grad, w2=w2.grad, b2=b2.grad)
    return res


def xent_per_rank(module: str, mine: tuple):
    """``mine = (logits_shard, target, dloss)``: this rank's columns of the logits only."""
    z, target, dloss = mine
    z = z.clone().requires_grad_(True)
    loss = _fn(module, "vocab_parallel_cross_entropy")(z, target)
    res = {"loss": loss.detach() if isinstance(loss, torch.Tensor) else loss,
           "has_graph": bool(getattr(loss, "requires_grad", False)), "grad": None}
    if res["has_graph"]:
        loss.backward(dloss)
        res["grad"] = z.grad
    return res
