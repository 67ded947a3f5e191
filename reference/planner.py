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
    activations per layer (Korthikanti §4, fp16, with dropout):
        s·b·h·34 + 5·a·s²·b                       no parallelism
        s·b·h·(10 + 24/t) + 5·a·s²·b/t            tensor parallel
        (s·b·h·34 + 5·a·s²·b)/t                   tensor + sequence parallel
        s·b·h·34/t                                + selective recomputation (or flash attention)
        2·s·b·h/t                                 full recomputation (layer inputs only)
      with context parallelism every s·b·h term uses s/c and the score term a·(s/c)·s·b; 1F1B
      keeps min(m, p) micro-batches of ⌈L/p⌉ layers alive on the first stage.
Communication per device per step (ring algorithms; what one device sends)
    dp    gradient all-reduce 2(N−1)/N · Ψ · bytes (ZeRO-1/2 the same: reduce-scatter + all-gather;
          ZeRO-3 1.5×: parameters gathered again for the backward)
    tp    4 all-reduces (or all-gather + reduce-scatter with SP) per layer per micro-batch,
          each 2(t−1)/t · s·b·h/c · bytes (6 with full recomputation)
    pp    one activation forward and one gradient back per micro-batch per stage boundary
    cp    ring attention: K and V blocks pass c−1 times forward, K,V and dK,dV c−1 times backward
    ep    4 all-to-alls per MoE layer per micro-batch (dispatch, combine, and their backward),
          each sending (e−1)/e of k·tokens·h
Time: compute = FLOPs / (devices · peak · MFU), FLOPs = (6·N_active + 6·L·s·h)·tokens (Kaplan et al.
arXiv:2001.08361; 8 instead of 6 with full recomputation: one more forward), stretched by the bubble (p−1)/(v·m + p−1);
tp, pp and ep traffic is in the critical path; dp traffic overlaps the backward (2/3 of the
compute) and cp traffic the attention compute (6·L·s·h per token): only what exceeds them is exposed.  A group's link is the intra-node one if the rank grid
(reference.mesh) keeps every group of that axis inside a node, else the inter-node one.

Bytes are what one device SENDS with the ring algorithms above; ``reference.trace`` records the
payload a rank hands to each collective (an all-reduce of n bytes is one event of n bytes), so a
comparison with a measured run converts with the same 2(N−1)/N factors.

Not counted: temporary buffers, communication buckets, allocator fragmentation, the CUDA context,
input-embedding activations, latency of small messages, imbalance between experts.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from .mesh import RankGrid

__all__ = ["Model", "Cluster", "Composition", "Plan", "param_counts", "model_state_bytes",
           "activation_bytes_per_layer", "allreduce_bytes", "bubble_fraction", "plan", "search", "with_sizes", "GB"]

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
    source: str = ""

    @property
    def moe_layers(self) -> int:
        return self.layers // self.moe_every if self.num_experts > 1 else 0


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
    h, hd = model.hidden, model.hidden // model.heads
    attn = h * model.heads * hd * 2 + h * model.kv_heads * hd * 2        # Q, O and K, V (GQA)
    mats = 3 if model.gated_ffn else 2
    moe, dense = model.moe_layers, model.layers - model.moe_layers
    return dict(
        attention=model.layers * attn,
        ffn=dense * mats * h * model.ffn,
        experts=moe * model.num_experts * mats * h * model.ffn,
        router=moe * h * model.num_experts,
        norms=model.layers * 2 * h,
        embeddings=model.vocab * h * (1 if model.tied_embeddings else 2),
    )


def active_params(model: Model) -> float:
    """Parameters one token passes through: experts count k of E."""
    c = param_counts(model)
    experts = c["experts"] * model.top_k / model.num_experts if model.num_experts > 1 else 0
    return c["attention"] + c["ffn"] + experts + c["router"] + c["norms"] + c["embeddings"]


