"""The lecture 5a notebook's runs (recorded for the student release, see ``reference.notebook.recorded``):
the merge, the ring widget's runs, attention pairs per rank, the ring backward's bytes, the
timeline, memory and bytes per rank, Ulysses' head limit and USP.  Their rank functions are in :mod:`.workers`.
"""
from __future__ import annotations

import torch

from ..notebook.recorded import live_world, recordable
from .workers import (bytes_worker, make_inputs, peak_memory_worker, ring_replay_worker, ring_timing_worker,
                      ulysses_call_worker, usp_worker)


def _world4(world):
    return live_world(4, {4: world} if world is not None else None)


def activation_bytes(seq_len: int, *, hidden: int = 4096, heads: int = 32, layers: int = 32, batch: int = 1,
                     fused: bool = True) -> int:
    """Activation memory of a Transformer's layers, Korthikanti et al. (arXiv:2205.05198) eq. 2:

        per layer  s·b·h·(34 + 5·a·s/h)  bytes, 16-bit activations, no recomputation, no parallelism
                   = 34·s·b·h  (everything linear in s)  +  5·a·s²·b  (attention scores, softmax, dropout)

    A fused/blockwise attention kernel (FlashAttention) never stores the a·s² terms: 34·s·b·h.
    The accounting lives in :func:`reference.planner.activation_bytes_per_layer` (lecture 5c's
    planner); this is its GPT-style case (multi-head attention, FFN 4h, dropout).
    """
    from ..planner import Model, activation_bytes_per_layer
    model = Model("GPT-style", layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden,
                  vocab=1, seq_len=seq_len, micro_batch=batch)
    return layers * round(activation_bytes_per_layer(model, flash=fused))


@recordable("05a.merge", needs=("5a.1",))
def merge_demo(seq_len: int = 256, block: int = 64, scale: float = 40.0) -> dict:
    """Blockwise attention against one call, and the naive vs stable merge with logits × ``scale``."""
    from .blockwise import attention_block, attention_block_explicit, blockwise_attention, merge_attention
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, seq_len, 32) for _ in range(3))
    full, _ = attention_block_explicit(q.double(), k.double(), v.double(), causal=True)
    out, _ = blockwise_attention(q, k, v, causal=True, block_size=block)
    q4, half = q * scale, seq_len // 2
    (oa, la), (ob, lb) = attention_block(q4, k[..., :half, :], v[..., :half, :]), \
        attention_block(q4, k[..., half:, :], v[..., half:, :])
    naive = (la.exp()[..., None] * oa + lb.exp()[..., None] * ob) / (la.exp() + lb.exp())[..., None]
    stable, _ = merge_attention(oa, la, ob, lb)
    truth, _ = attention_block_explicit(q4.double(), k.double(), v.double())
    return {"blockwise_error": float((out.double() - full).abs().max()), "max_lse": float(torch.maximum(la, lb).max()),
            "naive_nonfinite": int((~torch.isfinite(naive)).sum()), "numel": naive.numel(),
            "stable_error": float((stable.double() - truth).abs().max())}


@recordable("05a.ring_runs", needs=("5a.2", "5a.3"))
def ring_runs(seq_len: int = 24, sizes: tuple = (2, 3, 4), world=None) -> dict:
    """Ring forwards for the widget: {(layout, W, causal): {"trace", "max_error"}} on every layout."""
    runs = {}
    with _world4(world) as w:
        for W in sizes:
            for layout in ("contiguous", "zigzag", "striped"):
                for causal in (False, True):
                    res = w.run(ring_replay_worker, seq_len, W, layout, causal)
                    runs[(layout, W, causal)] = {"trace": res.trace,
                                                 "max_error": max(v["max_error"] for v in res.values[:W])}
    return runs


@recordable("05a.pairs", needs=("5a.2", "5a.3"))
def pairs_per_rank(seq_len: int = 64, world_size: int = 4, world=None) -> dict:
    """Causal pairs and blocks computed per rank, measured from the trace, for each layout."""
    out = {}
    with _world4(world) as w:
        for layout in ("contiguous", "zigzag", "striped"):
            res = w.run(ring_replay_worker, seq_len, world_size, layout, True)
            pairs = res.trace.filter(op="compute", what="attn_fwd").meta_sum("pairs")
            out[layout] = {"pairs": [pairs.get(r, 0) for r in range(world_size)],
                           "blocks": [len(res.trace.filter(op="compute", rank=r)) for r in range(world_size)]}
    return out


@recordable("05a.backward_bytes", needs=("5a.2", "5a.3", "5a.5"))
def ring_backward_bytes(seq_len: int = 64, world_size: int = 4, heads: int = 4, heads_kv: int = 2,
                        head_dim: int = 16, world=None) -> dict:
    """Bytes each rank sends in one ring forward and the backward after it (zigzag, causal, float32),
    measured from the trace: {"forward K/V", "backward K/V", "backward dK/dV": [bytes of rank r]}.
    A message without ``phase`` is the forward's if it was posted before the backward started; if a
    backward message does not say whether it carried K/V or dK/dV (a learner's need not), the two
    backward kinds are one: "backward K/V and dK/dV"."""
    with _world4(world) as w:
        res = w.run(ring_timing_worker, seq_len, world_size, backward=True, heads=heads, heads_kv=heads_kv,
                    head_dim=head_dim)
    return {name: [s.bytes_by_rank().get(r, 0) for r in range(world_size)]
            for name, s in message_kinds(res.trace).items()}


