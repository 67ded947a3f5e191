"""Published training runs as data — what the planner's step time and memory are held against.

Each :class:`PublishedRun` is one row of a paper's table with every setting the paper (or the scripts it
published) states, the row's source, and the throughput it reports.  Settings a row needs and its source
does not give are marked ASSUMED, with the reason.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
arXiv:2104.04473 — GPT models, vocabulary 51,200, sequence 2,048 (§5.1), fp16, on Selene's 80 GB A100s
with 8 × 200 Gb/s HDR InfiniBand per 8-GPU node (§5).  Achieved FLOP/s count (§5.1, Appendix)

    F = 96 · B · s · l · h² · (1 + s/(6h) + V/(16·l·h))      FLOPs per step (recomputation included)

so a row's step time is F / (X · n) for X teraFLOP/s per GPU on n GPUs.
    Table 1 (weak scaling): model shape, tp, pp, GPUs, batch and X per row.  The micro-batch, the
      interleaving depth, full recomputation ("--checkpoint-activations") and the DDP implementation
      ("torch": gradients reduced during the backward; "local": after it) of each row are those of the
      paper's own script, Megatron-LM examples/sc21/run_table_1.sh (commit de7dc40, "scripts for sc21"),
      which also sets --fp16.  Scatter/gather of pipeline activations (§4.1) is Megatron's default then
      (run_figure_18.sh turns it off with --no-scatter-gather-tensors-in-pipeline).
    Table 2 (PTD-P against ZeRO-3 without model parallelism): parameters, model-parallel size, batch,
      GPUs, micro-batch and X per row.  Not in the table, ASSUMED: the 174.6B model is GPT-3's shape
      (96 layers, h 12,288, 96 heads) at tp 8 × pp 12 = 96 with 2 layers per virtual stage, as the
      paper's 175B runs of Figures 12 and 18 (run_figure_18.sh: TP 8, PP 12, 2 layers per virtual
      stage); the 529.6B model is Table 1's row (tp 8 × pp 35 = 280, one layer per virtual stage);
      PTD-P with local DDP as Table 1's pipelined rows; ZeRO-3 (DeepSpeed) with full recomputation (the
      F above counts it) and DeepSpeed's defaults: the gradient reduce-scatter overlapped, at most 5e7
      parameter elements prefetched ahead of use (stage3_prefetch_bucket_size).

Every row runs on Selene's A100s as :mod:`.hardware` describes them, with one figure of the runs' own era: the
GEMM ceiling.  The paper's stack is the NGC PyTorch 20.12 container (Megatron-LM's README at the sc21 commit:
PyTorch 1.8, CUDA 11.1, NCCL 2.8.3).  Its GEMMs are timed at the nearest published benchmark of a CUDA 11
stack, 230 of 312 TFLOP/s (:data:`.hardware.A100_GEMM_2022`), not at today's best shape-searched GEMM (the
preset's 271.2): with today's figure every compute-bound row comes out 8–19 % too fast (median |error| 11.1 %),
with the era's 0–12 % either way (:func:`compare` ``(ceiling=...)`` shows both).

Held out (:data:`HELD_OUT_RUNS`): 19 runs on H100s from NVIDIA's DGX Cloud Benchmarking recipes, added after the
model was written (see the block comment above them).  No constant is fitted to them; but they came out 15–19 %
too fast, and what that sent us looking for is now in the model, each from its own source: what TP overlap costs
(:mod:`.overlap`, from each recipe's configuration), the sustained rather than the burst GEMM ceiling of a
power-limited H100 (:mod:`.hardware` [MSMF]), and each recipe's own settings (optimizer state, attention kernel,
recomputation, fused gradient accumulation) from the YAML its launch script runs.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198, Table 2: activation memory per transformer layer for each technique (rows below),
bytes, with s, b, h, a, t the sequence, micro-batch, hidden size, heads and tensor-parallel size.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .hardware import A100_GEMM_2022, FA2_ON_H100, PRESETS
from .model import Cluster, Composition, Model
from .overlap import TE_DEFAULTS_1, TPOverlap

__all__ = ["PublishedRun", "narayanan_flops", "gpt", "selene", "compare", "NARAYANAN_TABLE_1", "NARAYANAN_TABLE_2",
           "PUBLISHED_RUNS", "HELD_OUT_RUNS", "KORTHIKANTI_TABLE_2"]


def selene(gpus: int) -> Cluster:
    """``gpus`` of Selene's 80 GB A100s (the "a100-80gb-sxm" preset) with the GEMM ceiling of a CUDA 11 stack."""
    return Cluster.preset("a100-80gb-sxm", gpus, gemm_ceiling=A100_GEMM_2022)


