"""Worker functions for notebooks and tests: run the sequence-parallel attentions on every rank.

Each worker builds the same full-size inputs on every rank from a seed (:func:`make_inputs`),
keeps its own shard, runs one algorithm and returns plain tensors, so the caller can unshard the
results and compare them with full attention.  Call them through ``reference.launch``::

    from reference.launch import run_world
    from reference.sequence import demos
    res = run_world(demos.ring_worker, 4, seq_len=64, layout="zigzag", causal=True)
    res.values[r]["out"], res.trace.filter(op="compute")

(Lecture helpers may append more workers below; keep them module-level functions.)
"""
from __future__ import annotations

import torch

from .. import comm
from .layouts import shard_sequence
from .ring import ring_attention, ring_attention_forward
from .ulysses import heads_to_seq, seq_to_heads, ulysses_attention
from .usp import usp_attention, usp_groups, usp_shard


def make_inputs(seq_len: int, *, batch: int = 1, heads: int = 2, heads_kv: int | None = None, head_dim: int = 8,
                seed: int = 0, dtype: torch.dtype = torch.float32, logit_scale: float = 1.0):
    """Full (q, k, v, dout): N(0, 1) entries drawn in float64 from ``seed`` then cast to ``dtype``.

    q is multiplied by ``logit_scale`` (the attention logits scale by the same factor).  Casting
    a float64 draw means a float64 ground truth can use exactly the values the ranks used.
    """
    g = torch.Generator().manual_seed(seed)
    hk = heads if heads_kv is None else heads_kv
    q = torch.randn(batch, heads, seq_len, head_dim, generator=g, dtype=torch.float64) * logit_scale
    k = torch.randn(batch, hk, seq_len, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, hk, seq_len, head_dim, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, heads, seq_len, head_dim, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def ring_worker(seq_len: int, layout: str = "contiguous", causal: bool = False, *, backward: bool = True,
                kernel: str = "fused", iterations: int = 1, **inputs) -> dict:
    """Ring attention on this rank's shard; returns out, lse (and dq, dk, dv) of the shard.

    ``iterations`` > 1 repeats forward+backward (a deadlock test); the last results are returned.
    """
    r, W = comm.rank(), comm.world_size()
    q, k, v, dout = (shard_sequence(t, r, W, layout) for t in make_inputs(seq_len, **inputs))
    if not backward:
        out, lse = ring_attention_forward(q, k, v, causal=causal, layout=layout, kernel=kernel)
        return {"out": out, "lse": lse}
    for _ in range(iterations):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = ring_attention(qg, kg, vg, causal=causal, layout=layout, return_lse=True, kernel=kernel)
        out.backward(dout)
    return {"out": out.detach(), "lse": lse, "dq": qg.grad, "dk": kg.grad, "dv": vg.grad}


def ring_call_worker(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                     layout: str = "contiguous") -> dict:
    """Ring attention forward on tensors given as they are (each rank passes the same ones: for error tests)."""
    out, lse = ring_attention_forward(q, k, v, causal=causal, layout=layout)
    return {"out": out, "lse": lse}


def ulysses_worker(seq_len: int, causal: bool = False, *, backward: bool = True, **inputs) -> dict:
    r, W = comm.rank(), comm.world_size()
    q, k, v, dout = (shard_sequence(t, r, W, "contiguous") for t in make_inputs(seq_len, **inputs))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = ulysses_attention(qg, kg, vg, causal=causal)
    if not backward:
        return {"out": out.detach()}
    out.backward(dout)
    return {"out": out.detach(), "dq": qg.grad, "dk": kg.grad, "dv": vg.grad}


def ulysses_call_worker(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> dict:
    return {"out": ulysses_attention(q, k, v, causal=causal)}


def roundtrip_worker(seq_len: int, heads: int = 4, seed: int = 0) -> dict:
    """seq_to_heads then heads_to_seq on this rank's contiguous shard: returns input, middle, output."""
    r, W = comm.rank(), comm.world_size()
    x = shard_sequence(make_inputs(seq_len, heads=heads, seed=seed)[0], r, W, "contiguous")
    mid = seq_to_heads(x)
    return {"x": x, "heads": mid, "back": heads_to_seq(mid)}


def usp_worker(seq_len: int, ulysses_size: int, ring_size: int, layout: str = "zigzag", causal: bool = False,
               **inputs) -> dict:
    """USP on a U × R grid; returns this rank's piece of out, dq, dk, dv (as :func:`.usp.usp_shard`)."""
    ug, rg = usp_groups(ulysses_size, ring_size)
    u, i = comm.rank(ug), comm.rank(rg)
    q, k, v, dout = (usp_shard(t, u, ulysses_size, i, ring_size, layout) for t in make_inputs(seq_len, **inputs))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = usp_attention(qg, kg, vg, causal=causal, ulysses_group=ug, ring_group=rg, layout=layout)
    out.backward(dout)
    return {"out": out.detach(), "dq": qg.grad, "dk": kg.grad, "dv": vg.grad}


# ----------------------------------------------------------------------------------------------
# Lecture 5a notebook: the ring widget, the timeline, memory and bytes per rank.  These run on the
# first ``world_size`` ranks of a bigger kept-alive world (one World(4) serves W = 2, 3, 4); the
# other ranks return None at once.

from .. import trace  # noqa: E402  (used by the workers below)

_FIRST_RANKS: dict[int, object] = {}


def first_ranks_group(size: int):
    """The group of global ranks 0..size-1 (None for the whole world).  Created once per size, by
    every rank in the same order (each call reaches every rank with the same ``size``)."""
    if size == comm.world_size():
        return None
    if size not in _FIRST_RANKS:
        _FIRST_RANKS[size] = comm.new_group(list(range(size)))
    return _FIRST_RANKS[size]


def ring_replay_worker(seq_len: int, world_size: int, layout: str, causal: bool, *, kernel: str = "fused",
                       **inputs) -> dict | None:
    """Ring attention forward on ranks 0..world_size-1 (a trace for the ring widget); returns the
    largest difference from full float64 attention on this rank's rows."""
    group = first_ranks_group(world_size)
    r = comm.rank()
    if r >= world_size:
        return None
    from .blockwise import attention_block_explicit
    from .layouts import positions
    q, k, v, _ = make_inputs(seq_len, **inputs)
    shards = [shard_sequence(t, r, world_size, layout) for t in (q, k, v)]
    out, lse = ring_attention_forward(*shards, causal=causal, layout=layout, group=group, kernel=kernel)
    with trace.quiet():
        full, _ = attention_block_explicit(q.double(), k.double(), v.double(), causal=causal)
    err = float((out.double() - full[..., positions(seq_len, r, world_size, layout), :]).abs().max())
    return {"max_error": err}


def ring_timing_worker(seq_len: int, world_size: int, layout: str = "zigzag", causal: bool = True, *,
                       backward: bool = False, **inputs) -> dict | None:
    """One timed ring forward (and backward) on ranks 0..world_size-1; the caller reads the trace."""
    import time
    group = first_ranks_group(world_size)
    r = comm.rank()
    if r >= world_size:
        return None
    q, k, v, dout = (shard_sequence(t, r, world_size, layout) for t in make_inputs(seq_len, **inputs))
    comm.barrier(group=group)
    t0 = time.perf_counter()
    if backward:
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        ring_attention(qg, kg, vg, causal=causal, layout=layout, group=group).backward(dout)
    else:
        ring_attention_forward(q, k, v, causal=causal, layout=layout, group=group)
    return {"seconds": time.perf_counter() - t0}


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def peak_memory_worker(seq_len: int, world_size: int, kernel: str = "explicit", **inputs) -> dict | None:
    """Peak resident memory (bytes) a causal ring forward adds on ranks 0..world_size-1 (Linux only).

    world_size 1 is one device computing attention of the whole sequence at once.  The peak is
    read from /proc (VmHWM, reset through /proc/self/clear_refs), so it counts every byte the
    process touched: inputs, K/V buffers, the scores of the block being computed.
    """
    import gc
    group = first_ranks_group(world_size) if world_size > 1 else None
    r = comm.rank()
    if r >= world_size:
        return None
    from .blockwise import block_kernels
    q, k, v, _ = (shard_sequence(t, r, world_size, "contiguous") for t in make_inputs(seq_len, **inputs))
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return {"peak_bytes": None}
    base = _rss_kib("VmRSS")
    if world_size == 1:
        forward, _ = block_kernels(kernel)
        with torch.no_grad():
            out, lse = forward(q, k, v, causal=True)
    else:
        out, lse = ring_attention_forward(q, k, v, causal=True, group=group, kernel=kernel)
    peak = _rss_kib("VmHWM")
    del out, lse
    return {"peak_bytes": (peak - base) * 1024}


def bytes_worker(seq_len: int, world_size: int, **inputs) -> dict | None:
    """Ring attention forward, then Ulysses attention forward, on the same shards (for the trace)."""
    group = first_ranks_group(world_size)
    r = comm.rank()
    if r >= world_size:
        return None
    q, k, v, _ = (shard_sequence(t, r, world_size, "contiguous") for t in make_inputs(seq_len, **inputs))
    with trace.span("phase", what="ring"):
        ring_attention_forward(q, k, v, causal=True, group=group)
    with trace.span("phase", what="ulysses"), torch.no_grad():
        ulysses_attention(q, k, v, causal=True, group=group)
    return {}


# ----------------------------------------------------------------------------------------------
# The notebook's demos, recordable: in the student release they replay what the reference did
# until the learner's exercises pass (reference.recorded).  ``world``: a live World(4) to reuse.

from ..recorded import live_world, recordable  # noqa: E402


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


@recordable("05a.timeline", needs=("5a.2", "5a.3"))
def ring_timeline(seq_len: int = 4096, world_size: int = 2, heads: int = 4, head_dim: int = 64, world=None) -> dict:
    """One timed ring forward (after a warm-up): its trace, for the overlap timeline."""
    with _world4(world) as w:
        w.run(ring_timing_worker, 1024, world_size, heads=heads, head_dim=head_dim)
        res = w.run(ring_timing_worker, seq_len, world_size, heads=heads, head_dim=head_dim)
    return {"trace": res.trace, "seconds": max(v["seconds"] for v in res.values[:world_size])}


@recordable("05a.memory", needs=("5a.2", "5a.3"))
def memory_per_rank(lengths: tuple = (1024, 2048), sizes: tuple = (1, 2, 4), heads: int = 2, head_dim: int = 64,
                    world=None) -> list[dict]:
    """Peak memory a causal explicit-kernel attention forward adds per rank, for each (L, W)."""
    rows = []
    with _world4(world) as w:
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


@recordable("05a.usp", needs=("5a.2", "5a.3", "5a.4"))
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
