"""Published sparse (MoE) training runs as data — Megatron-Core's own Mixtral figures on H100s.

Each :class:`~.runs.PublishedRun` is one stated configuration and the throughput its source reports, with every
setting its configuration states (the rest marked ASSUMED).  Their throughput is Megatron's own count —
``--log-throughput``'s teraFLOP/s per GPU, from ``num_floating_point_operations`` in
``megatron/training/training.py`` (:func:`megatron_flops`) — so a row's step is that count over its
teraFLOP/s and its GPUs.

Mixtral 8x7B — Megatron-LM ``megatron/core/transformer/moe/README.md``: "With MCore v0.9, we've achieved remarkable
performance of 468 TFLOPS for Mixtral 8X7B bf16 training", and its "Reference Best Parallel Mapping" row: Mixtral
8x7B (Dropless), vocabulary 32K, dispatcher All-to-All, BF16, 64 GPUs, sequence 4,096, TP 1, EP 8, PP 4, VP 8,
MBS 1, GBS 256, on 8×H100 80GB HBM3 servers with NVLink 4 and 8 × 400 Gbit/s InfiniBand (the table names MCore
v0.8's mapping, the headline v0.9's throughput).  The settings the README leaves out are those of the same model
in Megatron-MoE-ModelZoo (``model_configs/benchmarking/Mixtral-8x7B.yaml``, whose ``runtime.conf`` row states the
same mapping): 32 layers, hidden 4,096, FFN 14,336, 32 heads, 8 query groups, SwiGLU, RMSNorm, RoPE, no biases,
untied embeddings, no dropout, 8 experts top-2 with an auxiliary loss, expert-tensor size 1, the distributed
optimizer with gradient reduce-scatter and parameter all-gather overlapped, flash attention, grouped GEMM, no
recomputation.  MCore v0.9 (October 2024) counted every attention score (the causal half came in March 2025).

Mixtral 8x22B — Megatron-MoE-ModelZoo ``best_practice/mixtral/run_mixtral_8x22B.sh`` (MBS 1, GBS 256, sequence
4,096, 16 nodes, grouped GEMM, dispatcher alltoall) with ``runtime_configs/benchmarking/runtime.conf`` (TP 2, PP 8,
EP 8, CP 1, VPP 7, 56 layers), ``model_configs/benchmarking/Mixtral-8x22B.yaml`` (hidden 6,144, FFN 16,384, 48
heads, 8 query groups, expert-tensor size 1, the distributed optimizer overlapped, sequence parallelism, flash
attention, fused cross-entropy, fused permutation and router, 8 experts top-2 with an auxiliary loss) and
``sbatch_benchmarking.sh`` (BF16 adds ``--tp-comm-overlap``; ``PR=fp8`` adds blockwise FP8 with FP8 weights
gathered, fp32 main gradients and parameters and bf16 Adam moments, and no TP overlap).  The script's rows:
dropless "around 445TFLOPS for H100"; dropless with forced balancing "around 465 TFLOPS"; block-wise FP8 with
forced balancing "around 560 TFLOPS"; token dropping at capacity factor 1.0 with padded buffers "around
470TFLOPS" (commented out at the script's head, stated).  December 2025's Megatron counts half the scores (causal).

Megatron-LM keeps fp32 main gradients for a bf16 model (``--accumulate-allreduce-grads-in-fp32`` turned on for
bf16 in ``megatron/training/arguments.py``): 4 bytes per parameter for the gradient buffer, and the distributed
optimizer's fp32 master weights and Adam moments sharded over data parallelism (12 bytes).
"""
from __future__ import annotations

from dataclasses import replace

from .model import Cluster, Composition, Model
from .runs import PublishedRun

__all__ = ["megatron_flops", "mixtral", "MIXTRAL_8X7B", "MIXTRAL_8X22B", "MOE_RUNS"]

_README = "Megatron-LM megatron/core/transformer/moe/README.md"
_ZOO = "Megatron-MoE-ModelZoo best_practice/mixtral/run_mixtral_8x22B.sh with runtime_configs/benchmarking/runtime.conf"


