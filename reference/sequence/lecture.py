"""The lecture 5a notebook's runs (recorded for the student release, see ``reference.notebook.recorded``):
the merge, the ring widget's runs, attention pairs per rank, the ring backward's bytes, the
timeline, memory and bytes per rank, Ulysses' head limit and USP.  Their rank functions are in :mod:`.workers`.
"""
from __future__ import annotations

import torch

from ..notebook.recorded import live_world, recordable
from .workers import (bytes_worker, make_inputs, peak_memory_worker, ring_replay_worker, ring_timing_worker,
                      ulysses_limit_worker, usp_worker)


def _world4(world):
    return live_world(4, {4: world} if world is not None else None)


def activation_bytes(seq_len: int, *, hidden: int = 4096, heads: int = 32, layers: int = 32, batch: int = 1,
                     fused: bool = True, recompute: str = "none") -> int:
    """Activation memory of a Transformer's layers, Korthikanti et al. (arXiv:2205.05198) eq. 2:

        per layer  s·b·h·(34 + 5·a·s/h)  bytes, 16-bit activations, no recomputation, no parallelism
                   = 34·s·b·h  (everything linear in s)  +  5·a·s²·b  (attention scores, softmax, dropout)

    A fused/blockwise attention kernel (FlashAttention) never stores the a·s² terms: 34·s·b·h.
    ``recompute="full"`` keeps only each layer's input, 2·s·b·h bytes, and rebuilds one layer's
    activations at a time in the backward: layers · 2·s·b·h + one layer's (fused or not).
    The accounting lives in :func:`reference.planner.activation_bytes_per_layer` (lecture 5c's
    planner); this is its GPT-style case (multi-head attention, FFN 4h, dropout).
    """
    from ..planner import Model, activation_bytes_per_layer
    model = Model("GPT-style", layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden,
                  vocab=1, seq_len=seq_len, micro_batch=batch)
    one_layer = activation_bytes_per_layer(model, flash=fused)
    if recompute == "none":
        return layers * round(one_layer)
    if recompute == "full":
        return layers * round(activation_bytes_per_layer(model, recompute="full")) + round(one_layer)
    raise ValueError(f"recompute must be 'none' or 'full', got {recompute!r}")


def attention_flop_share(seq_len: int, *, hidden: int = 4096, causal: bool = True) -> float:
    """Attention's matmuls (QKᵀ and PV: 4·s·h FLOPs per token forward, half of it causal) over the
    layer's weight matmuls (24·h² per token: QKV, projection and a 4h MLP) — s/(6h), or s/(12h) causal."""
    return 4 * seq_len * hidden / (2 if causal else 1) / (24 * hidden * hidden)


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


@recordable("05a.backward_bytes", needs=("5a.2", "5a.3", "5a.5"), variants=[{"dtype": "bfloat16"}])
def ring_backward_bytes(seq_len: int = 64, world_size: int = 4, heads: int = 4, heads_kv: int = 2,
                        head_dim: int = 16, dtype: str = "float32", world=None) -> dict:
    """Bytes each rank sends in one ring forward and the backward after it (zigzag, causal, Q/K/V in
    ``dtype``: "float32" or "bfloat16"), measured from the trace: {"forward K/V", "backward K/V",
    "backward dK/dV": [bytes of rank r]}.  The dK/dV accumulators are float32 either way.
    A message without ``phase`` is the forward's if it was posted before the backward started; if a
    backward message does not say whether it carried K/V or dK/dV (a learner's need not), the two
    backward kinds are one: "backward K/V and dK/dV"."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    with _world4(world) as w:
        res = w.run(ring_timing_worker, seq_len, world_size, backward=True, heads=heads, heads_kv=heads_kv,
                    head_dim=head_dim, dtype=getattr(torch, dtype))
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
    """One timed ring forward (after a warm-up): its trace, for the overlap timeline, and per rank what the
    step cost: {"trace", "seconds": the forward's wall time (first start to last end), "pairs": causal pairs
    per rank, "alone": seconds of each rank's same blocks run with no message, "comm_cpu": CPU seconds gloo's
    threads used in each rank during the forward (None where /proc does not tell)}."""
    with _world4(world) as w:
        w.run(ring_timing_worker, 1024, world_size, heads=heads, head_dim=head_dim)
        res = w.run(ring_timing_worker, seq_len, world_size, heads=heads, head_dim=head_dim, alone=True)
    events = [e for e in res.trace if e.op in ("compute", "send", "recv")]
    pairs = res.trace.filter(op="compute", what="attn_fwd").meta_sum("pairs")
    vals = res.values[:world_size]
    return {"trace": res.trace, "seconds": max(e.end for e in events) - min(e.start for e in events),
            "pairs": [pairs.get(r, 0) for r in range(world_size)], "alone": [v["alone"] for v in vals],
            "comm_cpu": [v["comm_cpu"] for v in vals]}


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
    """Ulysses with more ranks (4) than divide the heads: {rank: (exception type, message)} of what every rank
    raised, and "all_to_alls": how many all-to-alls were posted before (none: the check comes first)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 8, 4, generator=g) for _ in range(3))
    with _world4(world) as w:
        res = w.run(ulysses_limit_worker, q, k, v)
    out: dict = {r: (val["raised"], val["message"][:160]) for r, val in enumerate(res.values) if val}
    out["all_to_alls"] = len(res.trace.filter(op="all_to_all"))
    return out


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


