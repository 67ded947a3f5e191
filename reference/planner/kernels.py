"""Kernel time from the shape: how long one device spends on each GEMM, on attention's core and on the
memory-bound element-wise work of a transformer layer.

A GEMM C[M×N] = A[M×K]·B[K×N] does 2·M·N·K FLOPs and moves at least e·(M·K + K·N + M·N) bytes.  Its
time is the larger of the two roofline bounds (Williams et al., "Roofline", CACM 2009):

    t = max( 2MNK / (peak · η(M, N)),  e·(MK + KN + MN) / (hbm_bw · μ) )

μ is the fraction of the datasheet memory bandwidth a streaming kernel reaches (``memory_efficiency``).

η is the fraction of peak the kernel reaches.  Two effects of NVIDIA's "Matrix Multiplication
Background User's Guide" (§3 Dimension Quantization Effects) and one benchmark figure set it:

    tile quantization   C is computed in tiles (cuBLAS's largest, most efficient: 256×128); a partial
                        tile costs a whole one:            η_tile = M·N / (⌈M/tm⌉·tm · ⌈N/tn⌉·tn)
    wave quantization   the tiles run in waves of one per SM; a partial last wave costs a whole one:
                        η_wave = w / ⌈w⌉,   w = tiles / SMs
    ceiling             the best-shaped large GEMM's fraction of peak (MAMF, :mod:`.hardware`)

    η(M, N) = ceiling · max over tiles (tm × tn ∈ 256×128, 128×256, 128×128) of η_tile · η_wave

Attention's core (QKᵀ and P·V, per head) is counted on its own: without flash attention, two batched
GEMMs (K = head dim, often memory-bound) plus the memory-bound softmax and dropout on the a·s² scores;
with flash attention, 4·s_q·s_k·d FLOPs per head forward (half of them skipped when causal), 2.5× that
backward (FlashAttention-2 recomputes QKᵀ), at the device's ``attention_ceiling``.

Element-wise work (norms, bias + GeLU, bias + dropout + residual, as Megatron fuses them) moves bytes
and does no tensor-core math: its time is bytes / (hbm_bw · μ).  Every count is per device, per micro-batch.
"""
from __future__ import annotations

import math

from .collectives import sweep_rate
from .model import Cluster, Model

__all__ = ["TILES", "gemm_efficiency", "gemm_time", "memory_time", "attention_gemms", "ffn_gemms", "layer_gemms",
           "attention_core_time", "elementwise_bytes"]

TILES = ((256, 128), (128, 256), (128, 128))     # cuBLAS tile shapes (NVIDIA Matrix Multiplication guide §2.3)


def gemm_efficiency(m: float, n: float, cluster: Cluster, batch: int = 1, sms: int | None = None,
                    fp8: bool = False) -> float:
    """η(M, N): the ceiling (the FP8 one for ``fp8``) times the best tile's tile × wave quantization, for ``batch``
    GEMMs at once on ``sms`` SMs (default: all of the device's)."""
    sms = sms or cluster.sms
    best = 0.0
    for tm, tn in TILES:
        tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
        tile = m * n / (tiles_m * tm * tiles_n * tn)
        waves = batch * tiles_m * tiles_n / sms
        best = max(best, tile * waves / math.ceil(waves))
    ceiling = (cluster.fp8_gemm_ceiling or cluster.gemm_ceiling) if fp8 else cluster.gemm_ceiling
    return ceiling * best