def megatron_flops(model: Model, *, tp: int = 1, causal_half: bool = True) -> float:
    """FLOPs of one step as Megatron's ``num_floating_point_operations`` counts them (and ``--log-throughput``
    divides by the step): per token 3 × 2 × every layer's GEMM parameters seen by the token (attention, the dense
    FFN or k routed experts and the shared experts, SwiGLU's third matrix) + 3 × 2 × 2 × L·s·a·d for the scores
    (half of them with ``causal_half``, December 2025's count; MCore v0.9's counts all) + 6·h·V for the logits
    over the vocabulary padded to 128·tp.  Multi-head latent attention as that function counts it."""
    h, s, a = model.hidden, model.seq_len, model.heads
    gate = 1.5 if model.gated_ffn else 1.0
    moe = model.moe_layers
    dense = model.layers - moe
    mlp = 12 * h * gate * (dense * model.ffn + moe * (model.top_k * model.d_expert
                                                       + model.shared_experts * model.d_shared))
    half = 0.5 if causal_half else 1.0
    if model.mla:
        d_qk = model.d_head + model.qk_rope_head_dim
        q = (model.q_lora_rank * (h + a * d_qk + 1) if model.q_lora_rank else h * a * d_qk)
        attn = 6 * model.layers * (q + model.kv_lora_rank * (h + a * (model.d_head + model.d_v) + 1)
                                   + h * model.qk_rope_head_dim + a * model.d_v * h
                                   + s * a * d_qk * half + s * a * model.d_v * half)
    else:
        qp = a * model.d_head                     # the query projection size (kv_channels × heads)
        attn = 12 * model.layers * h * h * (1 + model.kv_heads / a + s / h * half) * qp / h
    vocab = -(-model.vocab // (128 * tp)) * 128 * tp
    return model.global_batch * s * (mlp + attn + 6 * h * vocab)


def mixtral(name: str, layers: int, hidden: int, heads: int, ffn: int, *, source: str, **kw) -> Model:
    """A Mixtral as Megatron-MoE-ModelZoo configures it: 8 experts top-2 of FFN ``ffn`` (SwiGLU) in every layer, 8
    query groups, RMSNorm, RoPE, no biases, untied embeddings, no dropout, the Llama 2 tokenizer's 32,000
    tokens, sequence 4,096, micro-batch 1, global batch 256, dropless; bf16 weights with Megatron's fp32 main
    gradients (4 bytes) and fp32 master weights and Adam moments (12)."""
    return Model(name, layers=layers, hidden=hidden, heads=heads, kv_heads=8, ffn=ffn, vocab=32000, seq_len=4096,
                 micro_batch=1, global_batch=256, num_experts=8, top_k=2, capacity_factor=None, gated_ffn=True,
                 tied_embeddings=False, dropout=False, biases=False, grad_bytes=4, optimizer_bytes=12, source=source,
                 **kw)


def _megatron_comp(**kw) -> Composition:
    """What every Megatron-MoE-ModelZoo Mixtral configuration sets: expert-tensor size 1, the distributed optimizer
    with its gradient reduce-scatter and parameter all-gather overlapped, sequence parallelism, flash attention,
    no recomputation, weight gradients accumulated in the GEMMs (Megatron-LM's default)."""
    return Composition(etp=1, distributed_optimizer=True, dp_overlap=True, sequence_parallel=True, flash=True,
                       recompute="none", grad_accumulation_fusion=True, **kw)


def _run(name: str, source: str, model: Model, comp: Composition, gpus: int, tflops: float, *, causal_half: bool,
         assumed: tuple[str, ...] = ()) -> PublishedRun:
    step = megatron_flops(model, tp=comp.tp, causal_half=causal_half) / (tflops * 1e12 * gpus)
    return PublishedRun(name, source, model, Cluster.preset("h100-80gb-sxm", gpus), comp, tflops, assumed,
                        published_step=step)


MIXTRAL_8X7B = mixtral("Mixtral 8x7B", 32, 4096, 32, 14336,
                       source=f"{_README} (Reference Best Parallel Mapping; model: Megatron-MoE-ModelZoo "
                              "model_configs/benchmarking/Mixtral-8x7B.yaml)")
MIXTRAL_8X22B = mixtral("Mixtral 8x22B", 56, 6144, 48, 16384,
                        source=f"{_ZOO}; model_configs/benchmarking/Mixtral-8x22B.yaml")

_8X22B = _megatron_comp(dp=8, tp=2, pp=8, ep=8, virtual_stages=7)
_DEFAULT_IMBALANCE = ("load_imbalance: the planner's default (no measurement of this router's per-step load is "
                      "published)",)

MOE_RUNS = [
    _run("Mixtral 8x7B, tp 1 pp 4 ep 8 v 8 on 64", f"{_README}: 468 TFLOP/s (MCore v0.9), mapping TP 1 EP 8 PP 4 VP 8",
         MIXTRAL_8X7B, _megatron_comp(dp=16, tp=1, pp=4, ep=8, virtual_stages=8), 64, 468, causal_half=False,
         assumed=_DEFAULT_IMBALANCE + ("the ModelZoo's settings for the same model and mapping (the README states "
                                       "the mapping, dispatcher and precision only)",)),
    _run("Mixtral 8x22B dropless, tp 2 pp 8 ep 8 v 7 on 128", f"{_ZOO}: dropless, around 445 TFLOP/s",
         MIXTRAL_8X22B, replace(_8X22B, tp_overlap=True), 128, 445, causal_half=True, assumed=_DEFAULT_IMBALANCE),
    _run("Mixtral 8x22B forced balance, tp 2 pp 8 ep 8 v 7 on 128",
         f"{_ZOO}: dropless with --moe-router-force-load-balancing, around 465 TFLOP/s",
         replace(MIXTRAL_8X22B, load_imbalance=1.0), replace(_8X22B, tp_overlap=True), 128, 465, causal_half=True),
    _run("Mixtral 8x22B FP8 forced balance, tp 2 pp 8 ep 8 v 7 on 128",
         f"{_ZOO}: PR=fp8 (block-wise FP8) with --moe-router-force-load-balancing, around 560 TFLOP/s",
         replace(MIXTRAL_8X22B, load_imbalance=1.0, param_bytes=1, grad_bytes=4, optimizer_bytes=8),
         replace(_8X22B, fp8=True), 128, 560, causal_half=True,
         assumed=("FP8 weights (--fp8-param-gather): 1 byte per parameter; fp32 master weights with bf16 Adam "
                  "moments (--use-precision-aware-optimizer): 8 bytes",)),
    _run("Mixtral 8x22B capacity 1.0, tp 2 pp 8 ep 8 v 7 on 128",
         f"{_ZOO}: --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity, around 470 TFLOP/s",
         replace(MIXTRAL_8X22B, capacity_factor=1.0), replace(_8X22B, tp_overlap=True), 128, 470, causal_half=True),
]
