"""Lecture 5c — the parallelism planner: where does a model run out of room, and what composition fixes it?

Pure arithmetic on three dataclasses: a :class:`Model`, a :class:`Cluster` and a
:class:`Composition` (dp × tp × pp × cp, ep for the experts, ZeRO stage, recomputation,
micro-batches).  :func:`plan` gives a :class:`Plan`: memory per device, bytes per step per axis
and their time on the links the rank grid puts them on, the pipeline bubble, the compute time, an
estimated step time and the resource that runs out first.  :func:`search` tries every composition
that fits and ranks them by estimated step time.  Symbols (Korthikanti et al. arXiv:2205.05198):

    s sequence length   b micro-batch (sequences)   h hidden   a heads   L layers   V vocabulary
    t tp   p pp   c cp   d dp   e ep   m micro-batches per step   Ψ parameters (of one device)

Memory per device (bytes)
    model states (ZeRO arXiv:1910.02054, mixed-precision Adam: 2 + 2 + K bytes, K = 12):
        stage 0  (2 + 2 + K)·Ψ      stage 1  (2 + 2)·Ψ + K·Ψ/N      stage 2  2·Ψ + (2 + K)·Ψ/N
        stage 3  (2 + 2 + K)·Ψ/N    N = dp·cp for dense parameters, edp for experts
      Ψ counts what the device holds: its layers' matrices (and the biases of column-parallel
      layers) ÷ t, the norms, the biases after row-parallel layers and the router whole (every
      tensor rank holds a copy), its stage's embedding and head rows (the vocabulary padded to a
      multiple of t, as Megatron does) and position table / final norm; experts ÷ (e·t).
    activations per layer (Korthikanti §4, fp16, with dropout):
        s·b·h·34 + 5·a·s²·b                       no parallelism
        s·b·h·(10 + 24/t) + 5·a·s²·b/t            tensor parallel
        (s·b·h·34 + 5·a·s²·b)/t                   tensor + sequence parallel
        s·b·h·34/t                                + selective recomputation (or flash attention)
        2·s·b·h/t                                 full recomputation (layer inputs only)
      with context parallelism every s·b·h term uses s/c and the score term a·(s/c)·s·b; 1F1B
      keeps min(m, p − stage) micro-batches of the stage's layers alive (the first stage: min(m, p)).
      MoE layers: the experts' FFN internals for k·cf·s·b tokens, and the dispatched tokens (the
      experts' input) and the experts' output (for the gate's gradient), k·cf·s·b·h each.
      ``Model.stats_bytes`` > 0 also counts what Korthikanti leaves out: the norms' per-token
      statistics (LayerNorm mean and 1/σ, RMSNorm 1/rms), flash attention's log-sum-exp (a per
      token) and the router's probabilities and gate weights (E + k per token).
    output layer ("logits", last stage; Korthikanti §4.3): the final norm's and the head's inputs
      (s·b·h each, ÷ t with SP) and the loss's logits, loss_bytes·s·b·V/t (fp32); the first stage
      adds the embedding's dropout mask (s·b·h, ÷ t with SP).
Communication per device per step (ring algorithms; what one device sends)
    dp    gradient all-reduce 2(N−1)/N · Ψ · bytes (ZeRO-1/2 the same: reduce-scatter + all-gather;
          ZeRO-3 1.5×: parameters gathered again for the backward)
    tp    per micro-batch, each an all-reduce (or all-gather + reduce-scatter with SP, the same
          bytes) of 2(t−1)/t · s·b·h/c · bytes: 4 per dense layer (6 with full recomputation),
          2 + 2·k·cf per MoE layer (each expert is cut over tp like the MLP: f and g on its
          k·cf·s·b rows at perfect balance), 1 for the vocabulary-parallel embedding (first
          stage), 1 for the head and 3 all-reduces of one number per token for the vocabulary-
          parallel cross-entropy (last stage, loss_bytes each); with SP, once per step, the
          all-reduce of the replicated parameters' gradients (each tp rank saw s/t rows)
    pp    one activation forward and one gradient back per micro-batch per stage boundary
    cp    ring attention: K and V blocks pass c−1 times forward, K,V and dK,dV c−1 times backward
    ep    4 all-to-alls per MoE layer per micro-batch (dispatch, combine, and their backward),
          each sending (e−1)/e of k·tokens·h (perfect balance); ``Plan.ep_payload`` is what the
          dispatch and the combine's backward are handed, k·cf·tokens·h each, routing-independent
Time: compute = FLOPs / (devices · peak · MFU), FLOPs = (6·N_active + 6·L·s·h)·tokens (Kaplan et al.
arXiv:2001.08361; 8 instead of 6 with full recomputation: one more forward), stretched by the bubble (p−1)/(v·m + p−1);
tp, pp and ep traffic is in the critical path; dp traffic overlaps the backward (2/3 of the
compute) and cp traffic the attention compute (6·L·s·h per token): only what exceeds them is exposed.  A group's link is the intra-node one if the rank grid
(reference.mesh) keeps every group of that axis inside a node, else the inter-node one.

Which device.  ``plan(..., stage=k)`` describes the ranks of pipeline stage k (layers split as
``reference.pipeline.balanced_sizes``: contiguous, larger stages first; layer i is a MoE layer when
i % moe_every = moe_every − 1).  The default, ``stage=None``, takes every entry from the stage
where it is largest (states from the stage with the most parameters, activations from the first,
the output layer from the last, bytes per axis from the busiest stage): an upper bound for every
device.

Bytes are what one device SENDS with the ring algorithms above; ``reference.trace`` records the
payload a rank hands to each collective (an all-reduce of n bytes is one event of n bytes), so a
comparison with a measured run converts with the same 2(N−1)/N factors.

Validated on the tiny GPT (``tests/test_planner_measured.py``, :func:`tiny_gpt`, real gloo runs):
bytes per axis per step exactly, parameters, gradients and optimizer state exactly, activations
within a few per cent (``reference.compose.memory`` says what is not counted).

Not counted: temporary buffers, communication buckets, allocator fragmentation, the CUDA context,
integer and boolean tensors saved for the backward (ids, routing indices, masks other than
dropout's), latency of small messages, imbalance between experts.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from .mesh import RankGrid

__all__ = ["Model", "Cluster", "Composition", "Plan", "param_counts", "device_params", "stage_layers",
           "model_state_bytes", "activation_bytes_per_layer", "output_layer_bytes", "allreduce_bytes", "bubble_fraction", "plan",
           "search", "with_sizes", "tiny_gpt", "cpu_cluster", "GB"]

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
    #                                 input, s·b·h (Megatron keeps the s·b·h/t shard and gathers it again)
    source: str = ""

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
    mfu: float = 0.4                # achieved fraction of peak
    source: str = ""


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

    def __str__(self) -> str:
        axes = " ".join(f"{k}{v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp),
                                                 ("cp", self.cp), ("ep", self.ep)) if v > 1) or "single device"
        extra = [f"ZeRO-{self.zero}"] if self.zero else []
        extra += [f"{self.recompute} recompute"] if self.recompute != "none" else []
        extra += ["flash"] if self.flash else []
        return axes + (" (" + ", ".join(extra) + ")" if extra else "")


# ---------------------------------------------------------------------------------- parameters

def param_counts(model: Model) -> dict[str, float]:
    """Parameters by kind (whole model): attention, dense FFN, experts, router, norms, embeddings."""
    h, hd, f = model.hidden, model.hidden // model.heads, model.ffn
    q_kv = (model.heads + 2 * model.kv_heads) * hd                       # Q, K, V outputs (GQA)
    attn = h * q_kv + model.heads * hd * h + (q_kv + h if model.biases else 0)
    mats = 3 if model.gated_ffn else 2
    mlp = mats * h * f + ((mats - 1) * f + h if model.biases else 0)
    moe, dense = model.moe_layers, model.layers - model.moe_layers
    return dict(
        attention=model.layers * attn,
        ffn=dense * mlp,
        experts=moe * model.num_experts * mlp,
        router=moe * h * model.num_experts,
        norms=(model.layers * 2 + (1 if model.final_norm else 0)) * model.norm_params,
        embeddings=model.vocab * h * (1 if model.tied_embeddings else 2)
        + (model.seq_len * h if model.learned_positions else 0),
    )


def active_params(model: Model) -> float:
    """Parameters one token passes through: experts count k of E."""
    c = param_counts(model)
    experts = c["experts"] * model.top_k / model.num_experts if model.num_experts > 1 else 0
    return sum(c.values()) - c["experts"] + experts


def padded_vocab(model: Model, tp: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp`` (Megatron pads it so it splits evenly)."""
    return -(-model.vocab // tp) * tp


def stage_layers(model: Model, pp: int, stage: int) -> tuple[int, int]:
    """(layers, MoE layers) of pipeline stage ``stage``: contiguous, as equal as possible, larger first
    (``reference.pipeline.balanced_sizes``)."""
    q, extra = divmod(model.layers, pp)
    start = stage * q + min(stage, extra)
    n = q + (1 if stage < extra else 0)
    return n, sum(model.is_moe(i) for i in range(start, start + n)) if model.num_experts > 1 else 0


def _stage_params(model: Model, t: int, e: int, n_layers: int, n_moe: int, first: bool, last: bool
                  ) -> tuple[float, float, float]:
    """(dense, expert, replicated-over-tp) parameters of one device of a stage."""
    h, hd, f = model.hidden, model.hidden // model.heads, model.ffn
    q_kv = (model.heads + 2 * model.kv_heads) * hd
    mats = 3 if model.gated_ffn else 2
    attn_split = (h * q_kv + model.heads * hd * h + (q_kv if model.biases else 0)) / t
    mlp_split = (mats * h * f + ((mats - 1) * f if model.biases else 0)) / t
    out_bias = h if model.biases else 0                       # after a row-parallel layer: replicated
    replicated = n_layers * (2 * model.norm_params + out_bias) + (n_layers - n_moe) * out_bias \
        + n_moe * h * model.num_experts                       # norms, proj/fc2 biases, router
    vocab_rows = padded_vocab(model, t) // t * h
    embed = vocab_rows * (first + last) if (first != last or not model.tied_embeddings) else vocab_rows
    if first and model.learned_positions:
        replicated += model.seq_len * h
    if last and model.final_norm:
        replicated += model.norm_params
    dense = n_layers * attn_split + (n_layers - n_moe) * mlp_split + embed + replicated
    experts = n_moe * model.num_experts // e * (mlp_split + out_bias) if n_moe else 0.0
    return dense, experts, replicated


def device_params(model: Model, comp: Composition, stage: int | None = None) -> tuple[float, float]:
    """(dense, expert) parameters held by one device of pipeline stage ``stage`` (None: of the stage
    holding the most)."""
    p = comp.pp
    best = None
    for k in (range(p) if stage is None else (stage,)):
        n, moe = stage_layers(model, p, k)
        dense, experts, _ = _stage_params(model, comp.tp, comp.ep, n, moe, k == 0, k == p - 1)
        if best is None or dense + experts > sum(best):
            best = (dense, experts)
    return best


def model_state_bytes(psi: float, zero: int, n: int, *, param_bytes: int = 2, grad_bytes: int = 2,
                      optimizer_bytes: int = 12) -> dict[str, float]:
    """Parameters, gradients and optimizer state of ``psi`` parameters with ZeRO ``zero`` over ``n`` ranks."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero}")
    return dict(params=psi * param_bytes / (n if zero >= 3 else 1),
                grads=psi * grad_bytes / (n if zero >= 2 else 1),
                optimizer=psi * optimizer_bytes / (n if zero >= 1 else 1))


# ---------------------------------------------------------------------------------- activations

def activation_bytes_per_layer(model: Model, *, tp: int = 1, cp: int = 1, sequence_parallel: bool = True,
                               recompute: str = "none", flash: bool = False, moe: bool = False) -> float:
    """Bytes of activations one transformer layer keeps for the backward, one micro-batch, per device.

    The accounting of Korthikanti et al. §4, written per stored tensor so that it also covers GQA,
    a gated or non-4h FFN, MoE (k experts' FFN activations per token, × capacity factor, and the
    experts' input and output), no dropout, and context parallelism.  With MHA, FFN 4h, GELU and
    dropout it is exactly ``s·b·h·34 + 5·a·s²·b`` (tested).  ``model.stats_bytes`` > 0 adds the
    per-token statistics Korthikanti leaves out (norms, flash log-sum-exp, router probabilities).
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    s, b, h, a = model.seq_len / cp, model.micro_batch, model.hidden, model.heads
    kv = model.kv_heads * (h // a)
    e, mask = model.act_bytes, (1 if model.dropout else 0)
    sbh = s * b * h
    sp = tp if sequence_parallel else 1
    if recompute == "full":
        return e * sbh / sp
    # replicated across tensor ranks unless sequence parallel: LayerNorm inputs, QKV and FC1 inputs, dropout masks
    replicated = e * 2 * sbh + e * sbh + e * sbh + mask * 2 * sbh
    gathered = 0.0
    if sp > 1 and model.sp_saves_gathered:      # QKV and FC1 inputs kept all-gathered
        replicated, gathered = replicated - 2 * e * sbh, 2 * e * sbh
    # split across tensor ranks: Q, K (for QKᵀ), V, the attention output (proj input), the FFN internals
    ffn_tokens = model.top_k * model.capacity_factor if moe else 1
    ffn_inner = (3 if model.gated_ffn else 2) * e * s * b * model.ffn * ffn_tokens
    split = e * (sbh + s * b * kv) + e * s * b * kv + e * sbh + ffn_inner
    if moe:     # the dispatched tokens (the experts' input) and the experts' output (the gate's gradient)
        replicated += 2 * e * ffn_tokens * sbh
    scores = 0.0
    if recompute == "none" and not flash:       # softmax output, dropout mask, dropout output
        scores = (e + mask + (e if model.dropout else 0)) * a * s * model.seq_len * b
    stats = 0.0
    if model.stats_bytes:       # norms' mean and 1/σ (1/rms), flash's log-sum-exp per head, router probabilities
        per_token = 2 * (2 if model.biases else 1) / sp + (a / tp if flash else 0) \
            + ((model.num_experts + model.top_k) / sp if moe else 0)
        stats = model.stats_bytes * s * b * per_token
    return (replicated / sp) + gathered + (split + scores) / tp + stats


def output_layer_bytes(model: Model, *, tp: int = 1, cp: int = 1, sequence_parallel: bool = True) -> float:
    """Activations of the output layer, one micro-batch (Korthikanti §4.3): the final norm's input,
    the head's input and the loss's logits (``loss_bytes``, over this rank's padded vocabulary)."""
    s, b, h = model.seq_len / cp, model.micro_batch, model.hidden
    sp = tp if sequence_parallel else 1
    head_input = model.act_bytes * s * b * h / (1 if model.sp_saves_gathered else sp)
    inputs = (model.act_bytes * s * b * h / sp if model.final_norm else 0.0) + head_input
    stats = model.stats_bytes * s * b * (2 if model.biases else 1) / sp if model.final_norm else 0.0
    return inputs + stats + model.loss_bytes * s * b * padded_vocab(model, tp) / tp


# ---------------------------------------------------------------------------------- communication

def allreduce_bytes(nbytes: float, n: int) -> float:
    """What each of ``n`` ranks sends in a ring all-reduce of ``nbytes``: 2(n−1)/n · nbytes."""
    return 2 * (n - 1) / n * nbytes


def all_to_all_bytes(nbytes: float, n: int) -> float:
    """What each rank sends in an all-to-all of its ``nbytes`` split evenly over ``n`` ranks."""
    return (n - 1) / n * nbytes


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a 1F1B (or GPipe) pipeline: (p−1)/(v·m + p−1); 0 without a pipeline."""
    return (p - 1) / (v * m + p - 1)


# ---------------------------------------------------------------------------------- the plan

@dataclass
class Plan:
    model: Model
    cluster: Cluster
    comp: Composition
    micro_batches: int
    memory: dict[str, float]            # params, grads, optimizer, activations, (recompute, logits)
    comm_bytes: dict[str, float]        # per device per step, by axis
    comm_time: dict[str, float]
    link: dict[str, str]                # "intra" | "inter"
    bubble: float
    compute_time: float                 # without the bubble
    step_time: float
    bottleneck: str
    reasons: list[str] = field(default_factory=list)
    stage: int | None = None            # the pipeline stage described (None: the busiest of each entry)
    ep_payload: float = 0.0             # bytes handed to the dispatch + combine-backward all-to-alls per step

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.total_memory <= self.cluster.memory

    def summary(self) -> str:
        mem = ", ".join(f"{k} {v / GB:.1f}" for k, v in self.memory.items())
        com = ", ".join(f"{k} {self.comm_bytes[k] / GB:.2f} GB/{self.comm_time[k]:.2f}s {self.link[k]}"
                        for k in self.comm_bytes)
        return (f"{self.comp}: {self.total_memory / GB:.1f} of {self.cluster.memory / GB:.0f} GB "
                f"({mem}); step ≈ {self.step_time:.2f} s (compute {self.compute_time:.2f} s, bubble "
                f"{self.bubble:.0%}; {com or 'no communication'}); runs out first: {self.bottleneck}")


def check_composition(model: Model, cluster: Cluster, comp: Composition) -> None:
    """ValueError naming the sizes when the composition cannot be built for this model and cluster."""
    if model.hidden % model.heads or model.heads % model.kv_heads:
        raise ValueError(f"hidden={model.hidden} must divide into heads={model.heads}, and heads into "
                         f"kv_heads={model.kv_heads} groups")
    if comp.recompute not in ("none", "selective", "full") or comp.zero not in (0, 1, 2, 3):
        raise ValueError(f"recompute={comp.recompute!r} (none, selective, full), zero={comp.zero} (0–3)")
    n = comp.dp * comp.tp * comp.pp * comp.cp
    if n != cluster.devices:
        raise ValueError(f"dp·tp·pp·cp = {comp.dp}·{comp.tp}·{comp.pp}·{comp.cp} = {n} "
                         f"but the cluster has {cluster.devices} devices")
    if model.heads % comp.tp or model.kv_heads % comp.tp and comp.tp % model.kv_heads:
        raise ValueError(f"tp={comp.tp} must divide heads={model.heads} (and kv_heads={model.kv_heads} "
                         "divide or be divided by it)")
    if comp.pp * comp.virtual_stages > model.layers:
        raise ValueError(f"pp={comp.pp} × virtual_stages={comp.virtual_stages} is more than layers={model.layers}")
    if comp.cp > 1 and model.seq_len % (2 * comp.cp):
        raise ValueError(f"seq_len={model.seq_len} must divide into 2·cp={2 * comp.cp} zigzag chunks")
    if comp.ep > 1 and (model.num_experts % comp.ep or (comp.dp * comp.cp) % comp.ep):
        raise ValueError(f"ep={comp.ep} must divide num_experts={model.num_experts} "
                         f"and dp·cp={comp.dp * comp.cp}")
    if model.global_batch % (comp.dp * model.micro_batch):
        raise ValueError(f"global_batch={model.global_batch} sequences do not split into dp={comp.dp} "
                         f"× micro_batch={model.micro_batch}")


@lru_cache(maxsize=4096)
def _links(world: int, dp: int, tp: int, pp: int, cp: int, ep: int, per_node: int) -> dict[str, str]:
    grid = RankGrid(world, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
    return {axis: ("inter" if grid.crosses_nodes(axis, per_node) else "intra")
            for axis in ("dp_cp", "tp", "pp", "cp", "ep", "edp")}


def _stage_entries(model: Model, comp: Composition, m: int, n_layers: int, n_moe: int, first: bool, last: bool
                   ) -> tuple[dict, dict, float]:
    """Memory (activations for ONE micro-batch in flight) and bytes per axis of one device of a stage."""
    t, p, c, e = comp.tp, comp.pp, comp.cp, comp.ep
    s, b, h = model.seq_len, model.micro_batch, model.hidden
    sp = comp.sequence_parallel and t > 1
    dense, experts, replicated = _stage_params(model, t, e, n_layers, n_moe, first, last)
    kw = dict(param_bytes=model.param_bytes, grad_bytes=model.grad_bytes, optimizer_bytes=model.optimizer_bytes)
    states = model_state_bytes(dense, comp.zero, comp.dp * c, **kw)
    if experts:
        for k, v in model_state_bytes(experts, comp.zero, comp.dp * c // e, **kw).items():
            states[k] += v
    akw = dict(tp=t, cp=c, sequence_parallel=comp.sequence_parallel, flash=comp.flash)
    per_mb = ((n_layers - n_moe) * activation_bytes_per_layer(model, recompute=comp.recompute, **akw)
              + n_moe * activation_bytes_per_layer(model, recompute=comp.recompute, moe=True, **akw))
    if first and model.dropout:                 # the embedding's dropout mask
        per_mb += s / c * b * h / (t if comp.sequence_parallel else 1)
    memory = dict(states, activations=per_mb)
    if comp.recompute == "full":        # one layer's activations rebuilt during its backward
        memory["recompute"] = activation_bytes_per_layer(model, recompute="none", moe=n_moe > 0, **akw)
    if last:
        memory["logits"] = output_layer_bytes(model, tp=t, cp=c, sequence_parallel=comp.sequence_parallel)
    # --- bytes per device per step
    e_b, g_b = model.act_bytes, model.grad_bytes
    n_dp = comp.dp * c
    zero3 = 1.5 if comp.zero == 3 else 1.0
    comm = {"dp": zero3 * allreduce_bytes(dense * g_b, n_dp) if n_dp > 1 else 0.0}
    if experts and n_dp // e > 1:
        comm["edp"] = zero3 * allreduce_bytes(experts * g_b, n_dp // e)
    kcf = model.top_k * model.capacity_factor
    if t > 1:
        fwd_dense, fwd_moe = 2, 1 + kcf                 # forward collectives (repeated by full recomputation)
        again = 1 if comp.recompute == "full" else 0
        per_layer = (n_layers - n_moe) * fwd_dense * (2 + again) + n_moe * fwd_moe * (2 + again)
        act = allreduce_bytes(s / c * b * h * e_b, t)
        loss = 3 * allreduce_bytes(s / c * b * model.loss_bytes, t) if last else 0.0
        comm["tp"] = m * (act * (per_layer + first + last) + loss) \
            + (allreduce_bytes(replicated * g_b, t) if sp else 0.0)
    if p > 1:
        boundary = s / c * b * h * e_b / (t if comp.sequence_parallel else 1)
        comm["pp"] = ((not first) + (not last)) * m * boundary
    if c > 1:
        kv_block = 2 * s / c * b * model.kv_heads * (h // model.heads) * e_b / t
        passes = 4 if comp.recompute == "full" else 3
        comm["cp"] = passes * (c - 1) * n_layers * m * kv_block
    payload = 0.0
    if e > 1 and n_moe:
        tokens = s / c * b / (t if comp.sequence_parallel else 1)
        payload = 2 * n_moe * m * kcf * tokens * h * e_b
        comm["ep"] = 2 * payload * (e - 1) / e
    return memory, {k: v for k, v in comm.items() if v > 0}, payload


def plan(model: Model, cluster: Cluster, comp: Composition, *, stage: int | None = None) -> Plan:
    """Memory, communication, time and the first resource to run out, for one composition.

    ``stage``: describe one device of that pipeline stage; None (default): each entry from the
    stage where it is largest (see the module docstring).
    """
    check_composition(model, cluster, comp)
    t, p, c, e = comp.tp, comp.pp, comp.cp, comp.ep
    m = comp.micro_batches or model.global_batch // (comp.dp * model.micro_batch)
    s, h = model.seq_len, model.hidden
    if stage is not None and not 0 <= stage < p:
        raise ValueError(f"stage={stage} is not one of the pp={p} stages")
    # --- memory and bytes, stage by stage (stages with the same layers give the same entries)
    seen: dict[tuple, tuple] = {}
    memory: dict[str, float] = {}
    comm: dict[str, float] = {}
    payload, best_states = 0.0, -1.0
    for k in (range(p) if stage is None else (stage,)):
        n, moe = stage_layers(model, p, k)
        key = (n, moe, k == 0, k == p - 1)
        if key not in seen:
            seen[key] = _stage_entries(model, comp, m, *key)
        mem_k, comm_k, payload_k = seen[key]
        mem_k = dict(mem_k, activations=mem_k["activations"] * min(m, p - k))      # 1F1B: micro-batches in flight
        states = mem_k["params"] + mem_k["grads"] + mem_k["optimizer"]
        if states > best_states:
            best_states = states
            memory.update({x: mem_k[x] for x in ("params", "grads", "optimizer")})
        for x in ("activations", "recompute", "logits"):
            if x in mem_k:
                memory[x] = max(memory.get(x, 0.0), mem_k[x])
        for x, v in comm_k.items():
            comm[x] = max(comm.get(x, 0.0), v)
        payload = max(payload, payload_k)
    memory = {x: memory[x] for x in ("params", "grads", "optimizer", "activations", "recompute", "logits")
              if x in memory}
    comm = {x: comm[x] for x in ("dp", "edp", "tp", "pp", "cp", "ep") if x in comm}
    links = _links(cluster.devices, comp.dp, t, p, c, e, cluster.devices_per_node)
    axis_link = dict(dp=links["dp_cp"], edp=links["edp"], tp=links["tp"], pp=links["pp"], cp=links["cp"],
                     ep=links["ep"])
    link = {k: axis_link[k] for k in comm}
    comm_time = {k: v / (cluster.intra_bw if link[k] == "intra" else cluster.inter_bw) for k, v in comm.items()}
    # --- compute and the step
    tokens = model.global_batch * s
    n_act = active_params(model)
    flops = (8 if comp.recompute == "full" else 6) * (n_act + model.layers * s * h) * tokens
    compute = flops / (cluster.devices * cluster.flops * cluster.mfu)
    bubble = bubble_fraction(p, m, comp.virtual_stages) if p > 1 else 0.0
    busy = compute / (1 - bubble)
    critical = sum(comm_time.get(k, 0.0) for k in ("tp", "pp", "ep"))
    # gradients reduce during the backward (2/3 of the compute); K/V blocks travel during attention
    attention = compute * model.layers * s * h / (n_act + model.layers * s * h)
    exposed = (max(0.0, comm_time.get("dp", 0.0) + comm_time.get("edp", 0.0) - 2 / 3 * compute)
               + max(0.0, comm_time.get("cp", 0.0) - attention))
    step = busy + critical + exposed
    result = Plan(model, cluster, comp, m, memory, comm, comm_time, link, bubble, compute, step, "",
                  stage=stage, ep_payload=payload)
    result.bottleneck, result.reasons = _diagnose(result, busy - compute, critical, exposed)
    return result


def _diagnose(pl: Plan, bubble_time: float, critical: float, exposed: float) -> tuple[str, list[str]]:
    cap, mem = pl.cluster.memory, pl.memory
    states = mem["params"] + mem["grads"] + mem["optimizer"]
    acts = pl.total_memory - states
    reasons = []
    if not pl.fits:     # model states are the fixed cost: no batch size makes them fit
        alone = states > cap
        what = "model states (parameters, gradients, optimizer)" if alone else "activations"
        fix = ("shard them: ZeRO over dp, tp, pp (ep for experts)" if alone else
               "recompute, or split the sequence (tp with SP, cp), or smaller micro-batches")
        reasons.append(f"needs {pl.total_memory / GB:.1f} GB > {cap / GB:.0f} GB per device: model states "
                       f"{states / GB:.1f} GB, activations {acts / GB:.1f} GB; {what} run out first — {fix}")
        return "memory: " + what, reasons
    reasons.append(f"fits: {pl.total_memory / GB:.1f} of {cap / GB:.0f} GB")
    times = {"compute": pl.compute_time, "pipeline bubble": bubble_time,
             "communication in the critical path (tp/pp/ep)": critical,
             "communication not hidden by compute (dp/cp)": max(0.0, exposed)}
    worst = max(times, key=times.get)
    for k, v in sorted(times.items(), key=lambda kv: -kv[1]):
        if v > 0:
            reasons.append(f"{k}: {v:.3g} s")
    return ("time: " + worst), reasons


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def search(model: Model, cluster: Cluster, *, zero_stages=(0, 1, 2, 3), recompute=("none", "selective", "full"),
           flash: bool = False, max_tp: int | None = None, virtual_stages: int = 1, min_tokens_per_rank: int = 0,
           top: int = 10) -> tuple[list[Plan], list[Plan]]:
    """Every composition this model and cluster allow: (the ``top`` that fit, fastest first;
    the ``top`` that do not, least memory first).

    Sizes are powers of two, tp at most ``max_tp`` (default: one node).  The estimate does not
    model kernel efficiency at small shapes, so it over-rewards cutting the sequence into tiny
    pieces; ``min_tokens_per_rank`` (tokens of a sequence per context rank, s/cp) stands in for it.
    """
    ok, bad = [], []
    max_tp = max_tp or cluster.devices_per_node
    pow2 = [2 ** i for i in range(int(math.log2(cluster.devices)) + 1)]
    for tp, pp, cp in itertools.product(pow2, pow2, pow2):
        if tp > max_tp or cluster.devices % (tp * pp * cp) or model.seq_len / cp < min_tokens_per_rank:
            continue
        dp = cluster.devices // (tp * pp * cp)
        eps = [e for e in _divisors(dp * cp) if model.num_experts > 1 and model.num_experts % e == 0] or [1]
        for ep, zero, rec in itertools.product(eps, zero_stages, recompute):
            if flash and rec == "selective":    # flash attention already keeps no scores: the same plan
                continue
            comp = Composition(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, recompute=rec, flash=flash,
                               virtual_stages=virtual_stages)
            try:
                pl = plan(model, cluster, comp)
            except ValueError:
                continue
            (ok if pl.fits else bad).append(pl)
    ok.sort(key=lambda q: (q.step_time, q.total_memory))
    bad.sort(key=lambda q: q.total_memory)
    return ok[:top], bad[:top]


def with_sizes(comp: Composition, **kw) -> Composition:
    """A copy of ``comp`` with some fields changed (for widgets and notebooks)."""
    return replace(comp, **kw)


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
    column-parallel layers keep the all-gathered input (``sp_saves_gathered``).
    """
    return Model(name, layers=cfg.layers, hidden=cfg.d_model, heads=cfg.heads, kv_heads=cfg.heads, ffn=cfg.d_ff,
                 vocab=cfg.vocab, seq_len=cfg.seq_len, micro_batch=micro_batch or batch_size,
                 global_batch=batch_size, num_experts=cfg.num_experts if cfg.num_experts > 1 else 1,
                 top_k=cfg.top_k if cfg.num_experts > 1 else 1, moe_every=cfg.moe_every, capacity_factor=1.0,
                 dropout=False, param_bytes=8, grad_bytes=8, optimizer_bytes=16, act_bytes=8, biases=True,
                 learned_positions=True, final_norm=True, loss_bytes=8, stats_bytes=8, sp_saves_gathered=True,
                 source="reference/gpt.py (float64)")


def cpu_cluster(devices: int) -> Cluster:
    """One machine of ``devices`` gloo ranks on CPU (for planning the tiny GPT's runs; the time
    figures are nominal: 10 GFLOP/s and 1 GB/s per rank)."""
    return Cluster(f"{devices} CPU ranks (gloo)", devices=devices, memory=8 * GB, flops=1e10, intra_bw=1e9,
                   inter_bw=1e9, devices_per_node=devices, mfu=1.0, source="nominal")
