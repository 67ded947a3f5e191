"""The planner's inputs: a :class:`Model` to train, a :class:`Cluster` to train it on, a
:class:`Composition` of the axes — and the course's own tiny GPT and CPU worlds described the same way
(:func:`tiny_gpt`, :func:`cpu_cluster`).  The formulas are in :mod:`.counts`, the plan in :mod:`.plan`.

A Cluster built by hand with only peak FLOP/s and link bandwidths is timed the simple way (compute at a
fixed ``mfu``, 0.4 unless given).  A Cluster with the device's memory bandwidth and SM count — every
:meth:`Cluster.preset` (:mod:`.hardware`) — is timed from first principles (:mod:`.kernels`,
:mod:`.collectives`, :mod:`.timing`) unless ``mfu`` is given as an override."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Model", "Cluster", "Composition", "GB", "tiny_gpt", "cpu_cluster"]

GB = 1e9


@dataclass(frozen=True)
class Model:
    """A transformer to train.  ``num_experts`` > 1 makes every ``moe_every``-th layer a MoE layer."""
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    micro_batch: int = 1            # b: sequences per micro-batch
    global_batch: int = 1           # sequences per optimizer step
    num_experts: int = 1
    top_k: int = 1
    moe_every: int = 1
    capacity_factor: float = 1.0
    gated_ffn: bool = False         # SwiGLU: three matrices instead of two
    tied_embeddings: bool = False
    dropout: bool = True            # Korthikanti's 34/5 coefficients include dropout masks
    param_bytes: int = 2            # bf16/fp16 weights
    grad_bytes: int = 2
    optimizer_bytes: int = 12       # K: fp32 master weights + Adam m, v
    act_bytes: int = 2
    biases: bool = False            # GPT-2 layout: a bias in every Linear but the head, LayerNorm (weight
    #                                 and bias; keeps mean and 1/σ) instead of RMSNorm (weight; keeps 1/rms)
    learned_positions: bool = False  # a learned (seq_len, h) position table on the first stage
    final_norm: bool = True         # a norm before the head (last stage)
    loss_bytes: int = 4             # the loss's logits and per-token numbers: fp32 in mixed precision
    stats_bytes: int = 0            # bytes of the small per-token statistics kept for the backward (norms,
    #                                 flash log-sum-exp, router probabilities); 0: not counted (Korthikanti)
    sp_saves_gathered: bool = False  # with SP, column-parallel layers (qkv, fc1, head) keep their all-gathered
    #                                 input, s·b·h; False (Megatron-Core, reference.tensor): they keep the
    #                                 s·b·h/t shard and all-gather it again in the backward (more tp bytes)
    source: str = ""
    causal: bool = True             # causal attention: flash kernels skip the masked half of the scores

    @property
    def moe_layers(self) -> int:
        return self.layers // self.moe_every if self.num_experts > 1 else 0

    def is_moe(self, layer: int) -> bool:
        """Layer ``layer`` (0-based) is a MoE layer: every ``moe_every``-th, the last of each group."""
        return self.num_experts > 1 and layer % self.moe_every == self.moe_every - 1

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: LayerNorm weight and bias with ``biases``, else RMSNorm's weight."""
        return self.hidden * (2 if self.biases else 1)


@dataclass(frozen=True)
class Cluster:
    name: str
    devices: int
    memory: float                   # bytes per device
    flops: float                    # peak FLOP/s per device at the training precision
    intra_bw: float                 # bytes/s one device sends inside a node
    inter_bw: float                 # bytes/s one device sends to other nodes
    devices_per_node: int
    mfu: float | None = None        # achieved fraction of peak: an override.  None: from the device model
    #                                 (kernels, links) when the cluster has its figures, else 0.4
    source: str = ""
    # --- the device's figures for the first-principles time model (0: not given; see .hardware)
    hbm_bw: float = 0.0             # bytes/s of device memory (the roofline's slope)
    memory_efficiency: float = 1.0  # achieved / datasheet bandwidth of a streaming (memory-bound) kernel
    sms: int = 0                    # streaming multiprocessors: one GEMM tile each per wave
    gemm_ceiling: float = 0.0       # fraction of peak the best-shaped large GEMM reaches (a GEMM benchmark)
    attention_ceiling: float = 0.0  # fraction of peak a flash-attention kernel reaches
    intra_efficiency: float = 1.0   # achieved / link bandwidth of a large collective inside a node
    inter_efficiency: float = 1.0   # the same across nodes
    alpha_intra: float = 0.0        # seconds per message step inside a node (latency)
    alpha_inter: float = 0.0        # seconds per message step across nodes
    intra_busbw: tuple = ()         # ((bytes, bus bandwidth), ...): a measured all-reduce sweep inside a node;
    #                                 given, a collective inside a node moves at the sweep's bus bandwidth for
    #                                 its size (latency included) instead of α + bytes/β
    memory_margin: float = 0.0      # bytes per device kept free: CUDA context, NCCL buffers, fragmentation

    @property
    def first_principles(self) -> bool:
        """Time from the device model (kernels, links), not from a fixed MFU."""
        return self.mfu is None and self.hbm_bw > 0 and self.sms > 0

    @property
    def fixed_mfu(self) -> float:
        """The MFU the simple time model uses: ``mfu`` if given, else 0.4."""
        return 0.4 if self.mfu is None else self.mfu

    @classmethod
    def preset(cls, name: str, devices: int, **overrides) -> Cluster:
        """``devices`` GPUs of a known kind, every figure cited (:mod:`.hardware`): "a100-80gb-sxm",
        "h100-80gb-sxm".  ``overrides`` replace any field (e.g. ``inter_bw=`` for another network)."""
        from .hardware import preset_fields
        return cls(**preset_fields(name, devices, **overrides))


