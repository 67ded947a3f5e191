"""Small models the data-parallel lecture, its tests and its benchmark train.

Both have what makes data parallelism easy to get wrong: a tied weight (one tensor used twice, one
gradient) and a frozen parameter (no gradient at all).

    TinyMLP      x → inp → tanh → hidden → tanh → out(= inp's weight, tied) + frozen scale
    TinyBlock    a pre-norm transformer block (single-head causal attention + MLP) with a tied
                 input/output projection and a frozen positional table
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyMLP", "TinyBlock", "make_model", "layer_model"]


class TinyMLP(nn.Module):
    def __init__(self, d: int = 6, hidden: int = 10, depth: int = 2):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.hidden = nn.Sequential(*[nn.Sequential(nn.Linear(d if i == 0 else hidden, hidden), nn.Tanh())
                                      for i in range(depth)])
        self.proj = nn.Linear(hidden, d)
        self.out = nn.Linear(d, d, bias=False)
        self.out.weight = self.inp.weight                      # tied
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d), requires_grad=False)   # frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(self.proj(self.hidden(h)) * self.scale)


class TinyBlock(nn.Module):
    """(B, T, d) → (B, T, d)."""

    def __init__(self, d: int = 8, ff: int = 16, max_len: int = 8):
        super().__init__()
        self.embed = nn.Linear(d, d, bias=False)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.1, requires_grad=False)     # frozen
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)   # a key bias has gradient 0 (softmax shift)
        self.attn_out = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))
        self.unembed = nn.Linear(d, d, bias=False)
        self.unembed.weight = self.embed.weight                # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        h = self.embed(x) + self.pos[:T]
        q, k, v = self.qkv(self.norm1(h)).split(d, dim=-1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        a = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
        h = h + self.attn_out(a)
        h = h + self.mlp(self.norm2(h))
        return self.unembed(h)


def make_model(kind: str, seed: int = 0, dtype=torch.float64, **kw) -> nn.Module:
    """The same model on every rank: ``kind`` "mlp" or "block", weights from ``seed``."""
    torch.manual_seed(seed)
    model = {"mlp": TinyMLP, "block": TinyBlock}[kind](**kw)
    return model.to(dtype)


def layer_model(layers: int, width: int, dtype=torch.float32, seed: int = 0) -> nn.Sequential:
    """``layers`` × (Linear(width, width), tanh): every layer one FSDP unit, one bucket-sized piece."""
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods).to(dtype)