# ----------------------------------------------------------------------------------------------
# Packed documents and positions under zigzag (pure arithmetic: no ranks)


def document_pairs(doc_lengths, world_size: int, layout: str) -> list[int]:
    """(query, key) pairs each rank computes under a document mask: documents packed one after another
    into one sequence, a token attending to itself and the earlier tokens of its own document.

    ``layout``: "contiguous" or "zigzag" (of the whole packed sequence, as in section 4), or
    "per-document zigzag": every document cut into 2W chunks, rank r holding chunks r and 2W−1−r of
    each (every document's length a multiple of 2W).  Token i with p earlier tokens in its document
    costs p + 1 pairs; a rank's pairs are the sum over the tokens it holds."""
    from .layouts import positions
    doc_lengths = [int(d) for d in doc_lengths]
    if not doc_lengths or any(d < 1 for d in doc_lengths):
        raise ValueError(f"document lengths must be positive, got {doc_lengths}")
    cost = torch.cat([torch.arange(1, d + 1) for d in doc_lengths])        # p + 1 for every token
    if layout == "per-document zigzag":
        starts = [sum(doc_lengths[:i]) for i in range(len(doc_lengths))]
        held = [torch.cat([s + positions(d, r, world_size, "zigzag") for s, d in zip(starts, doc_lengths)])
                for r in range(world_size)]
    elif layout in ("contiguous", "zigzag"):
        held = [positions(len(cost), r, world_size, layout) for r in range(world_size)]
    else:
        raise ValueError(f"layout must be 'contiguous', 'zigzag' or 'per-document zigzag', got {layout!r}")
    return [int(cost[h].sum()) for h in held]


def rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (Su et al., arXiv:2104.09864) of x (..., S, D), D even, at positions
    ``pos`` (S,): each pair of features (2i, 2i+1) of token t is rotated by the angle pos[t]·base^(−2i/D),
    so that a query at position a and a key at position b score  q·k = f(q, k, a − b)."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"RoPE rotates pairs of features: head_dim must be even, got {d}")
    angle = pos.to(torch.float64)[:, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def rope_under_zigzag(seq_len: int = 16, world_size: int = 2, heads: int = 2, head_dim: int = 8) -> dict:
    """RoPE on zigzag shards, one process, float64: every rank rotates its queries and keys (a) at the global
    positions it holds, (b) at local positions 0 … n−1.  Returns {"positions": [global positions of rank r],
    "global_error", "local_error": max |Δ| of rank r's rotated queries against the rows of RoPE applied to the
    whole sequence, "attention_error": max |Δ| of rank r's rows of causal attention under (b)}.  (A rank's
    shard is indexed by ``positions``: no graded function runs here.)"""
    from .blockwise import attention_block_explicit
    from .layouts import positions
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq_len, head_dim, generator=g, dtype=torch.float64) for _ in range(3))
    whole = torch.arange(seq_len)
    want_q, want_k = rope(q, whole), rope(k, whole)
    truth, _ = attention_block_explicit(want_q, want_k, v, causal=True)
    pos = [positions(seq_len, r, world_size, "zigzag") for r in range(world_size)]
    local = torch.arange(seq_len // world_size)
    q_local, k_local = torch.empty_like(q), torch.empty_like(k)      # every rank's shard rotated at 0 … n−1
    for p in pos:
        q_local[..., p, :], k_local[..., p, :] = rope(q[..., p, :], local), rope(k[..., p, :], local)
    wrong, _ = attention_block_explicit(q_local, k_local, v, causal=True)
    return {"positions": [p.tolist() for p in pos],
            "global_error": [float((rope(q[..., p, :], p) - want_q[..., p, :]).abs().max()) for p in pos],
            "local_error": [float((q_local[..., p, :] - want_q[..., p, :]).abs().max()) for p in pos],
            "attention_error": [float((wrong[..., p, :] - truth[..., p, :]).abs().max()) for p in pos]}
