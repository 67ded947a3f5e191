"""Lecture 5b, part 2 — the experts themselves, and two ways to run them: a loop, or one grouped GEMM.

An expert is a position-wise feed-forward block, d_model → d_ff → d_model:

    "gelu"    (GPT-2/Switch, the course's default)   FFN(x) = W_2 · gelu(W_1 · x + b_1) + b_2
    "swiglu"  (Mixtral, DeepSeek, Qwen3, Llama 4)     FFN(x) = W_2 · (silu(W_1 · x) ⊙ (W_3 · x))    no biases

Fine-grained experts (DeepSeekMoE arXiv:2401.06066) are the same blocks with a small d_ff (the
layer's ``expert_ffn``); shared experts are one such block every token goes through.

Running them.  The tokens arrive sorted by expert — expert e's rows ``offs[e-1] … offs[e] − 1``::

    x (N, d)   [ e0 e0 e0 | e1 | · | e3 e3 ]        counts [3, 1, 0, 2]     offs = cumsum = [3, 4, 4, 6]

* the loop: ``cat([FFN_e(x[rows of e]) for e])`` — E small matmuls, one kernel launch per expert
  per matmul (the common reference implementation; exact in float64);
* one grouped GEMM (MegaBlocks arXiv:2211.15841; torchtitan's and Megatron-Core's GroupedMLP):
  ``torch._grouped_mm(x, W_1ᵀ stacked (E, d, f), offs)`` multiplies every expert's rows by its own
  weight in ONE call, for any counts (an expert with 0 rows included) — no padding, no loop.
  On CPU in torch 2.13 it runs for float32 and bfloat16 (not float64), and needs 16-byte row
  strides: d and d_ff multiples of 4 (float32) or 8 (bfloat16).  There it is a loop of ``mm`` inside
  (one per expert, forward and backward), so it is no faster than the loop (the full course's
  benchmarks/moe_frontier.py); on GPUs it is one kernel per direction.  :func:`grouped_supported` says
  whether a case qualifies; ``impl="auto"`` takes the grouped GEMM where it does, the loop elsewhere.
  Here the weights live in each expert's own ``nn.Linear`` (so parameter names stay the
  single-process ones) and are stacked at each call: one copy of E·d·f numbers, small beside
  the k·T·d·f multiply-adds when the experts get many rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Expert", "SwiGLUExpert", "make_expert", "ACTIVATIONS", "IMPLS", "grouped_supported", "run_experts"]

ACTIVATIONS = ("gelu", "swiglu")
IMPLS = ("auto", "loop", "grouped")


class Expert(nn.Sequential):
    """One feed-forward expert: Linear(d_model, d_ff) → GELU → Linear(d_ff, d_model)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))


class SwiGLUExpert(nn.Module):
    """One SwiGLU expert (Shazeer arXiv:2002.05202): ``w2(silu(w1 x) ⊙ w3 x)``, no biases (torchtitan's names)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def make_expert(d_model: int, d_ff: int, activation: str = "gelu") -> nn.Module:
    """An expert of ``activation`` ("gelu" or "swiglu")."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return Expert(d_model, d_ff) if activation == "gelu" else SwiGLUExpert(d_model, d_ff)


def _weights(experts: list[nn.Module]) -> tuple[str, list[torch.Tensor]] | None:
    """The stacked weights of plain experts (all of one kind), or None (e.g. tensor-parallel ones)."""
    if all(type(e) is Expert for e in experts):
        fc1, fc2 = [e[0] for e in experts], [e[2] for e in experts]
        return "gelu", [torch.stack([m.weight for m in fc1]), torch.stack([m.bias for m in fc1]),
                        torch.stack([m.weight for m in fc2]), torch.stack([m.bias for m in fc2])]
    if all(type(e) is SwiGLUExpert for e in experts):
        return "swiglu", [torch.stack([getattr(e, w).weight for e in experts]) for w in ("w1", "w2", "w3")]
    return None


def grouped_supported(experts: list[nn.Module], x: torch.Tensor) -> str:
    """"" if ``torch._grouped_mm`` can run these experts on ``x``, else why not (one line)."""
    if not experts or _weights(experts) is None:
        return "the grouped GEMM runs plain Expert or SwiGLUExpert modules (not tensor-parallel ones)"
    if x.dtype not in (torch.float32, torch.bfloat16):
        return f"torch._grouped_mm on CPU takes float32 or bfloat16, not {x.dtype}"
    first = experts[0]
    d_ff = first[0].out_features if isinstance(first, Expert) else first.w1.out_features
    size = x.element_size()
    if (x.shape[1] * size) % 16 or (d_ff * size) % 16:
        return (f"torch._grouped_mm needs 16-byte row strides: d_model={x.shape[1]} and d_ff={d_ff} must be "
                f"multiples of {16 // size} in {x.dtype}")
    return ""


def _grouped(kind: str, w: list[torch.Tensor], x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    offs = torch.tensor(counts, dtype=torch.long, device=x.device).cumsum(0).to(torch.int32)
    mm = lambda a, weight: torch._grouped_mm(a, weight.to(a.dtype).transpose(1, 2), offs=offs)  # noqa: E731
    if kind == "gelu":
        w1, b1, w2, b2 = w
        n = torch.tensor(counts, device=x.device)
        per_row = lambda b: b.to(x.dtype).repeat_interleave(n, dim=0, output_size=x.shape[0])  # noqa: E731
        h = F.gelu(mm(x, w1) + per_row(b1))
        return mm(h, w2) + per_row(b2)
    w1, w2, w3 = w
    return mm(F.silu(mm(x, w1)) * mm(x, w3), w2)


def run_experts(experts: list[nn.Module], x: torch.Tensor, counts: list[int], impl: str = "auto") -> torch.Tensor:
    """Every expert on its rows of ``x`` (N, d) — sorted by expert, ``counts[e]`` rows each — in that order.

    impl: "loop" (one call per expert), "grouped" (one ``torch._grouped_mm`` per matmul; ValueError
    where it cannot run, :func:`grouped_supported`), "auto" (grouped where it can, else the loop).
    Every expert takes part even with 0 rows (its weights are in the graph), so a backward always
    reaches whatever came before.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if len(counts) != len(experts) or sum(counts) != x.shape[0]:
        raise ValueError(f"counts {list(counts)} must give one count per expert ({len(experts)}) summing to "
                         f"{x.shape[0]} rows")
    why = grouped_supported(experts, x) if impl != "loop" else "loop"
    if impl == "grouped" and why:
        raise ValueError(why)
    if why:
        return torch.cat([expert(part) for expert, part in zip(experts, x.split(list(counts)))])
    kind, w = _weights(experts)
    return _grouped(kind, w, x, list(counts))
