"""Lecture 6, part 2 — hooks that record a run, on one process or on every rank of a grid.

:class:`Recorder` puts a forward hook and a full backward hook on each module it is given and keeps,
per call, the module's input and output, then ∂L/∂output and ∂L/∂input, each placed in the
one-process tensor (:mod:`.records`) by a :class:`Layout`: where this rank's tokens sit in the batch
(data parallel rows, a pipeline micro-batch's rows, zigzag chunks of the sequence) and which features
it holds, read off the module's ``CUTS`` (lecture 4a's parallel linears say how they are cut)::

    module (CUTS["weight"])           its input            its output
    ────────────────────────────────  ───────────────────  ──────────────────────────────────────
    column-parallel ("column")        replicated           my columns r·f … (r+1)·f
    qkv ("qkv")                       replicated           my heads' columns of each of q, k, v
    the head ("vocab")                replicated           my vocabulary columns, padding cut off
    an embedding (any CUTS)           token ids            replicated (the vocabulary-parallel one all-reduces)
    row-parallel ("row")              my columns           replicated (after g's all-reduce)
    anything else (LayerNorm, block)  replicated           replicated

Parameters and their gradients are placed by the checkpoint's own shard table
(:func:`param_pieces`: :mod:`reference.compose.checkpoint` cuts each ``Shard.kind`` into boxes of
the global tensor), so a run is compared with one process exactly as a checkpoint is resumed on it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..compose.checkpoint import _pieces
from .records import Record

__all__ = ["Layout", "Recorder", "cuts_of", "param_pieces", "RecordingOptimizer"]


@dataclass
class Layout:
    """Where this rank's activations lie in the whole (B, S, features) tensor.

    batch, seq_len: the whole batch; rows: this rank's rows per call (a micro-batch's), first_row: the
    first of its rows (dp rank · B/dp); positions: the global positions of its tokens in local order
    (zigzag with context parallelism); tp, tp_rank: the tensor-parallel group; seq_first: the model
    holds activations (S, B, f) (Megatron's order) instead of (B, S, f); vocab: the real vocabulary
    (a padded head's extra columns are left out)."""
    batch: int
    seq_len: int
    rows: int
    first_row: int = 0
    positions: tuple[int, ...] = ()
    tp: int = 1
    tp_rank: int = 0
    seq_first: bool = False
    vocab: int | None = None

    def seq_runs(self) -> list[tuple[int, int, int]]:
        """(local start, global start, length) of each run of consecutive positions."""
        pos = list(self.positions) or list(range(self.seq_len))
        runs, start = [], 0
        for i in range(1, len(pos) + 1):
            if i == len(pos) or pos[i] != pos[i - 1] + 1:
                runs.append((start, pos[start], i - start))
                start = i
        return runs

    def feature_runs(self, cut: str, local: int) -> tuple[int, list[tuple[int, int, int]]]:
        """(whole width, [(local start, global start, width)]) of a last dimension cut ``cut``."""
        r, W = self.tp_rank, self.tp
        if cut == "replicated" or W == 1 and cut != "vocab":
            return local, [(0, 0, local)]
        if cut == "column":
            return local * W, [(0, r * local, local)]
        if cut == "qkv":                            # [q_r; k_r; v_r], each a third of the local columns
            third = local // 3
            return local * W, [(j * third, j * third * W + r * third, third) for j in range(3)]
        if cut == "vocab":
            whole = self.vocab if self.vocab is not None else local * W
            width = max(0, min(local, whole - r * local))
            return whole, [(0, r * local, width)] if width else []
        raise ValueError(f"unknown cut {cut!r}")

    def place(self, t: torch.Tensor, cut: str, microbatch: int = 0) -> tuple[tuple[int, ...], list]:
        """The whole shape and this rank's pieces ``(offsets, block)`` of activation ``t``."""
        t = t.detach()
        n_seq = len(self.positions) or self.seq_len
        if t.dim() == 2:                            # tokens flattened: (S·b, f) or (b·S, f)
            t = t.reshape(n_seq, -1, t.shape[-1]) if self.seq_first else t.reshape(-1, n_seq, t.shape[-1])
        if self.seq_first:
            t = t.transpose(0, 1)                   # → (b, S_local, f)
        width, features = self.feature_runs(cut, t.shape[-1])
        row = self.first_row + microbatch * t.shape[0]
        pieces = [((row, g_s, g_f), t[:, l_s:l_s + n, l_f:l_f + w].clone())
                  for l_s, g_s, n in self.seq_runs() for l_f, g_f, w in features]
        return (self.batch, self.seq_len, width), pieces


def cuts_of(module: nn.Module) -> tuple[str, str]:
    """(input cut, output cut) of a module's activations, read off its ``CUTS`` (module docstring)."""
    kind = (getattr(module, "CUTS", None) or {}).get("weight")
    if "Embedding" in type(module).__name__:       # a vocabulary-parallel embedding all-reduces its output
        return "replicated", "replicated"
    if kind in ("column", "qkv", "vocab"):
        return "replicated", kind
    if kind == "row":
        return "column", "replicated"
    return "replicated", "replicated"


def param_pieces(kind: str, tp_rank: int, local: torch.Tensor, whole: tuple[int, ...]) -> list:
    """This rank's boxes ``(offsets, block)`` of a parameter (or its gradient) cut ``kind`` — the boxes
    the checkpoint writes (:mod:`reference.compose.checkpoint`, "replicated", "column", "row", "qkv", "vocab")."""
    flat = local.detach().reshape(-1)
    return [(tuple(o), v.clone()) for o, v in _pieces(kind, tp_rank, tuple(local.shape), tuple(whole), flat)]


class Recorder:
    """Forward and full backward hooks on ``modules`` ({name: module}); records go to ``self.records``.

    ``layout``: where this rank's tensors lie (:class:`Layout`); ``rank``: the rank that holds them;
    ``grad_scale``: multiplies recorded gradients (1/(dp·cp) turns a rank's ∂L_r into ∂L of the whole
    batch).  Call :meth:`start_step` before each step: the k-th call of a module in a step is micro-batch k.
    """

    def __init__(self, modules: dict[str, nn.Module], layout: Layout, *, rank: int = 0, grad_scale: float = 1.0):
        self.layout, self.rank, self.grad_scale = layout, rank, grad_scale
        self.records: list[Record] = []
        self.step = 0
        self._calls: dict[tuple[str, str], int] = {}
        self._hooks = []
        for name, module in modules.items():
            cut_in, cut_out = cuts_of(module)
            self._hooks.append(module.register_forward_hook(self._forward(name, cut_in, cut_out)))
            if "Embedding" not in type(module).__name__:       # its input is token ids: no gradient to record
                self._hooks.append(module.register_full_backward_hook(self._backward(name, cut_in, cut_out)))

    def start_step(self, step: int) -> None:
        self.step = step
        self._calls.clear()

    def _call(self, name: str, phase: str) -> int:
        k = self._calls.get((name, phase), 0)
        self._calls[(name, phase)] = k + 1
        return k

    def _add(self, phase: str, module: str, tensor: str, t, cut: str, microbatch: int, scale: float = 1.0) -> None:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return
        shape, pieces = self.layout.place(t * scale if scale != 1.0 else t, cut, microbatch)
        self.records.append(Record(self.step, phase, module, tensor, shape,
                                   [(self.rank, offsets, block) for offsets, block in pieces]))

    def _forward(self, name: str, cut_in: str, cut_out: str):
        def hook(module, args, output):
            k = self._call(name, "forward")
            self._add("forward", name, "input", args[0] if args else None, cut_in, k)
            self._add("forward", name, "output", output, cut_out, k)
        return hook

    def _backward(self, name: str, cut_in: str, cut_out: str):
        def hook(module, grad_input, grad_output):
            k = self._call(name, "backward")
            self._add("backward", name, "grad_output", grad_output[0], cut_out, k, self.grad_scale)
            self._add("backward", name, "grad_input", grad_input[0] if grad_input else None, cut_in, k,
                      self.grad_scale)
        return hook

    def record_params(self, phase: str, params: dict[str, tuple[torch.Tensor, str]], whole: dict[str, tuple]) -> None:
        """One record per parameter name: ``params`` {name: (this rank's tensor, shard kind)}, ``whole``
        {name: the one-process shape}; phase "grad" records ``tensor.grad`` as "<attr>.grad"."""
        for name, (t, kind) in params.items():
            value = t.grad if phase == "grad" else t
            if value is None:
                continue
            module, _, attr = name.rpartition(".")
            pieces = param_pieces(kind, self.layout.tp_rank, value, whole[name])
            self.records.append(Record(self.step, phase, module, attr + (".grad" if phase == "grad" else ""),
                                       tuple(whole[name]), [(self.rank, o, b) for o, b in pieces]))

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class RecordingOptimizer:
    """An optimizer whose ``step`` calls ``before()`` and ``after()`` around the real one (the "grad"
    and "param" records); every other attribute is the wrapped optimizer's."""

    def __init__(self, optimizer, before, after):
        self._optimizer, self._before, self._after = optimizer, before, after

    def step(self, *args, **kwargs):
        self._before()
        out = self._optimizer.step(*args, **kwargs)
        self._after()
        return out

    def __getattr__(self, name):
        return getattr(self._optimizer, name)
