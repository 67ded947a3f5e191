"""Lecture 4a's harness: rank functions that call the learner's 4.1–4.3 on this rank's slices
(cut here, by grader code) and backpropagate; they return plain values."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import function as _fn


def fg_per_rank(module: str, which: str, xs, grads):
    """f: every rank's x is xs[0] (replicated), backprop grads[r].  g: x = xs[r], backprop grads[0]."""
    import torch.distributed as dist
    r = dist.get_rank()
    x = (xs[0] if which == "f" else xs[r]).clone().requires_grad_(True)
    name = "copy_to_tensor_region" if which == "f" else "reduce_from_tensor_region"
    y = _fn(module, name)(x)
    out = {"out": y.detach().clone() if isinstance(y, torch.Tensor) else y, "grad": None,
           "has_graph": bool(getattr(y, "requires_grad", False))}
    if out["has_graph"]:
        y.backward(grads[r] if which == "f" else grads[0])
        out["grad"] = x.grad
    return out


def shard_per_rank(module: str, weight, bias, style):
    w, b = _fn(module, "linear_shard")(weight, bias, style)
    return {"weight": w, "bias": b}


def mlp_per_rank(module: str, fc1, fc2, x, dout, bias_row: bool = True):
    """This rank's slices taken HERE (grader code), then the learner's column → GELU → row."""
    import torch.distributed as dist
    r, W = dist.get_rank(), dist.get_world_size()
    (w1, b1), (w2, b2) = fc1, fc2
    n = w1.shape[0] // W
    w1 = w1[r * n:(r + 1) * n].clone().requires_grad_(True)
    b1 = b1[r * n:(r + 1) * n].clone().requires_grad_(True)
    w2 = w2[:, r * n:(r + 1) * n].clone().requires_grad_(True)
    b2 = b2.clone().requires_grad_(True)
    x = x.clone().requires_grad_(True)
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


def xent_per_rank(module: str, logits, target, dloss):
    import torch.distributed as dist
    r, W = dist.get_rank(), dist.get_world_size()
    n = logits.shape[1] // W
    z = logits[:, r * n:(r + 1) * n].clone().requires_grad_(True)
    loss = _fn(module, "vocab_parallel_cross_entropy")(z, target)
    res = {"loss": loss.detach() if isinstance(loss, torch.Tensor) else loss,
           "has_graph": bool(getattr(loss, "requires_grad", False)), "grad": None}
    if res["has_graph"]:
        loss.backward(dloss)
        res["grad"] = z.grad
    return res