def device_params(model: Model, comp: Composition) -> tuple[float, float]:
    """(dense, expert) parameters held by the busiest device (first/last stage with an embedding)."""
    c = param_counts(model)
    per_layer = (c["attention"] + c["ffn"] + c["norms"] + c["router"]) / model.layers
    layers = math.ceil(model.layers / comp.pp)
    embed = model.vocab * model.hidden * (1 if (comp.pp > 1 or model.tied_embeddings) else 2)
    dense = (layers * per_layer + embed) / comp.tp          # norms/router replicated in truth: small
    moe_layers = math.ceil(model.moe_layers / comp.pp) if model.moe_layers else 0
    experts = moe_layers * (c["experts"] / max(model.moe_layers, 1)) / (comp.ep * comp.tp)
    return dense, experts


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
    a gated or non-4h FFN, MoE (k experts' FFN activations per token, × capacity factor), no
    dropout, and context parallelism.  With MHA, FFN 4h, GELU and dropout it is exactly
    ``s·b·h·34 + 5·a·s²·b`` (tested).
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    s, b, h, a = model.seq_len / cp, model.micro_batch, model.hidden, model.heads
    kv = model.kv_heads * (h // a)
    e, mask = model.act_bytes, (1 if model.dropout else 0)
    sbh = s * b * h
    if recompute == "full":
        return e * sbh / (tp if sequence_parallel else 1)
    # replicated across tensor ranks unless sequence parallel: LayerNorm inputs, QKV and FC1 inputs, dropout masks
    replicated = e * 2 * sbh + e * sbh + e * sbh + mask * 2 * sbh
    # split across tensor ranks: Q, K (for QKᵀ), V, the attention output (proj input), the FFN internals
    ffn_tokens = model.top_k * model.capacity_factor if moe else 1
    ffn_inner = (3 if model.gated_ffn else 2) * e * s * b * model.ffn * ffn_tokens
    split = e * (sbh + s * b * kv) + e * s * b * kv + e * sbh + ffn_inner
    scores = 0.0
    if recompute == "none" and not flash:       # softmax output, dropout mask, dropout output
        scores = (e + mask + (e if model.dropout else 0)) * a * s * model.seq_len * b
    return (replicated / (tp if sequence_parallel else 1)) + (split + scores) / tp


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


def plan(model: Model, cluster: Cluster, comp: Composition) -> Plan:
    """Memory, communication, time and the first resource to run out, for one composition."""
    check_composition(model, cluster, comp)
    t, p, c, e = comp.tp, comp.pp, comp.cp, comp.ep
    m = comp.micro_batches or model.global_batch // (comp.dp * model.micro_batch)
    s, b, h = model.seq_len, model.micro_batch, model.hidden
    # --- memory
    dense, experts = device_params(model, comp)
    kw = dict(param_bytes=model.param_bytes, grad_bytes=model.grad_bytes, optimizer_bytes=model.optimizer_bytes)
    states = model_state_bytes(dense, comp.zero, comp.dp * c, **kw)
    if experts:
        for k, v in model_state_bytes(experts, comp.zero, comp.dp * c // e, **kw).items():
            states[k] += v
    layers = math.ceil(model.layers / p)
    moe_here = math.ceil(model.moe_layers / p) if model.moe_layers else 0
    akw = dict(tp=t, cp=c, sequence_parallel=comp.sequence_parallel, flash=comp.flash)
    per_mb = ((layers - moe_here) * activation_bytes_per_layer(model, recompute=comp.recompute, **akw)
              + moe_here * activation_bytes_per_layer(model, recompute=comp.recompute, moe=True, **akw))
    memory = dict(states, activations=per_mb * min(m, p))
    if comp.recompute == "full":        # one layer's activations rebuilt during its backward
        memory["recompute"] = activation_bytes_per_layer(model, recompute="none", moe=moe_here > 0, **akw)
    memory["logits"] = 4 * s / c * b * model.vocab / t      # fp32 logits for the loss (last stage)
    # --- communication per device per step
    e_b, g_b = model.act_bytes, model.grad_bytes
    n_dp = comp.dp * c
    zero3 = 1.5 if comp.zero == 3 else 1.0
    comm = {"dp": zero3 * allreduce_bytes(dense * g_b, n_dp) if n_dp > 1 else 0.0}
    if experts and n_dp // e > 1:
        comm["edp"] = zero3 * allreduce_bytes(experts * g_b, n_dp // e)
    if t > 1:
        per = 6 if comp.recompute == "full" else 4
        comm["tp"] = per * layers * m * allreduce_bytes(s / c * b * h * e_b, t)
    if p > 1:
        boundary = s / c * b * h * e_b / (t if comp.sequence_parallel else 1)
        comm["pp"] = (1 if p == 2 else 2) * m * boundary
    if c > 1:
        kv_block = 2 * s / c * b * model.kv_heads * (h // model.heads) * e_b / t
        passes = 4 if comp.recompute == "full" else 3
        comm["cp"] = passes * (c - 1) * layers * m * kv_block
    if e > 1 and moe_here:
        tokens = s / c * b / (t if comp.sequence_parallel else 1)
        comm["ep"] = 4 * moe_here * m * all_to_all_bytes(model.top_k * model.capacity_factor * tokens * h * e_b, e)
    comm = {k: v for k, v in comm.items() if v > 0}
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
    result = Plan(model, cluster, comp, m, memory, comm, comm_time, link, bubble, compute, step, "")
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
