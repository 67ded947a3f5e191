"""One α–β model, and the threshold each axis must clear to stay compute-bound.

A message of n bytes takes  α + n/β  (Hockney): α the latency of one message step, β the bandwidth one
device achieves on the link.  A collective over p ranks is a number of such steps:

    ring all-reduce      2(p−1)·α + 2(p−1)/p · n/β      (reduce-scatter + all-gather; Patarasuk & Yuan)
    tree all-reduce      2·⌈log₂p⌉·α +      2 · n/β      (NCCL's double binary tree, pipelined: the latency
                                                          grows as log p, the bandwidth term as a ring's)
    all-gather,
    reduce-scatter       (p−1)·α + (p−1)/p · n/β         (n: the whole gathered tensor)

nccl-tests reports two bandwidths for one collective (its PERFORMANCE.md):  algbw = n / t, the size over the
time, and  busbw = algbw · factor  with factor 2(p−1)/p for an all-reduce and (p−1)/p for all-gather,
reduce-scatter and all-to-all — the rate of the busiest link, comparable across p and against the link's
datasheet figure.  The course's β is a busbw.

Each axis adds communication that a device must hide behind (or pay beside) its own compute.  Writing F for
the FLOP/s a device achieves and b for the bytes of one value on the wire, each axis is compute-bound above a
threshold of the same form, a ratio F/β times a small factor (per device, in the axis's own unit):

    axis          must hide                               compute-bound when                       unit
    DP            gradient all-reduce behind backward     T ≥ (p−1)/p · b·F / (2β)                 tokens/device/step
    FSDP/ZeRO-3   all-gathers (fwd, bwd) + reduce-scatter T ≥ (p−1)/p · b·F / (2β)                 tokens/device/µbatch
    TP            2 all-reduces per layer and pass        h ≥ (t−1) · b·F / (6β)     (not hidden)  hidden size
    EP (GEMM)     an expert GEMM of m tokens              m ≥ b·F / (2·B_hbm)        (roofline)    tokens per expert
    EP (a2a)      dispatch + combine behind the experts   f ≥ (e−1)/e · b·F / (c·β), c = 3 gated   expert FFN width
    CP (ring)     K/V hop behind one block                n ≥ (H_kv/H) · b·F / (2β), ×2 causal     tokens per rank

(derivations in each function's docstring).  The latency α adds a floor: a message is worth sending whole only
when n/β dwarfs α, so each function also takes α and solves  compute ≥ α·steps + bytes/β  where it matters.
Lecture 0 introduces the model; lectures 3, 4a, 5a and 5b derive their own row; lecture 5c gathers the table
(:func:`threshold_table`) for an H100 node and for the machine the course runs on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Link", "link_of", "ring_all_reduce", "tree_all_reduce", "all_gather", "bus_bandwidth",
           "dp_tokens", "fsdp_tokens", "tp_hidden", "ep_tokens_per_expert", "ep_expert_ffn", "cp_tokens",
           "bucket_bytes", "threshold_table"]


@dataclass(frozen=True)
class Link:
    """α (seconds per message step), β (bytes/s one device achieves), F (FLOP/s one device achieves) and the
    device's memory bandwidth (bytes/s) — the four numbers every threshold below needs."""
    alpha: float
    beta: float
    flops: float
    hbm_bw: float = 0.0
    name: str = ""


def link_of(cluster, link: str = "intra") -> Link:
    """The :class:`Link` of a planner ``Cluster``: ``intra`` (inside a node) or ``inter`` (across nodes).
    F is the best-shaped GEMM's rate (peak × ``gemm_ceiling``), β the link's bandwidth × its measured
    efficiency, B_hbm the memory bandwidth × its efficiency — the figures :mod:`.hardware` cites."""
    if link not in ("intra", "inter"):
        raise ValueError(f"link must be 'intra' or 'inter', got {link!r}")
    bw = cluster.intra_bw * getattr(cluster, "intra_efficiency", 1.0) if link == "intra" else \
        cluster.inter_bw * getattr(cluster, "inter_efficiency", 1.0)
    alpha = getattr(cluster, "alpha_intra" if link == "intra" else "alpha_inter", 0.0) or 0.0
    flops = cluster.flops * (getattr(cluster, "gemm_ceiling", None) or 1.0)
    hbm = (getattr(cluster, "hbm_bw", 0.0) or 0.0) * (getattr(cluster, "memory_efficiency", None) or 1.0)
    return Link(alpha=alpha, beta=bw, flops=flops, hbm_bw=hbm, name=f"{cluster.name}, {link}")


