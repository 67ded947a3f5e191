"""Rank functions only the expert-parallel tests use (tests/moe/test_parallel.py)."""
from __future__ import annotations

import torch

from reference import comm
from reference.moe.layer import MoELayer
from reference.moe.parallel import ExpertParallelMoE, all_to_all


def all_to_all_adjoint(rows_per_dest: list[list[int]], d: int, seed: int = 0) -> dict:
    """<A x, g> on this rank and <x, Aᵀ g>, where A is :func:`all_to_all` with the given splits
    (``rows_per_dest[s][t]`` rows go from rank s to rank t) and Aᵀ is what autograd computes."""
    W, r = comm.world_size(), comm.rank()
    send = rows_per_dest[r]
    recv = [rows_per_dest[s][r] for s in range(W)]
    gen = torch.Generator().manual_seed(seed + r)
    x = torch.randn(sum(send), d, dtype=torch.float64, generator=gen).requires_grad_()
    g = torch.randn(sum(recv), d, dtype=torch.float64, generator=gen)
    Ax = all_to_all(x, send, recv, what="adjoint_test")
    (Ax * g).sum().backward()
    return {"Ax_dot_g": float((Ax.detach() * g).sum()), "x_dot_ATg": float((x.detach() * x.grad).sum()),
            "Ax": Ax.detach(), "x": x.detach(), "grad_shape": tuple(x.grad.shape)}


def ep_bad_input(kinds: list[str]) -> list[str]:
    """Feed the expert-parallel layer something wrong on ONE rank (or an uneven expert split).
    Returns, per kind, the name of the exception THIS rank raised ("" if none): every rank must
    raise ValueError, none may hang."""
    W, r = comm.world_size(), comm.rank()
    raised = []
    for kind in kinds:
        torch.manual_seed(0)
        T = 8
        x = torch.randn(T, 4, dtype=torch.float64)
        if kind == "wrong_width" and r == W - 1:
            x = torch.randn(T, 5, dtype=torch.float64)
        elif kind == "unequal_tokens" and r == W - 1:
            x = torch.randn(T + 1, 4, dtype=torch.float64)
        try:
            layer = MoELayer(4, 8, 3 if kind == "uneven_experts" else 4, k=1).double()
            ExpertParallelMoE.from_layer(layer)(x)
            raised.append("")
        except Exception as e:  # noqa: BLE001 - the caller checks the type
            raised.append(type(e).__name__)
    return raised