def message_kinds(trace) -> dict:
    """The sends of a ring forward + backward by kind (see :func:`ring_backward_bytes`): {kind: Trace}."""
    from ..trace import Trace
    began = {e.rank: e.start for e in trace.filter(op="backward_start")}
    sends = trace.filter(op="send")
    forward = [e.meta.get("phase", "fwd" if e.start < began[e.rank] else "bwd") == "fwd" for e in sends]
    fwd = Trace(e for e, f in zip(sends, forward) if f)
    bwd = Trace(e for e, f in zip(sends, forward) if not f)
    if any(e.meta.get("what") not in ("kv", "dkv") for e in bwd):
        return {"forward K/V": fwd, "backward K/V and dK/dV": bwd}
    return {"forward K/V": fwd, "backward K/V": bwd.filter(what="kv"), "backward dK/dV": bwd.filter(what="dkv")}


@recordable("05a.timeline", needs=("5a.2", "5a.3"))
def ring_timeline(seq_len: int = 4096, world_size: int = 2, heads: int = 4, head_dim: int = 64, world=None) -> dict:
    """One timed ring forward (after a warm-up): its trace, for the overlap timeline."""
    with _world4(world) as w:
        w.run(ring_timing_worker, 1024, world_size, heads=heads, head_dim=head_dim)
        res = w.run(ring_timing_worker, seq_len, world_size, heads=heads, head_dim=head_dim)
    return {"trace": res.trace, "seconds": max(v["seconds"] for v in res.values[:world_size])}


def memory_formula(seq_len: int, world_size: int, heads: int = 2, head_dim: int = 64, itemsize: int = 4) -> int:
    """Bytes a causal explicit-kernel attention forward adds per rank: 3·n²·H·b + 3·n·H·D·b, n = L/W.

    Three score-sized temporaries of one block (scores, probabilities, the mask's select) and the
    block's inputs; the score term falls as 1/W² (lecture 5a, section 7)."""
    n = seq_len // world_size
    return 3 * n * n * heads * itemsize + 3 * n * heads * head_dim * itemsize


@recordable("05a.memory", needs=("5a.2", "5a.3"))
def memory_per_rank(lengths: tuple = (1024, 2048), sizes: tuple = (1, 2, 4), heads: int = 2, head_dim: int = 64,
                    world=None) -> list[dict]:
    """Peak memory a causal explicit-kernel attention forward adds per rank, for each (L, W).

    Measured in ``world`` if it was started with ``keep_freed_memory=False`` (glibc's defaults), else in a
    world of 4 started here: ranks that keep freed memory never raise their resident high-water mark."""
    from ..launch import World
    rows = []
    own = world is None or getattr(world, "keep_freed_memory", True)
    with (World(4, timeout=60, echo=False, keep_freed_memory=False) if own else _world4(world)) as w:
        w.run(peak_memory_worker, 512, 2, heads=heads, head_dim=head_dim)            # warm-up
        for L in lengths:
            for W in sizes:
                vals = w.run(peak_memory_worker, L, W, heads=heads, head_dim=head_dim).values[:W]
                peaks = [v["peak_bytes"] for v in vals]
                rows.append({"L": L, "W": W, "peak": None if None in peaks else max(peaks)})
    return rows


@recordable("05a.bytes", needs=("5a.2", "5a.3", "5a.4"))
def bytes_ring_vs_ulysses(seq_len: int = 256, heads: int = 4, head_dim: int = 16, sizes: tuple = (2, 4),
                          world=None) -> list[dict]:
    """Bytes each rank sends in one ring forward and one Ulysses forward (off-rank), per W."""
    rows = []
    with _world4(world) as w:
        for W in sizes:
            res = w.run(bytes_worker, seq_len, W, heads=heads, head_dim=head_dim)
            ring = res.trace.filter(op="send").bytes_by_rank("send")
            uly = {r: 0 for r in range(W)}
            for e in res.trace.filter(op="all_to_all"):
                uly[e.rank] += sum(e.meta["send_bytes"]) - e.meta["send_bytes"][e.rank]
            rows.append({"W": W, "ring": [ring.get(r, 0) for r in range(W)], "ulysses": [uly[r] for r in range(W)]})
    return rows


@recordable("05a.ulysses_limit", needs=("5a.4",))
def ulysses_head_limit(heads: int = 6, world=None) -> dict:
    """Ulysses with more ranks (4) than divide the heads: what every rank raised."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 8, 4, generator=g) for _ in range(3))
    with _world4(world) as w:
        try:
            w.run(ulysses_call_worker, q, k, v)
        except Exception as e:  # noqa: BLE001 - every rank raises ValueError before any message
            failures = getattr(e, "failures", None)
            if not failures:
                raise
            return {r: (f.exc_type, f.message.split(": ", 1)[-1][:160]) for r, f in sorted(failures.items())}
    return {}


@recordable("05a.usp", needs=("5a.2", "5a.3", "5a.4", "5a.5"))
def usp_check(seq_len: int = 32, world=None) -> dict:
    """USP (Ulysses 2 × ring 2, zigzag, causal, float64) against full attention; messages by kind."""
    from .blockwise import attention_block_explicit
    from .usp import usp_unshard
    with _world4(world) as w:
        res = w.run(usp_worker, seq_len, 2, 2, layout="zigzag", causal=True, heads=4, head_dim=8,
                    dtype=torch.float64)
    q, k, v, _ = make_inputs(seq_len, heads=4, head_dim=8, dtype=torch.float64)
    truth, _ = attention_block_explicit(q, k, v, causal=True)
    out = usp_unshard([res.values[r]["out"] for r in range(4)], 2, 2, "zigzag")
    return {"error": float((out - truth).abs().max()),
            "messages": {op: len(res.trace.filter(op=op)) for op in ("send", "all_to_all")}}