# ----------------------------------------------------------------------------------------------
# Collectives in the α–β model


def ring_all_reduce(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Seconds: 2(p−1)·α + 2(p−1)/p · n/β."""
    return 0.0 if p <= 1 else 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / beta


def tree_all_reduce(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Seconds: 2·⌈log₂p⌉·α + 2·n/β — fewer steps than a ring for small messages on many ranks."""
    return 0.0 if p <= 1 else 2 * math.ceil(math.log2(p)) * alpha + 2 * nbytes / beta


def all_gather(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Seconds for a ring all-gather (or reduce-scatter) of a tensor of n bytes in all: (p−1)·α + (p−1)/p·n/β."""
    return 0.0 if p <= 1 else (p - 1) * alpha + (p - 1) / p * nbytes / beta


def bus_bandwidth(kind: str, nbytes: float, seconds: float, p: int) -> tuple[float, float]:
    """(algbw, busbw) of one measured collective, as nccl-tests reports them: algbw = n/t, busbw = algbw ×
    2(p−1)/p (all_reduce) or (p−1)/p (all_gather, reduce_scatter, all_to_all)."""
    factors = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p,
               "all_to_all": (p - 1) / p}
    if kind not in factors:
        raise ValueError(f"unknown collective {kind!r}; choose one of {', '.join(factors)}")
    alg = nbytes / seconds
    return alg, alg * factors[kind]


# ----------------------------------------------------------------------------------------------
# The thresholds


def dp_tokens(link: Link, p: int, grad_bytes: int = 2) -> float:
    """Tokens per device per step above which data parallelism hides its gradient all-reduce.

    A model of N parameters spends 4·N FLOPs per token in the backward, during which the gradients
    (N·b_g bytes) are all-reduced in buckets: hidden when  4·N·T/F ≥ 2(p−1)/p · N·b_g/β, i.e.
    T ≥ (p−1)/p · b_g·F/(2β).  N cancels: the threshold is the same for every model size."""
    return (p - 1) / p * grad_bytes * link.flops / (2 * link.beta) if p > 1 else 0.0


def fsdp_tokens(link: Link, p: int, param_bytes: int = 2) -> float:
    """Tokens per device per micro-batch above which FSDP (ZeRO-3) hides its all-gathers and reduce-scatter.

    Forward: the all-gather of the weights, (p−1)/p·N·b bytes, behind 2·N·T/F; backward: all-gather again and
    reduce-scatter the gradients, 2·(p−1)/p·N·b, behind 4·N·T/F.  Both give T ≥ (p−1)/p · b·F/(2β): the
    same bar as data parallelism — FSDP moves 1.5× DP's bytes, but the forward's share hides behind the forward.
    Per micro-batch, not per step: FSDP gathers the weights again for every micro-batch it accumulates (unless it
    keeps them gathered, paying their memory), so T counts the tokens of one micro-batch on one device."""
    return dp_tokens(link, p, param_bytes)


def tp_hidden(link: Link, t: int, act_bytes: int = 2) -> float:
    """Hidden size above which a Megatron layer's compute outweighs its tensor-parallel all-reduces.

    Per layer and token the matmuls cost 24·h² FLOPs forward (qkv 6h², projection 2h², a 4h MLP 16h²),
    split over t devices; the forward all-reduces two activations of h·b bytes: 2·2(t−1)/t·h·b/β.
    They sit on the critical path (nothing to overlap them with), so this is where they cost at most as much
    as the compute: 24·h²/(t·F) ≥ 4(t−1)/t · h·b/β  ⇔  h ≥ (t−1)·b·F/(6β)."""
    return (t - 1) * act_bytes * link.flops / (6 * link.beta) if t > 1 else 0.0


def ep_tokens_per_expert(link: Link, act_bytes: int = 2) -> float:
    """Tokens per expert above which an expert's GEMM is compute-bound (its roofline's ridge point).

    An expert's (m × h)·(h × f) GEMM does 2·m·h·f FLOPs on b·(m·h + h·f + m·f) bytes; for m ≪ h, f its
    intensity is ≈ 2m/b FLOP per byte, which reaches the ridge F/B_hbm at m ≥ b·F/(2·B_hbm).  Fewer tokens per
    expert (many fine-grained experts, small batches) leave the experts memory-bound: the weights are read
    for too few rows."""
    if link.hbm_bw <= 0:
        raise ValueError("ep_tokens_per_expert needs the device's memory bandwidth (Link.hbm_bw)")
    return act_bytes * link.flops / (2 * link.hbm_bw)


def ep_expert_ffn(link: Link, ep: int, act_bytes: int = 2, gated: bool = True) -> float:
    """Expert FFN width above which the experts' compute can hide the all-to-all's dispatch and combine.

    Each token's choice of an expert sends h·b bytes there and h·b back ((ep−1)/ep of them leave the device)
    and costs 2·c·h·f FLOPs (c = 3 matrices when gated, SwiGLU; 2 otherwise), forward; the backward doubles
    both.  Hidden when 2·c·h·f/F ≥ 2·(ep−1)/ep · h·b/β  ⇔  f ≥ (ep−1)/ep · b·F/(c·β).  The tokens per expert
    cancel: only the width of an expert and the link decide — which is why fine-grained experts keep their
    all-to-all inside the NVLink domain or limit the nodes a token may reach."""
    c = 3 if gated else 2
    return (ep - 1) / ep * act_bytes * link.flops / (c * link.beta) if ep > 1 else 0.0


def cp_tokens(link: Link, heads: int, kv_heads: int, head_dim: int, act_bytes: int = 2,
              causal: bool = False) -> float:
    """Tokens per rank above which ring attention hides each K/V hop behind one block's compute.

    One n × n block costs 4·n²·H·D FLOPs forward; the hop carries K and V, 2·n·H_kv·D·b bytes:
    4·n²·H·D/F ≥ α + 2·n·H_kv·D·b/β.  Without latency n* = (H_kv/H)·b·F/(2β); a causal (zigzag) ring does
    half a block's work per step, which doubles n*.  With α the quadratic's positive root."""
    work = 4 * heads * head_dim / link.flops / (2 if causal else 1)      # seconds per n²
    per_token = 2 * kv_heads * head_dim * act_bytes / link.beta          # seconds per n
    # work·n² − per_token·n − α = 0
    return (per_token + math.sqrt(per_token ** 2 + 4 * work * link.alpha)) / (2 * work)


def bucket_bytes(link: Link, p: int, latency_share: float = 0.1) -> float:
    """Bytes a gradient bucket needs so that latency is at most ``latency_share`` of its ring all-reduce:
    2(p−1)·α ≤ share · 2(p−1)/p · B/β  ⇔  B ≥ p·α·β/share.  It grows with p — the reason Megatron sizes its
    buckets as max(40 M, 1 M × dp) parameters."""
    if not 0 < latency_share < 1:
        raise ValueError(f"latency_share must be in (0, 1), got {latency_share!r}")
    return p * link.alpha * link.beta / latency_share


def threshold_table(intra: Link, inter: Link, *, dp: int = 64, tp: int = 8, ep: int = 8, heads: int = 64,
                    kv_heads: int = 8, head_dim: int = 128, act_bytes: int = 2) -> list[dict]:
    """Every axis's threshold on the link that axis usually uses (TP, EP and CP inside a node; DP and FSDP
    across), one row each: axis, what must hide, the threshold, its unit, the link."""
    rows = [
        ("DP", "gradient all-reduce", dp_tokens(inter, dp, act_bytes), "tokens / device / step", inter),
        ("FSDP", "all-gathers + reduce-scatter", fsdp_tokens(inter, dp, act_bytes), "tokens / device / micro-batch",
         inter),
        ("TP", "2 all-reduces per layer", tp_hidden(intra, tp, act_bytes), "hidden size h", intra),
        ("EP", "expert GEMM at its roofline", ep_tokens_per_expert(intra, act_bytes), "tokens / expert", intra),
        ("EP", "dispatch + combine, in node", ep_expert_ffn(intra, ep, act_bytes), "expert FFN width", intra),
        ("EP", "dispatch + combine, across", ep_expert_ffn(inter, ep, act_bytes), "expert FFN width", inter),
        ("CP", "K/V hop (causal ring)", cp_tokens(intra, heads, kv_heads, head_dim, act_bytes, causal=True),
         "tokens / rank", intra),
    ]
    return [{"axis": a, "hides": w, "threshold": v, "unit": u, "link": lk.name} for a, w, v, u, lk in rows]