_T1 = "Narayanan et al. 2021, arXiv:2104.04473, Table 1"
_T2 = "Narayanan et al. 2021, arXiv:2104.04473, Table 2"
_SCRIPT = "Megatron-LM examples/sc21/run_table_1.sh"


@dataclass(frozen=True)
class PublishedRun:
    """One row: the model, the cluster, the composition it ran, and the teraFLOP/s per GPU it reached."""
    name: str
    source: str                     # paper, table, row
    model: Model
    cluster: Cluster
    comp: Composition
    tflops_per_gpu: float           # X, as the paper counts it (narayanan_flops)
    assumed: tuple[str, ...] = field(default_factory=tuple)   # settings the source does not state
    published_step: float | None = None   # seconds per step, where the source reports the step itself

    @property
    def step_time(self) -> float:
        """The published step: the source's own figure, else F / (X · n)."""
        if self.published_step is not None:
            return self.published_step
        return narayanan_flops(self.model) / (self.tflops_per_gpu * 1e12 * self.cluster.devices)


def narayanan_flops(model: Model) -> float:
    """F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)): FLOPs of one step with full recomputation (Narayanan §5.1)."""
    B, s, L, h, V = model.global_batch, model.seq_len, model.layers, model.hidden, model.vocab
    return 96 * B * s * L * h ** 2 * (1 + s / (6 * h) + V / (16 * L * h))


def gpt(name: str, layers: int, hidden: int, heads: int, *, batch: int, micro_batch: int, source: str) -> Model:
    """A Megatron GPT of Narayanan §5.1: FFN 4h, biases, LayerNorm, learned positions, tied embeddings,
    dropout, vocabulary 51,200, sequence 2,048, fp16 weights and gradients with fp32 Adam (K = 12)."""
    return Model(name, layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=51200,
                 seq_len=2048, micro_batch=micro_batch, global_batch=batch, biases=True, learned_positions=True,
                 tied_embeddings=True, dropout=True, source=source)


def _row(i: int, params: str, layers: int, hidden: int, heads: int, tp: int, pp: int, gpus: int, batch: int,
         tflops: float, *, micro_batch: int, layers_per_virtual: int | None, ddp: str) -> PublishedRun:
    v = layers // (pp * layers_per_virtual) if layers_per_virtual else 1
    model = gpt(f"GPT {params}", layers, hidden, heads, batch=batch, micro_batch=micro_batch,
                source=f"{_T1}, row {i}")
    comp = Composition(dp=gpus // (tp * pp), tp=tp, pp=pp, recompute="full", sequence_parallel=False,
                       virtual_stages=v, scatter_gather=True, dp_overlap=(ddp == "torch"))
    return PublishedRun(f"Table 1 row {i}: {params}", f"{_T1}, row {i} ({params}); settings: {_SCRIPT}",
                        model, selene(gpus), comp, tflops)