@dataclass(frozen=True)
class Composition:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0                   # ZeRO stage 0–3 (over dp·cp; experts over edp)
    recompute: str = "none"         # "none" | "selective" | "full"
    flash: bool = False             # flash attention: no s² scores stored (like selective)
    sequence_parallel: bool = True  # Megatron SP alongside tp
    micro_batches: int | None = None   # m; default global_batch / (dp · b)
    virtual_stages: int = 1         # interleaved 1F1B (v model chunks per device)
    # --- the time model's fields; the defaults keep the plans above unchanged
    micro_batch: int | None = None  # b for this composition; None: the model's micro_batch
    schedule: str = "1f1b"          # "gpipe" | "1f1b" | "zb_h1"; virtual_stages > 1 is interleaved 1F1B
    stage_layout: tuple[int, ...] | None = None   # layers per virtual stage in model order (pp·v entries);
    #                                 a 0 first/last entry is a chunk holding only the embedding / the loss
    scatter_gather: bool = False    # pipeline activations sent as 1/t slices, all-gathered after (Narayanan §4.1)
    dp_overlap: bool = True         # gradient buckets reduced during the backward (torch DDP); False: after it
    #                                 (Megatron's local DDP, Narayanan Table 1 runs with pp > 1)
    fsdp_prefetch: bool = True      # ZeRO-3: gather the next layer's parameters during this layer's compute
    prefetch_limit: float | None = None  # ZeRO-3: at most this many parameter elements gathered ahead of use
    #                                 (DeepSpeed's stage3_prefetch_bucket_size, 5e7 by default); None: the whole
    #                                 next layer (FSDP's one-layer prefetch)
    tp_overlap: bool = False        # tp collectives hidden behind GEMMs (TransformerEngine); default exposed
    cp_algorithm: str = "ring"      # "ring" (K/V passed, overlapped) | "allgather" (K/V gathered, exposed) |
    #                                 "ulysses" (all-to-all of heads, exposed)
    distributed_optimizer: bool = False   # optimizer state sharded over dp·cp (Megatron's; ZeRO-1 memory)

    def __str__(self) -> str:
        axes = " ".join(f"{k}{v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp),
                                                 ("cp", self.cp), ("ep", self.ep)) if v > 1) or "single device"
        extra = [f"ZeRO-{self.zero}"] if self.zero else []
        extra += [f"{self.recompute} recompute"] if self.recompute != "none" else []
        extra += ["flash"] if self.flash else []
        extra += [f"v{self.virtual_stages}"] if self.virtual_stages > 1 else []
        extra += [f"b{self.micro_batch}"] if self.micro_batch else []
        extra += [self.schedule] if self.schedule != "1f1b" else []
        extra += ["distributed optimizer"] if self.distributed_optimizer else []
        extra += [f"cp {self.cp_algorithm}"] if self.cp > 1 and self.cp_algorithm != "ring" else []
        return axes + (" (" + ", ".join(extra) + ")" if extra else "")


# ---------------------------------------------------------------------------------- the course's tiny GPT

def tiny_gpt(cfg, *, batch_size: int, micro_batch: int | None = None, name: str = "tiny GPT") -> Model:
    """The planner's :class:`Model` of ``reference.gpt.TinyGPT(cfg)`` trained in float64 with Adam on
    batches of ``batch_size`` sequences (``micro_batch`` sequences per micro-batch and rank).

    GPT-2 layout (biases, LayerNorm, learned positions, final LayerNorm, untied head without bias),
    GELU MLP, no dropout, dropless top-k MoE (capacity factor 1: k·T rows at perfect balance);
    float64 parameters, gradients, activations and loss (8 bytes), Adam's exp_avg and exp_avg_sq
    (16 bytes per parameter, no master copy), statistics counted at 8 bytes.  Its attention is
    ``reference.sequence.ring_attention``: flash-like (q, k, v, the output and the log-sum-exp are
    kept, no scores): plan it with ``Composition(flash=True)``.  With sequence parallelism its
    column-parallel layers keep their S/t rows and gather them again in the backward, as Megatron's
    (``sp_saves_gathered`` False: reference.tensor.LinearWithSequenceParallelGather).
    """
    return Model(name, layers=cfg.layers, hidden=cfg.d_model, heads=cfg.heads, kv_heads=cfg.heads, ffn=cfg.d_ff,
                 vocab=cfg.vocab, seq_len=cfg.seq_len, micro_batch=micro_batch or batch_size,
                 global_batch=batch_size, num_experts=cfg.num_experts if cfg.num_experts > 1 else 1,
                 top_k=cfg.top_k if cfg.num_experts > 1 else 1, moe_every=cfg.moe_every, capacity_factor=1.0,
                 dropout=False, param_bytes=8, grad_bytes=8, optimizer_bytes=16, act_bytes=8, biases=True,
                 learned_positions=True, final_norm=True, loss_bytes=8, stats_bytes=8, sp_saves_gathered=False,
                 source="reference/gpt.py (float64)")


def cpu_cluster(devices: int) -> Cluster:
    """One machine of ``devices`` gloo ranks on CPU (for planning the tiny GPT's runs; the time
    figures are nominal: 10 GFLOP/s and 1 GB/s per rank)."""
    return Cluster(f"{devices} CPU ranks (gloo)", devices=devices, memory=8 * GB, flops=1e10, intra_bw=1e9,
                   inter_bw=1e9, devices_per_node=devices, mfu=1.0, source="nominal")
