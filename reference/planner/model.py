"""The planner's inputs: a :class:`Model` to train, a :class:`Cluster` to train it on, a
:class:`Composition` of the axes — and the course's own tiny GPT and CPU worlds described the same way
(:func:`tiny_gpt`, :func:`cpu_cluster`).  The formulas are in :mod:`.counts`, the plan in :mod:`.plan`.

Sparse models are described as Megatron-Core and DeepSeek describe them: routed experts of their own FFN
size (``expert_ffn``), shared experts every token passes through, the first ``dense_layers`` layers dense,
multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, §2.1), dropless routing (``capacity_factor``
None) or token dropping with buffers padded to capacity, the busiest expert's load over the mean
(``load_imbalance``) and node-limited routing (``max_nodes``).  The expert grid (``Composition.etp``,
``ep``) is folded over each pipeline stage's tp·cp·dp ranks (:mod:`.placement`).

A Cluster built by hand with only peak FLOP/s and link bandwidths is timed the simple way (compute at a
fixed ``mfu``, 0.4 unless given).  A Cluster with the device's memory bandwidth and SM count — every
:meth:`Cluster.preset` (:mod:`.hardware`) — is timed from first principles (:mod:`.kernels`,
:mod:`.collectives`, :mod:`.timing`) unless ``mfu`` is given as an override."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

__all__ = ["Model", "Cluster", "Composition", "GB", "LOAD_IMBALANCE", "tiny_gpt", "cpu_cluster"]

GB = 1e9

# The busiest expert's tokens over the mean, as routers balanced the way today's frontier runs balance them
# measure it: Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"
# (arXiv:2408.15664, the balancing DeepSeek-V3 uses), Table 2: MaxVio_global = max_i load_i / mean load − 1
# = 0.04 for loss-free balancing at both 1B and 3B parameters (an auxiliary-loss-controlled router measured
# more there; pass load_imbalance for such a router, 1.0 for forced balance)
LOAD_IMBALANCE = 1.04


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
    capacity_factor: float | None = 1.0   # token dropping, buffers padded to capacity; None: dropless
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
    # --- sparse models and attention variants; the defaults keep every dense and GShard-style plan unchanged
    expert_ffn: int | None = None   # each routed expert's FFN size; None: ffn
    shared_experts: int = 0         # experts every token passes through (DeepSeekMoE), cut over tp like the MLP
    shared_expert_ffn: int | None = None   # each shared expert's FFN size; None: expert_ffn
    dense_layers: int = 0           # the first k layers keep a dense FFN (DeepSeek-V3: 3)
    head_dim: int | None = None     # per-head size of Q and K (and V without MLA); None: hidden/heads.  With MLA:
    #                                 the non-rotary part of Q and K (DeepSeek's qk_nope_head_dim)
    q_lora_rank: int = 0            # multi-head latent attention (DeepSeek-V2 §2.1): Q's compressed size (0: none)
    kv_lora_rank: int = 0           # K and V's compressed size (0: no MLA)
    qk_rope_head_dim: int = 0       # the decoupled rotary part of each Q and K head
    v_head_dim: int = 0             # each V head's size under MLA
    router: str = "softmax"         # "softmax" | "sigmoid" (DeepSeek-V3) scores over the experts
    load_imbalance: float = LOAD_IMBALANCE   # the busiest expert's tokens over the mean; 1.0: forced balance
    max_nodes: int = 0              # node-limited routing: each token to experts on at most M nodes (0: any)

    def __post_init__(self):
        mla = (self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim)
        if any(x < 0 for x in mla) or (any(mla) and not (self.kv_lora_rank and self.head_dim and self.v_head_dim)):
            raise ValueError(f"{self.name}: multi-head latent attention needs kv_lora_rank, head_dim (the non-rotary "
                             f"per-head size of Q and K) and v_head_dim, all positive; got q_lora_rank="
                             f"{self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim="
                             f"{self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, head_dim={self.head_dim}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"{self.name}: hidden={self.hidden} does not divide into heads={self.heads}; "
                             "give head_dim")
        if not self.load_imbalance >= 1:
            raise ValueError(f"{self.name}: load_imbalance={self.load_imbalance} is below 1 (it is the busiest "
                             "expert's tokens over the mean; 1.0 is forced balance)")
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"{self.name}: router={self.router!r}: choose 'softmax' or 'sigmoid'")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"{self.name}: capacity_factor={self.capacity_factor} must be positive "
                             "(None: dropless)")
        if self.max_nodes < 0 or self.shared_experts < 0 or not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"{self.name}: max_nodes={self.max_nodes} and shared_experts={self.shared_experts} "
                             f"must be at least 0, dense_layers={self.dense_layers} between 0 and layers="
                             f"{self.layers}")
        if self.num_experts > 1 and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"{self.name}: top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")

    @cached_property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.layers)) if self.num_experts > 1 else 0

    def is_moe(self, layer: int) -> bool:
        """Layer ``layer`` (0-based) is a MoE layer: past the first ``dense_layers``, every ``moe_every``-th,
        the last of each group."""
        return (self.num_experts > 1 and layer >= self.dense_layers
                and layer % self.moe_every == self.moe_every - 1)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2 §2.1)."""
        return self.kv_lora_rank > 0

    @property
    def d_head(self) -> int:
        """Per-head size of Q and K (their non-rotary part under MLA)."""
        return self.head_dim or self.hidden // self.heads

    @property
    def d_qk(self) -> int:
        """Per-head size of the query–key dot product: d_head, plus the rotary part under MLA."""
        return self.d_head + (self.qk_rope_head_dim if self.mla else 0)

    @property
    def d_v(self) -> int:
        """Per-head size of V (and of the attention output)."""
        return self.v_head_dim if self.mla else self.d_head

    @property
    def d_expert(self) -> int:
        """Each routed expert's FFN size."""
        return self.expert_ffn or self.ffn

    @property
    def d_shared(self) -> int:
        """Each shared expert's FFN size."""
        return self.shared_expert_ffn or self.d_expert

    @property
    def capacity(self) -> float:
        """Rows each expert computes per routed row at the mean: the capacity factor (buffers padded to it), or 1
        dropless (the mean; the busiest expert's excess is :attr:`load_imbalance`)."""
        return 1.0 if self.capacity_factor is None else self.capacity_factor

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
    fp8_flops: float = 0.0          # peak FP8 FLOP/s per device (dense); 0: the device has no FP8 tensor cores
    fp8_gemm_ceiling: float = 0.0   # fraction of the FP8 peak the best-shaped large FP8 GEMM reaches; 0: gemm_ceiling
    gemm_sweep: tuple = ()          # ((FLOPs of one GEMM, FLOP/s it reached), ...): a measured sweep; given, a GEMM
    #                                 runs at the sweep's rate for its size instead of the tile and wave model
    cores: int = 0                  # host cores the devices of a node share (a CPU world); 0: each device its own

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
        "h100-80gb-sxm", "h800-80gb-sxm".  ``overrides`` replace any field (e.g. ``inter_bw=`` for another
        network)."""
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
    tp_overlap: bool | object = False   # tp collectives overlapped with the GEMMs (TransformerEngine userbuffers):
    #                                 True for TE's own defaults, or a .overlap.TPOverlap of a run's configuration
    #                                 (SMs given to the communication kernels, splits); False: exposed
    cp_algorithm: str = "ring"      # "ring" (K/V passed, overlapped) | "allgather" (K/V gathered, exposed) |
    #                                 "ulysses" (all-to-all of heads, exposed)
    distributed_optimizer: bool = False   # optimizer state sharded over dp·cp (Megatron's; ZeRO-1 memory)
    # --- sparse models, FP8 and what Megatron-Core fuses; the defaults keep the plans above unchanged
    etp: int | None = None          # expert-tensor size: each expert cut over etp ranks; None: tp.  The expert
    #                                 grid etp × ep × edp is folded over each stage's tp·cp·dp ranks (.placement)
    moe_overlap: bool = False       # the dispatch/combine all-to-all hidden behind the other micro-batch's
    #                                 compute (Megatron-Core --overlap-moe-expert-parallel-comm)
    fp8: bool = False               # GEMMs in FP8 (TransformerEngine), at the device's FP8 peak
    grad_accumulation_fusion: bool = False   # weight gradients accumulated inside the wgrad GEMM (Megatron-Core,
    #                                 NeMo's gradient_accumulation_fusion) instead of a separate .grad += pass

    @property
    def expert_tp(self) -> int:
        """The expert-tensor size: ``etp``, or ``tp`` when not given."""
        return self.tp if self.etp is None else self.etp

    def __str__(self) -> str:
        axes = " ".join(f"{k}{v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp),
                                                 ("cp", self.cp), ("ep", self.ep)) if v > 1) or "single device"
        if self.ep > 1 and self.expert_tp != self.tp:
            axes += f" etp{self.expert_tp}"
        extra = [f"ZeRO-{self.zero}"] if self.zero else []
        extra += [f"{self.recompute} recompute"] if self.recompute != "none" else []
        extra += ["flash"] if self.flash else []
        extra += [f"v{self.virtual_stages}"] if self.virtual_stages > 1 else []
        extra += [f"b{self.micro_batch}"] if self.micro_batch else []
        extra += [self.schedule] if self.schedule != "1f1b" else []
        extra += ["distributed optimizer"] if self.distributed_optimizer else []
        extra += [f"cp {self.cp_algorithm}"] if self.cp > 1 and self.cp_algorithm != "ring" else []
        extra += ["a2a overlapped"] if self.moe_overlap and self.ep > 1 else []
        extra += ["FP8"] if self.fp8 else []
        return axes + (" (" + ", ".join(extra) + ")" if extra else "")


# ---------------------------------------------------------------------------------- the course's tiny GPT

def tiny_gpt(cfg, *, batch_size: int, micro_batch: int | None = None, name: str = "tiny GPT") -> Model:
    """The planner's :class:`Model` of ``reference.gpt.TinyGPT(cfg)`` trained in float64 with Adam on
    batches of ``batch_size`` sequences (``micro_batch`` sequences per micro-batch and rank).

    GPT-2 layout (biases, LayerNorm, learned positions, final LayerNorm, untied head without bias),
    GELU MLP, no dropout, dropless top-k MoE described at the mean rank (load_imbalance 1: k·T rows);
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
                 top_k=cfg.top_k if cfg.num_experts > 1 else 1, moe_every=cfg.moe_every, capacity_factor=None,
                 load_imbalance=1.0,
                 dropout=False, param_bytes=8, grad_bytes=8, optimizer_bytes=16, act_bytes=8, biases=True,
                 learned_positions=True, final_norm=True, loss_bytes=8, stats_bytes=8, sp_saves_gathered=False,
                 source="reference/gpt.py (float64)")


def cpu_cluster(devices: int) -> Cluster:
    """One machine of ``devices`` gloo ranks on CPU (for planning the tiny GPT's runs; the time
    figures are nominal: 10 GFLOP/s and 1 GB/s per rank)."""
    return Cluster(f"{devices} CPU ranks (gloo)", devices=devices, memory=8 * GB, flops=1e10, intra_bw=1e9,
                   inter_bw=1e9, devices_per_node=devices, mfu=1.0, source="nominal")
