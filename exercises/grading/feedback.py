"""Comparing a learner's tensors with the ground truth, and naming the likely mistake.

:func:`compare` returns ``None`` when two tensors agree, else a message that says which tensor,
which rank, the largest error and where, and — through *detectors* — what the mistake probably
is.  A detector is a small function ``(Mismatch) -> str | None``; the generic ones below run on
every comparison, and each lecture adds its own in a few lines next to its checks::

    def merge_without_max(m):
        if m.has_nonfinite and "large" in m.case:
            return "NaN/inf with large logits: the merge needs the running max (subtract it before exp)."

    ctx.compare(got, want, "out", detectors=[merge_without_max], case="large logits")
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Mismatch:
    """Everything a detector may look at."""

    what: str                   # "output", "dq", "gradient of w1", ...
    got: Any                    # the learner's value (tensor, or something else that came back)
    expected: torch.Tensor
    rank: int | None = None
    world_size: int | None = None
    case: str = ""              # words describing the inputs: "large logits", "causal zigzag", ...
    extra: dict[str, Any] = field(default_factory=dict)   # anything a check wants to hand detectors

    @property
    def has_nonfinite(self) -> bool:
        return isinstance(self.got, torch.Tensor) and bool((~torch.isfinite(self.got)).any())


Detector = Callable[[Mismatch], "str | None"]


def _ratio(got: torch.Tensor, expected: torch.Tensor) -> float | None:
    """If got == c · expected for one constant c (not 1), return c."""
    g, e = got.double().flatten(), expected.double().flatten()
    mask = e.abs() > 1e-6 * max(1.0, float(e.abs().max()))
    if mask.sum() < 2:
        return None
    r = g[mask] / e[mask]
    c = float(r.median())
    if abs(c - 1) < 1e-6 or not torch.isfinite(torch.tensor(c)):
        return None
    if torch.allclose(g, c * e, rtol=1e-5, atol=1e-8 * max(1.0, float(e.abs().max()))):
        return c
    return None


def detect_nonfinite(m: Mismatch) -> str | None:
    if m.has_nonfinite and bool(torch.isfinite(m.expected).all()):
        return ("your result has NaN or inf where the true result is finite: an exp() of a large "
                "number overflowed, or something was divided by zero.")
    return None


def detect_scaled(m: Mismatch) -> str | None:
    if not isinstance(m.got, torch.Tensor) or m.got.shape != m.expected.shape:
        return None
    c = _ratio(m.got, m.expected)
    if c is None:
        return None
    words = f"your {m.what} is exactly {c:.4g}× the true one"
    w = m.world_size
    if w and w > 1 and abs(c - w) < 1e-6:
        return words + f" (= the world size {w}): a sum where a mean belongs, or a missing division by {w}?"
    if w and w > 1 and abs(c - 1 / w) < 1e-6:
        return words + f" (= 1/{w}): divided by the world size once too often?"
    return words + ": a scale factor is off."


def detect_zero(m: Mismatch) -> str | None:
    if isinstance(m.got, torch.Tensor) and m.got.numel() and bool((m.got == 0).all()) and bool((m.expected != 0).any()):
        return f"your {m.what} is all zeros: was the result written into a buffer that is then returned unchanged?"
    return None


def detect_unchanged_input(m: Mismatch) -> str | None:
    inp = m.extra.get("input")
    if isinstance(inp, torch.Tensor) and isinstance(m.got, torch.Tensor) and inp.shape == m.got.shape \
            and torch.equal(inp.to(m.got.dtype), m.got):
        return f"your {m.what} equals this rank's input: nothing was received or added."
    return None


GENERIC: list[Detector] = [detect_nonfinite, detect_zero, detect_unchanged_input, detect_scaled]


def _fmt_index(flat: int, shape: torch.Size) -> str:
    idx = []
    for s in reversed(shape):
        idx.append(flat % s)
        flat //= s
    return "(" + ", ".join(str(i) for i in reversed(idx)) + ")"


_KIND_NAMES = {"c": "a complex tensor", "f": "a floating-point tensor", "i": "an integer (or bool) tensor"}


def _kind(t: torch.Tensor) -> str:
    return "c" if t.is_complex() else "f" if t.is_floating_point() else "i"


def compare(got: Any, expected: torch.Tensor, what: str, *, rank: int | None = None, world_size: int | None = None,
            atol: float = 1e-6, rtol: float = 1e-5, case: str = "", detectors: Sequence[Detector] = (),
            extra: dict[str, Any] | None = None) -> str | None:
    """``None`` if ``got`` matches ``expected`` (``|got - exp| <= atol + rtol·|exp|``), else feedback."""
    where = f" on rank {rank}" if rank is not None else ""
    where += f" (world size {world_size})" if world_size is not None else ""
    where += f" [{case}]" if case else ""
    if not isinstance(got, torch.Tensor):
        return f"{what}{where}: expected a tensor of shape {tuple(expected.shape)}, got {type(got).__name__}."
    if got.shape != expected.shape:
        msg = f"{what}{where}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}."
        return msg + _likely(Mismatch(what, got, expected, rank, world_size, case, dict(extra or {})), detectors, ())
    if _kind(got) != _kind(expected):
        return (f"{what}{where}: dtype {got.dtype}, expected {_KIND_NAMES[_kind(expected)]} like "
                f"{expected.dtype}.")
    g, e = got.detach().double(), expected.detach().double()
    both_nan = torch.isnan(g) & torch.isnan(e)
    err = (g - e).abs()
    err = torch.where(both_nan, torch.zeros_like(err), err)
    err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
    bad = err > atol + rtol * e.abs()
    # where the expected value is ±inf or NaN only that very value passes (a tolerance of inf would pass anything)
    special = ~torch.isfinite(e)
    bad = torch.where(special, ~((g == e) | both_nan), bad)
    if not bool(bad.any()):
        return None
    flat = int(torch.argmax(torch.where(bad, err, torch.zeros_like(err))))
    i = _fmt_index(flat, g.shape)
    msg = (f"{what}{where} differs: max error {float(err.flatten()[flat]):.3g} at index {i} "
           f"(got {float(g.flatten()[flat]):.6g}, expected {float(e.flatten()[flat]):.6g}); "
           f"{int(bad.sum())} of {bad.numel()} elements outside tolerance (atol={atol:g}, rtol={rtol:g}).")
    return msg + _likely(Mismatch(what, got, expected, rank, world_size, case, dict(extra or {})), detectors, GENERIC)


def _likely(m: Mismatch, detectors: Sequence[Detector], generic: Sequence[Detector]) -> str:
    """The "Likely mistake" lines: the check's own detectors first; the generic ones (NaN, zeros,
    a constant factor) only when none of those named the mistake — a precise diagnosis stands alone."""
    def run(ds):
        out = []
        for d in ds:
            try:
                h = d(m)
            except Exception:  # a detector must never break grading
                h = None
            if h and h not in out:
                out.append(h)
        return out
    hints = run(detectors) or run(generic)
    if not hints:
        return ""
    return "\n    Likely mistake: " + hints[0] + "".join("\n    Also: " + h for h in hints[1:2])