def gemm_time(m: float, n: float, k: float, cluster: Cluster, *, batch: int = 1, elem: int = 2,
              sms: int | None = None, fp8: bool = False) -> float:
    """Seconds for ``batch`` GEMMs [m×k]·[k×n]: the larger roofline bound.  ``sms``: the SMs left to it (others
    busy with communication: the peak scales with them); ``fp8``: inputs in FP8 (1 byte) at the FP8 peak."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    if cluster.gemm_sweep:          # a measured device (this machine's cores): the sweep's rate at this size
        flops = 2 * m * n * k * batch
        return max(flops / sweep_rate(cluster.gemm_sweep, flops),
                   memory_time(elem * (m * k + k * n + m * n) * batch, cluster))
    share = (sms or cluster.sms) / cluster.sms
    peak = (cluster.fp8_flops if fp8 else cluster.flops) * share
    flops = 2 * m * n * k * batch
    bytes_ = ((m * k + k * n) * (1 if fp8 else elem) + m * n * elem) * batch
    return max(flops / (peak * gemm_efficiency(m, n, cluster, batch, sms, fp8)), memory_time(bytes_, cluster))


def memory_time(nbytes: float, cluster: Cluster) -> float:
    """Seconds to stream ``nbytes`` through device memory (a memory-bound kernel): nbytes / (hbm_bw · μ)."""
    return nbytes / (cluster.hbm_bw * cluster.memory_efficiency)


def attention_gemms(model: Model, tokens: float, tp: int) -> dict[str, tuple[float, float, float]]:
    """The forward GEMMs of one layer's attention on one device, {name: (M, N, K)}: M tokens, weights cut over tp.

    QKV [T×h]·[h×(a+2·kv)·d/t] and proj [T×a·d/t]·[a·d/t×h]; with multi-head latent attention the down
    projections (whole on every tensor rank) and the up projections (cut over tp) instead of QKV.
    """
    h, a = model.hidden, model.heads
    out = {}
    if model.mla:
        if model.q_lora_rank:
            out["q_down"] = (tokens, model.q_lora_rank, h)
        out["q_up" if model.q_lora_rank else "q"] = (tokens, a * model.d_qk / tp, model.q_lora_rank or h)
        out["kv_down"] = (tokens, model.kv_lora_rank + model.qk_rope_head_dim, h)
        out["kv_up"] = (tokens, a * (model.d_head + model.d_v) / tp, model.kv_lora_rank)
    else:
        out["qkv"] = (tokens, (a + 2 * model.kv_heads) * model.d_head / tp, h)
    out["proj"] = (tokens, h, a * model.d_v / tp)
    return out


def ffn_gemms(model: Model, tokens: float, size: float, tp: int) -> dict[str, tuple[float, float, float]]:
    """The forward GEMMs of an FFN of inner size ``size`` cut over ``tp``: FC1 [T×h]·[h×f·(2 if gated)/t],
    FC2 [T×f/t]·[f/t×h]."""
    up = size * (2 if model.gated_ffn else 1)
    return {"fc1": (tokens, up / tp, model.hidden), "fc2": (tokens, model.hidden, size / tp)}


def layer_gemms(model: Model, tokens: float, tp: int, *, moe: bool = False) -> list[tuple[float, float, float]]:
    """The forward GEMMs of one layer on one device, as (M, N, K): attention's and the dense FFN's — or, for a MoE
    layer, its experts' as one GEMM over their k·capacity·T rows at the mean (the time model's are per expert,
    :mod:`.experts`)."""
    ffn = ffn_gemms(model, tokens * model.top_k * model.capacity, model.d_expert, tp) if moe else \
        ffn_gemms(model, tokens, model.ffn, tp)
    return [*attention_gemms(model, tokens, tp).values(), *ffn.values()]


def attention_core_time(model: Model, cluster: Cluster, *, b: int, tp: int, cp: int, flash: bool
                        ) -> tuple[float, float]:
    """(forward, backward) seconds of attention's core on one device, one micro-batch, one layer.

    Each of the a/t local heads has s/c queries against s keys: QKᵀ over d_qk (d, plus the rotary part under
    MLA), P·V over d_v.  With flash attention 2·s_q·s_k·(d_qk + d_v) FLOPs per head forward (half of them
    skipped when causal), 2.5× that backward (FlashAttention-2 recomputes QKᵀ), at the device's
    ``attention_ceiling``.  Without flash: QKᵀ and P·V as batched GEMMs (full s², masked — Megatron 2021
    computes every score) and the softmax (read + write e per score) and dropout (read + write e and a 1-byte
    mask) on b·(a/t)·(s/c)·s scores; backward: two GEMMs per forward GEMM, and softmax' and dropout' (read two,
    write one).
    """
    s, e = model.seq_len, model.act_bytes
    sq, heads = s / cp, b * model.heads // tp
    if flash:
        flops = 2 * sq * s * (model.d_qk + model.d_v) * heads * (0.5 if model.causal else 1.0)
        fwd = flops / (cluster.flops * cluster.attention_ceiling)
        return fwd, 2.5 * fwd
    qk = gemm_time(sq, s, model.d_qk, cluster, batch=heads, elem=e)
    pv = gemm_time(sq, model.d_v, s, cluster, batch=heads, elem=e)
    scores = heads * sq * s
    drop = 1 if model.dropout else 0
    soft_f, drop_f = 2 * e, (2 * e + 1) * drop
    soft_b, drop_b = 3 * e, (2 * e + 1) * drop
    fwd = qk + pv + memory_time(scores * (soft_f + drop_f), cluster)
    bwd = 2 * (qk + pv) + memory_time(scores * (soft_b + drop_b), cluster)
    return fwd, bwd


def elementwise_bytes(model: Model, tokens: float, tp: int, *, sequence_parallel: bool, moe: bool = False,
                      ffn: float | None = None) -> float:
    """Bytes one device streams through memory in one layer's forward element-wise kernels.

    Per token: two norms (read + write h), two fused bias + dropout + residual adds (read 2h, write h,
    a 1-byte mask of h), and the FFN's activation (bias + GeLU: read + write f/t; SwiGLU: read 2f/t,
    write f/t).  The h-sized ones are cut over t only with sequence parallelism.  ``ffn``: the activations'
    total inner size per token (a MoE layer's k·rows·expert_ffn + the shared experts'; default the dense
    FFN's, or with ``moe`` the experts' at the mean).  The backward streams ASSUMED twice as much (each kernel
    reads its saved input and the incoming gradient).
    """
    e, h = model.act_bytes, model.hidden
    mask = 1 if model.dropout else 0
    per_h = 2 * (2 * e) + 2 * (3 * e + mask)
    if ffn is None:
        ffn = model.top_k * model.capacity * model.d_expert + model.shared_experts * model.d_shared if moe \
            else model.ffn
    act = (3 if model.gated_ffn else 2) * e * ffn / tp
    return tokens * per_h * h / (tp if sequence_parallel else 1) + tokens * act