# Table 1: (parameters, layers, h, heads, tp, pp, GPUs, batch, teraFLOP/s per GPU) and, from run_table_1.sh,
# (micro-batch, layers per virtual stage, DDP implementation)
NARAYANAN_TABLE_1 = [
    _row(1, "1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, micro_batch=16, layers_per_virtual=None, ddp="torch"),
    _row(2, "3.6B", 30, 3072, 32, 2, 1, 64, 512, 138, micro_batch=16, layers_per_virtual=None, ddp="torch"),
    _row(3, "7.5B", 36, 4096, 32, 4, 1, 128, 512, 142, micro_batch=16, layers_per_virtual=None, ddp="torch"),
    _row(4, "18.4B", 40, 6144, 48, 8, 1, 256, 1024, 135, micro_batch=8, layers_per_virtual=None, ddp="torch"),
    _row(5, "39.1B", 48, 8192, 64, 8, 2, 512, 1536, 138, micro_batch=4, layers_per_virtual=None, ddp="local"),
    _row(6, "76.1B", 60, 10240, 80, 8, 4, 1024, 1792, 140, micro_batch=2, layers_per_virtual=5, ddp="local"),
    _row(7, "145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 148, micro_batch=2, layers_per_virtual=5, ddp="local"),
    _row(8, "310.1B", 96, 16384, 128, 8, 16, 1920, 2160, 155, micro_batch=1, layers_per_virtual=3, ddp="local"),
    _row(9, "529.6B", 105, 20480, 128, 8, 35, 2520, 2520, 163, micro_batch=1, layers_per_virtual=1, ddp="local"),
    _row(10, "1008.0B", 128, 25600, 160, 8, 64, 3072, 3072, 163, micro_batch=1, layers_per_virtual=None,
         ddp="local"),
]

_PTD_ASSUMED = ("model shape and tp × pp split (see the module docstring)", "interleaving depth as the paper's "
                "other runs of this model", "local DDP (not overlapped)", "scatter/gather on")
_ZERO_ASSUMED = ("full recomputation", "DeepSpeed's ZeRO-3 defaults: overlap_comm (the reduce-scatter overlapped), "
                 "stage3_prefetch_bucket_size 5e7 elements fetched ahead of use")
# DeepSpeed, deepspeed/runtime/zero/config.py: prefetch_bucket_size (alias stage3_prefetch_bucket_size) = 5e7,
# "Maximum number of parameter elements to fetch ahead of use" — 3 % of one 175B layer (1.8B elements)
_DEEPSPEED_PREFETCH = 5e7


def _zero3(i: int, shape: tuple, params: str, gpus: int, batch: int, b: int, tflops: float) -> PublishedRun:
    layers, hidden, heads = shape
    model = gpt(f"GPT {params}", layers, hidden, heads, batch=batch, micro_batch=b, source=f"{_T2}, row {i}")
    comp = Composition(dp=gpus, zero=3, recompute="full", sequence_parallel=False, dp_overlap=True,
                       fsdp_prefetch=True, prefetch_limit=_DEEPSPEED_PREFETCH)
    return PublishedRun(f"Table 2 row {i}: ZeRO-3 {params} on {gpus}", f"{_T2}, row {i} (ZeRO-3, {params}, "
                        f"{gpus} GPUs)", model, selene(gpus), comp, tflops, _ZERO_ASSUMED)


def _ptd(i: int, shape: tuple, params: str, tp: int, pp: int, v: int, gpus: int, batch: int, tflops: float
         ) -> PublishedRun:
    layers, hidden, heads = shape
    model = gpt(f"GPT {params}", layers, hidden, heads, batch=batch, micro_batch=1, source=f"{_T2}, row {i}")
    comp = Composition(dp=gpus // (tp * pp), tp=tp, pp=pp, recompute="full", sequence_parallel=False,
                       virtual_stages=v, scatter_gather=True, dp_overlap=False)
    return PublishedRun(f"Table 2 row {i}: PTD-P {params} on {gpus}", f"{_T2}, row {i} (PTD-P, {params}, "
                        f"{gpus} GPUs)", model, selene(gpus), comp, tflops, _PTD_ASSUMED)


_175B, _530B = (96, 12288, 96), (105, 20480, 128)
NARAYANAN_TABLE_2 = [
    _zero3(1, _175B, "174.6B", 384, 1536, 4, 144),
    _zero3(2, _175B, "174.6B", 768, 1536, 2, 88),
    _zero3(3, _175B, "174.6B", 1536, 1536, 1, 44),
    _zero3(4, _530B, "529.6B", 640, 2560, 4, 138),       # batch 2560 (marked * in the table), not 2240
    _zero3(5, _530B, "529.6B", 1120, 2240, 2, 98),
    _zero3(6, _530B, "529.6B", 2240, 2240, 1, 48),
    _ptd(7, _175B, "174.6B", 8, 12, 4, 384, 1536, 153),
    _ptd(8, _175B, "174.6B", 8, 12, 4, 768, 1536, 149),
    _ptd(9, _175B, "174.6B", 8, 12, 4, 1536, 1536, 141),
    _ptd(10, _530B, "529.6B", 8, 35, 3, 560, 2240, 171),
    _ptd(11, _530B, "529.6B", 8, 35, 3, 1120, 2240, 167),
    _ptd(12, _530B, "529.6B", 8, 35, 3, 2240, 2240, 159),
]

PUBLISHED_RUNS = NARAYANAN_TABLE_1 + NARAYANAN_TABLE_2


# ----------------------------------------------------------------------------------------------
# Held out: runs the planner was never developed against, added after the model was written and kept out
# of PUBLISHED_RUNS (and of every choice above).  NVIDIA's DGX Cloud Benchmarking recipes
# (github.com/NVIDIA/dgxc-benchmarking, release v24.11.1; NeMo 24.09 container, BF16 tables; H100 SXM nodes,
# 8 × 400 Gb/s): each README's table gives the step time at each scale and the sizes (TP, PP, CP, VP, MBS,
# GBS).  The settings are each recipe's own, the YAML its launch script runs (--config-name) with the overrides
# of its configure.sh: nemo_megatron/gpt3_175b_hydra.yaml, llama3.1/llama3.1_{70b,405b}.yaml and
# nemotron/nemotron4-340b-synth.yaml.  All four run Megatron-Core through NeMo with TransformerEngine:
# sequence parallelism, TP communication overlapped with the GEMMs (ub_tp_comm_overlap, with the recipe's own
# ub_tp_comm_overlap_cfg, or TransformerEngine's defaults where it gives none), NeMo's distributed Adam
# (distributed_fused_adam) with gradient reduce-scatter and parameter all-gather overlapped, bf16 gradient
# buffers (grad_sync_dtype), weight gradients accumulated inside the GEMMs (gradient_accumulation_fusion), flash
# attention — cuDNN's fused kernel for Llama (NVTE_FUSED_ATTN=1), the flash-attn package's FlashAttention-2 for
# GPT-3 and Nemotron (NVTE_FUSED_ATTN=0: hardware.FA2_ON_H100).  No recomputation except Nemotron's selective
# (core attention) one.
_DGXC = "NVIDIA dgxc-benchmarking v24.11.1 (DGX Cloud Benchmarking, BF16)"

# the recipes' ub_tp_comm_overlap_cfg: {GEMM: method, SMs for communication, splits / aggregate}
_BULK, _RING, _PIPE = "bulk", "ring_exchange", "pipeline"
GPT3_175B_TP_OVERLAP = TPOverlap.of("gpt3_175b_hydra.yaml", {
    "qkv_dgrad": dict(method=_BULK, num_sm=4), "qkv_wgrad": dict(method=_BULK, num_sm=8),
    "fc1_dgrad": dict(method=_BULK, num_sm=2), "fc1_wgrad": dict(method=_BULK, num_sm=4),
    "qkv_fprop": dict(method=_RING), "proj_dgrad": dict(method=_RING), "fc1_fprop": dict(method=_RING),
    "fc2_dgrad": dict(method=_RING, aggregate=1), "proj_fprop": dict(method=_PIPE, num_sm=24, num_splits=4),
    "fc2_fprop": dict(method=_PIPE, num_sm=20, num_splits=4)}, "dgxc-benchmarking nemo_megatron/gpt3_175b_hydra.yaml")
LLAMA31_70B_TP_OVERLAP = TPOverlap.of("llama3.1_70b.yaml", {
    "fc1_dgrad": dict(method=_BULK, num_sm=2), "fc1_fprop": dict(method=_RING, num_sm=1),
    "fc1_wgrad": dict(method=_BULK, num_sm=4), "fc2_dgrad": dict(method=_RING, num_sm=1),
    "fc2_fprop": dict(method=_PIPE, num_sm=16, num_splits=4), "proj_dgrad": dict(method=_RING, num_sm=1),
    "proj_fprop": dict(method=_PIPE, num_sm=24, num_splits=4), "qkv_dgrad": dict(method=_BULK, num_sm=4),
    "qkv_fprop": dict(method=_RING, num_sm=1), "qkv_wgrad": dict(method=_BULK, num_sm=24)},
    "dgxc-benchmarking llama3.1/llama3.1_70b.yaml")
LLAMA31_405B_TP_OVERLAP = TPOverlap.of("llama3.1_405b.yaml", {
    "fc1_dgrad": dict(method=_BULK, num_sm=2), "fc1_fprop": dict(method=_RING, num_sm=1, aggregate=1),
    "fc1_wgrad": dict(method=_BULK, num_sm=2), "fc2_dgrad": dict(method=_RING, num_sm=1, aggregate=1),
    "fc2_fprop": dict(method=_PIPE, num_sm=8, num_splits=4), "proj_dgrad": dict(method=_RING, num_sm=1, aggregate=1),
    "proj_fprop": dict(method=_PIPE, num_sm=24, num_splits=4), "qkv_dgrad": dict(method=_BULK, num_sm=2),
    "qkv_fprop": dict(method=_RING, num_sm=1, aggregate=1), "qkv_wgrad": dict(method=_BULK, num_sm=24)},
    "dgxc-benchmarking llama3.1/llama3.1_405b.yaml")


def _dgxc(name: str, model: Model, gpus: int, tp: int, pp: int, cp: int, v: int, step: float, mfu: float,
          source: str, assumed: tuple[str, ...] = (), *, overlap: TPOverlap = TE_DEFAULTS_1, recompute: str = "none",
          attention_ceiling: float | None = None) -> PublishedRun:
    comp = Composition(dp=gpus // (tp * pp * cp), tp=tp, pp=pp, cp=cp, virtual_stages=v, flash=True,
                       recompute=recompute, sequence_parallel=True, distributed_optimizer=True, dp_overlap=True,
                       tp_overlap=overlap, grad_accumulation_fusion=True)
    tflops = mfu * PRESETS["h100-80gb-sxm"]["flops"] / 1e12      # the README's MFU, on its 989 TFLOP/s
    extra = {} if attention_ceiling is None else dict(attention_ceiling=attention_ceiling)
    return PublishedRun(f"{name} on {gpus}", f"{_DGXC}, {source}, {gpus} GPUs", model,
                        Cluster.preset("h100-80gb-sxm", gpus, **extra), comp, tflops, assumed, published_step=step)


def _gpt3_175b(gpus: int) -> Model:
    """nemo_megatron/gpt3_175b_hydra.yaml: GPT-3 (96 × 12,288, 96 heads, FFN 4h, LayerNorm, biases, learned
    positions, tied embeddings, dropout 0.1), sequence 2,048, GPT-2 BPE (50,257) padded to a multiple of
    128 · tp = 512: 50,688; global batch 16 per node."""
    return replace(gpt("GPT-3 175B", 96, 12288, 96, batch=2 * gpus, micro_batch=1, source=f"{_DGXC}, GPT-3 175B"),
                   vocab=50688)


def _llama31(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
             batch: int) -> Model:
    """Llama 3.1 as the recipe's YAML configures it: RMSNorm, SwiGLU, RoPE, no biases, untied embeddings, no
    dropout, ``kv_heads`` query groups (num_query_groups: 8 for 70B, 16 for 405B), sequence 8,192."""
    return Model(name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab,
                 seq_len=8192, micro_batch=1, global_batch=batch, gated_ffn=True, tied_embeddings=False,
                 dropout=False, biases=False, source=f"{_DGXC}, {name}")


def _nemotron4_340b(batch: int) -> Model:
    """nemotron4-340b-synth.yaml: 96 layers, hidden 18,432, FFN 4h with squared ReLU (two matrices), 96 heads, 8
    query groups, LayerNorm (layernorm1p), RoPE, no biases, untied embeddings, no dropout, vocabulary 256,000,
    sequence 4,096; global batch 2 per node (configure.sh).  Its optimizer (distributed_fused_adam, ``dtype:
    bf16``) keeps its state in bf16: Apex's DistributedFusedAdam holds a copy of the parameters (store_params,
    its default) and Adam's two moments in that dtype — 6 bytes per parameter, not 12."""
    return Model("Nemotron-4 340B", layers=96, hidden=18432, heads=96, kv_heads=8, ffn=4 * 18432, vocab=256000,
                 seq_len=4096, micro_batch=1, global_batch=batch, gated_ffn=False, tied_embeddings=False,
                 dropout=False, biases=False, optimizer_bytes=6, source=f"{_DGXC}, Nemotron-4 340B")


# (GPUs, step seconds, model FLOPs utilisation) from each README's BF16 table
HELD_OUT_RUNS = (
    [_dgxc("GPT-3 175B, tp 4 pp 8 v 12", _gpt3_175b(n), n, 4, 8, 1, 12, t, u,
           "nemo_megatron/README_175b.md (TP=4, PP=8, VP=12, MBS=1); settings: gpt3_175b_hydra.yaml",
           overlap=GPT3_175B_TP_OVERLAP, attention_ceiling=FA2_ON_H100)
     for n, t, u in ((128, 8.309, .5354), (256, 8.408, .5291), (512, 8.42, .5284), (1024, 8.453, .5263),
                     (2048, 8.49, .5240))]
    + [_dgxc("Llama 3.1 70B, tp 4 pp 4 cp 2 v 5",
             _llama31("Llama 3.1 70B", 80, 8192, 64, 8, 28672, 128256, 2 * n), n, 4, 4, 2, 5, t, u,
             "llama3.1/README_70b.md (TP=4, PP=4, CP=2, VP=5, MBS=1); settings: llama3.1/llama3.1_70b.yaml",
             overlap=LLAMA31_70B_TP_OVERLAP)
       for n, t, u in ((64, 14.72, .5410), (128, 14.73, .5406), (256, 14.8, .5381), (512, 14.89, .5348),
                       (1024, 14.92, .5338), (2048, 14.98, .5338))]
    + [_dgxc("Llama 3.1 405B, tp 8 pp 9 cp 2 v 7",
             _llama31("Llama 3.1 405B", 126, 16384, 128, 16, 53248, 51200, 252 * n // 576), n, 8, 9, 2, 7, t, u,
             "llama3.1/README_405b.md (TP=8, PP=9, CP=2, VP=7, MBS=1); settings: llama3.1/llama3.1_405b.yaml",
             ("the GPT-2 BPE vocabulary the recipe's YAML tokenizes with (a proxy for Llama 3.1's 128,256), padded "
              "to 51,200",), overlap=LLAMA31_405B_TP_OVERLAP)
       for n, t, u in ((576, 17.20, .5578), (1152, 17.52, .5476), (2304, 17.62, .5445))]
    + [_dgxc("Nemotron-4 340B, tp 8 pp 8 v 12", _nemotron4_340b(2 * n // 8), n, 8, 8, 1, 12, t, u,
             "nemotron/README_340b.md (NeMo 24.11 table; TP=8, PP=8, VP=12, MBS=1); settings: "
             "nemotron/nemotron4-340b-synth.yaml and configure.sh (ub_tp_comm_overlap=True with no "
             "ub_tp_comm_overlap_cfg: TransformerEngine's defaults)", recompute="selective",
             attention_ceiling=FA2_ON_H100)
       for n, t, u in ((128, 4.61, .5538), (256, 4.67, .5467), (512, 4.7, .5432), (1024, 4.73, .5398),
                       (2048, 4.84, .5275))]
)

# Korthikanti et al. 2022, Table 2: (technique, tp used?, sequence parallel, recompute, bytes per layer)
KORTHIKANTI_TABLE_2 = [
    ("no parallelism", False, False, "none", lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h)),
    ("tensor parallel (baseline)", True, False, "none",
     lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    ("tensor + sequence parallel", True, True, "none",
     lambda s, b, h, a, t: s * b * h * (34 / t + 5 * a * s / (h * t))),
    ("tensor parallel + selective activation recompute", True, False, "selective",
     lambda s, b, h, a, t: s * b * h * (10 + 24 / t)),
    ("tensor parallel + sequence parallel + selective activation recompute", True, True, "selective",
     lambda s, b, h, a, t: s * b * h * 34 / t),
    ("full activation recompute", True, False, "full", lambda s, b, h, a, t: s * b * h * 2),
]


def compare(runs=None, *, ceiling: float | None = None, tp_overlap: bool | None = None) -> list[dict]:
    """Each run planned with its published composition: {"run", "plan", "predicted", "published", "error"}
    (error = predicted / published step − 1; negative: the planner predicts a faster step).  ``ceiling``:
    another GEMM ceiling for every run's cluster (e.g. the preset's own, today's); ``tp_overlap``: every run's
    TP communication hidden (True) or exposed (False) instead of as published."""
    from .plan import plan
    out = []
    for run in (PUBLISHED_RUNS if runs is None else runs):
        cluster = run.cluster if ceiling is None else replace(run.cluster, gemm_ceiling=ceiling)
        if tp_overlap is not None:
            run = replace(run, comp=replace(run.comp, tp_overlap=tp_overlap))
        pl = plan(run.model, cluster, run.comp)
        out.append(dict(run=run, plan=pl, predicted=pl.step_time, published=run.step_time,
                        error=pl.step_time / run.step_time - 1))
    return out
