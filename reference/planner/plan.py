"""The plan of one composition (memory, bytes and time per axis, the bubble, what runs out first).
The search over every composition a model and a cluster allow is in :mod:`.search`.

Time: a cluster with its device figures (every ``Cluster.preset``) is timed from first principles by
:mod:`.timing`; one without them, or with ``mfu`` given, by the simple model of the package docstring
(compute at a fixed MFU, tp/pp/ep in the critical path, dp and cp hidden up to their windows)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .counts import (_stage_params, activation_bytes_per_layer, active_params, allreduce_bytes, bubble_fraction,
                     model_state_bytes, output_layer_bytes)
from .layout import check_layout, chunk_layers, chunks_held, device_chunks
from .model import GB, Cluster, Composition, Model
from .overlap import resolve
from .placement import group_spans
from .timing import model_flops, step_time

__all__ = ["Plan", "check_composition", "plan", "with_sizes"]


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
    exposed: dict[str, float] = field(default_factory=dict)   # axis → seconds of communication not hidden
    mfu: float = 0.0                    # model FLOPs / (step · devices · peak)
    hfu: float = 0.0                    # the same with recomputed FLOPs counted
    optimizer_time: float = 0.0         # the optimizer step (first-principles model only)
    bubble_time: float = 0.0            # seconds the slowest device idles in the pipeline's fill and drain
    cpu_floor: float = 0.0              # a CPU world: the node's ranks' summed CPU work over its cores (0: not one)

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        """Everything fits in the device's memory less the cluster's stated margin."""
        return self.total_memory <= self.cluster.memory - self.cluster.memory_margin

    def summary(self) -> str:
        mem = ", ".join(f"{k} {v / GB:.1f}" for k, v in self.memory.items())
        com = ", ".join(f"{k} {self.comm_bytes[k] / GB:.2f} GB/{self.comm_time[k]:.2f}s {self.link[k]}"
                        for k in self.comm_bytes)
        util = f"; MFU {self.mfu:.0%}, HFU {self.hfu:.0%}" if self.mfu else ""
        return (f"{self.comp}: {self.total_memory / GB:.1f} of {self.cluster.memory / GB:.0f} GB "
                f"({mem}); step ≈ {self.step_time:.2f} s (compute {self.compute_time:.2f} s, bubble "
                f"{self.bubble:.0%}; {com or 'no communication'}{util}); runs out first: {self.bottleneck}")


def check_composition(model: Model, cluster: Cluster, comp: Composition) -> None:
    """ValueError naming the sizes when the composition cannot be built for this model and cluster."""
    if model.heads % model.kv_heads:
        raise ValueError(f"heads={model.heads} must divide into kv_heads={model.kv_heads} groups")
    if comp.recompute not in ("none", "selective", "full") or comp.zero not in (0, 1, 2, 3):
        raise ValueError(f"recompute={comp.recompute!r} (none, selective, full), zero={comp.zero} (0–3)")
    n = comp.dp * comp.tp * comp.pp * comp.cp
    if n != cluster.devices:
        raise ValueError(f"dp·tp·pp·cp = {comp.dp}·{comp.tp}·{comp.pp}·{comp.cp} = {n} "
                         f"but the cluster has {cluster.devices} devices")
    if model.heads % comp.tp or not model.mla and model.kv_heads % comp.tp and comp.tp % model.kv_heads:
        raise ValueError(f"tp={comp.tp} must divide heads={model.heads} (and kv_heads={model.kv_heads} "
                         "divide or be divided by it)")
    check_layout(model, comp)
    if comp.cp > 1 and model.seq_len % (2 * comp.cp):
        raise ValueError(f"seq_len={model.seq_len} must divide into 2·cp={2 * comp.cp} zigzag chunks")
    if comp.cp_algorithm not in ("ring", "allgather", "ulysses"):
        raise ValueError(f"cp_algorithm={comp.cp_algorithm!r}: choose ring, allgather or ulysses")
    if comp.cp > 1 and comp.cp_algorithm == "ulysses" and model.heads % (comp.tp * comp.cp):
        raise ValueError(f"Ulysses needs tp·cp = {comp.tp * comp.cp} to divide heads={model.heads}")
    if comp.micro_batch is not None and comp.micro_batch < 1:
        raise ValueError(f"micro_batch={comp.micro_batch} must be at least 1")
    etp, block = comp.expert_tp, comp.tp * comp.cp * comp.dp
    if comp.ep < 1 or etp < 1 or model.num_experts % comp.ep:
        raise ValueError(f"ep={comp.ep} must divide num_experts={model.num_experts} (and ep, etp={etp} be positive)")
    if block % (etp * comp.ep):
        raise ValueError(f"etp·ep = {etp}·{comp.ep} = {etp * comp.ep} must divide the stage's tp·cp·dp = "
                         f"{comp.tp}·{comp.cp}·{comp.dp} = {block} ranks (the expert grid is folded over them)")
    if model.num_experts > 1 and model.d_expert % etp:
        raise ValueError(f"etp={etp} must divide each expert's FFN size {model.d_expert}")
    if comp.fp8 and not cluster.fp8_flops:
        raise ValueError(f"fp8=True but {cluster.name} has no FP8 peak (fp8_flops=0)")
    resolve(comp.tp_overlap)
    b = comp.micro_batch or model.micro_batch
    if model.global_batch % (comp.dp * b):
        raise ValueError(f"global_batch={model.global_batch} sequences do not split into dp={comp.dp} "
                         f"× micro_batch={b}")




def _stage_entries(model: Model, comp: Composition, m: int, n_layers: int, n_moe: int, first: bool, last: bool,
                   crossings: int | None = None) -> tuple[dict, dict, float, tuple[float, float], tuple]:
    """Memory (without activations), bytes per axis, the ep payload, (dense, expert) parameters of one device of
    a stage, and its activations as (bytes per dense layer, per MoE layer, the embedding's extra) for ONE
    micro-batch.  ``crossings``: pipeline boundaries its chunks send across per micro-batch (default: one
    before the stage unless first, one after unless last)."""
    t, p, c, e = comp.tp, comp.pp, comp.cp, comp.ep
    etp = comp.expert_tp
    s, b, h = model.seq_len, model.micro_batch, model.hidden
    sp = comp.sequence_parallel and t > 1
    dense, experts, replicated = _stage_params(model, t, e, n_layers, n_moe, first, last, etp)
    kw = dict(param_bytes=model.param_bytes, grad_bytes=model.grad_bytes, optimizer_bytes=model.optimizer_bytes)
    zero = max(comp.zero, 1) if comp.distributed_optimizer else comp.zero
    n_dp, edp = comp.dp * c, t * c * comp.dp // (etp * e)
    states = model_state_bytes(dense, zero, n_dp, **kw)
    if experts:
        for k, v in model_state_bytes(experts, zero, edp, **kw).items():
            states[k] += v
    akw = dict(tp=t, cp=c, sequence_parallel=comp.sequence_parallel, flash=comp.flash)
    per_layer = (activation_bytes_per_layer(model, recompute=comp.recompute, **akw),
                 activation_bytes_per_layer(model, recompute=comp.recompute, moe=True, ep=e, **akw) if n_moe else 0.0,
                 s / c * b * h / (t if comp.sequence_parallel else 1) if first and model.dropout else 0.0)
    memory = dict(states)               # the embedding's dropout mask: the third entry
    if comp.recompute == "full":        # one layer's activations rebuilt during its backward
        memory["recompute"] = activation_bytes_per_layer(model, recompute="none", moe=n_moe > 0, ep=e, **akw)
    if last:
        memory["logits"] = output_layer_bytes(model, tp=t, cp=c, sequence_parallel=comp.sequence_parallel)
    # --- bytes per device per step
    e_b, g_b = model.act_bytes, model.grad_bytes
    zero3 = 1.5 if comp.zero == 3 else 1.0
    comm = {"dp": zero3 * allreduce_bytes(dense * g_b, n_dp) if n_dp > 1 else 0.0}
    if experts and edp > 1:
        comm["edp"] = zero3 * allreduce_bytes(experts * g_b, edp)
    kcf = model.top_k * model.capacity          # routed rows per token at the mean (the bytes are the mean's)
    again = 1 if comp.recompute == "full" else 0
    shared = 1 if model.shared_experts else 0
    tokens = s / c * b / (t if comp.sequence_parallel else 1)       # what one device routes
    if t > 1:
        fwd_dense, fwd_moe = 2, 1 + shared + (kcf if etp == t else 0)   # forward collectives (again when recomputing)
        per_layer_ar = (n_layers - n_moe) * fwd_dense * (2 + again) + n_moe * fwd_moe * (2 + again)
        act = allreduce_bytes(s / c * b * h * e_b, t)
        loss = 3 * allreduce_bytes(s / c * b * model.loss_bytes, t) if last else 0.0
        # SP saving the shard: qkv, fc1 (dense layers and shared experts) and the head gather their input again,
        # ½ all-reduce each
        regather = 0.5 * (2 * (n_layers - n_moe) + (1 + shared) * n_moe + last) \
            if sp and not model.sp_saves_gathered else 0.0
        comm["tp"] = m * (act * (per_layer_ar + first + last + regather) + loss) \
            + (allreduce_bytes(replicated * g_b, t) if sp else 0.0)
    if etp > 1 and etp != t and n_moe:      # all-gather before the experts and reduce-scatter after, each way
        comm["etp"] = m * n_moe * (2 + again) * 2 * (etp - 1) / etp * etp * kcf * tokens * h * e_b
    if p > 1:
        boundary = s / c * b * h * e_b / (t if comp.sequence_parallel or comp.scatter_gather else 1)
        crossings = ((not first) + (not last)) if crossings is None else crossings
        comm["pp"] = crossings * m * boundary
    if c > 1:
        kv_heads = model.heads if model.mla else model.kv_heads
        kv_block = s / c * b * kv_heads * (model.d_qk + model.d_v) * e_b / t
        passes = 4 if comp.recompute == "full" else 3
        comm["cp"] = passes * (c - 1) * n_layers * m * kv_block
    payload = 0.0
    if e > 1 and n_moe:
        payload = 2 * n_moe * m * kcf * tokens * h * e_b
        comm["ep"] = (2 + again) * payload * (e - 1) / e      # 4 all-to-alls (6 recomputing) of payload/2 each
    return memory, {k: v for k, v in comm.items() if v > 0}, payload, (dense, experts), per_layer


def plan(model: Model, cluster: Cluster, comp: Composition, *, stage: int | None = None) -> Plan:
    """Memory, communication, time and the first resource to run out, for one composition.

    ``stage``: describe one device of that pipeline stage; None (default): each entry from the
    stage where it is largest (see the module docstring).  ``comp.micro_batch`` (if given) replaces
    the model's micro-batch size: ``Plan.model`` is the model with it.
    """
    check_composition(model, cluster, comp)
    if comp.micro_batch:
        model = replace(model, micro_batch=comp.micro_batch)
    t, p, c, e, v = comp.tp, comp.pp, comp.cp, comp.ep, comp.virtual_stages
    m = comp.micro_batches or model.global_batch // (comp.dp * model.micro_batch)
    s, h = model.seq_len, model.hidden
    if stage is not None and not 0 <= stage < p:
        raise ValueError(f"stage={stage} is not one of the pp={p} stages")
    # --- memory and bytes, device by device (devices with the same chunks give the same entries)
    chunks = chunk_layers(model, comp)
    last_chunk = p * v - 1
    seen: dict[tuple, tuple] = {}
    memory: dict[str, float] = {}
    comm: dict[str, float] = {}
    payload, best_states, held = 0.0, -1.0, (0.0, 0.0)
    for k in (range(p) if stage is None else (stage,)):
        mine = device_chunks(comp, k)
        n, moe = sum(chunks[x][0] for x in mine), sum(chunks[x][1] for x in mine)
        crossings = sum((x != 0) + (x != last_chunk) for x in mine)
        key = (n, moe, k == 0, k == p - 1, crossings)
        if key not in seen:
            seen[key] = _stage_entries(model, comp, m, *key)
        mem_k, comm_k, payload_k, params_k, (per_dense, per_moe, embed_mask) = seen[key]
        # the layers of the chunk-forwards whose activations are alive at the device's peak (.layout)
        alive = chunks_held(comp, k, m)
        live, live_moe = (sum(n * chunks[c][i] for c, n in alive.items()) for i in (0, 1))
        live_embedding = alive.get(0, 0)
        mem_k = dict(mem_k, activations=(live - live_moe) * per_dense + live_moe * per_moe
                     + live_embedding * embed_mask)
        states = mem_k["params"] + mem_k["grads"] + mem_k["optimizer"]
        if states > best_states:
            best_states, held = states, params_k
            memory.update({x: mem_k[x] for x in ("params", "grads", "optimizer")})
        for x in ("activations", "recompute", "logits"):
            if x in mem_k:
                memory[x] = max(memory.get(x, 0.0), mem_k[x])
        for x, val in comm_k.items():
            comm[x] = max(comm.get(x, 0.0), val)
        payload = max(payload, payload_k)
    memory = {x: memory[x] for x in ("params", "grads", "optimizer", "activations", "recompute", "logits")
              if x in memory}
    comm = {x: comm[x] for x in ("dp", "edp", "tp", "etp", "pp", "cp", "ep") if x in comm}
    spans = group_spans(cluster.devices, comp.dp, t, p, c, e, comp.expert_tp, cluster.devices_per_node)
    axis_link = {a: spans[g].link for a, g in (("dp", "dp_cp"), ("edp", "edp"), ("tp", "tp"), ("etp", "etp"),
                                               ("pp", "pp"), ("cp", "cp"), ("ep", "ep"))}
    link = {k: axis_link[k] for k in comm}
    comm_time = {k: val / (cluster.intra_bw if link[k] == "intra" else cluster.inter_bw) for k, val in comm.items()}
    mf, hf = model_flops(model, comp.recompute)
    if cluster.first_principles:
        st = step_time(model, cluster, comp, axis_link, m, model.micro_batch, *held, spans=spans)
        result = Plan(model, cluster, comp, m, memory, comm, comm_time, link,
                      st.bubble / st.pipeline if st.pipeline else 0.0, st.compute, st.step, "", stage=stage,
                      ep_payload=payload, exposed=st.exposed, mfu=st.mfu, hfu=st.hfu, optimizer_time=st.optimizer,
                      bubble_time=st.bubble)
        result.bottleneck, result.reasons = _diagnose(result)
        if cluster.cores and cluster.devices_per_node > cluster.cores:
            _cpu_bound(result, m * sum(st.device_kernels) / p + st.optimizer)
        return result
    # --- the simple model: compute at a fixed MFU, stretched by the bubble
    tokens = model.global_batch * s
    n_act = active_params(model)
    flops = (8 if comp.recompute == "full" else 6) * (n_act + model.layers * s * h) * tokens
    compute = flops / (cluster.devices * cluster.flops * cluster.fixed_mfu)
    bubble = bubble_fraction(p, m, v) if p > 1 else 0.0
    busy = compute / (1 - bubble)
    critical = {k: comm_time[k] for k in ("tp", "pp", "ep") if k in comm_time}
    # gradients reduce during the backward (2/3 of the compute); K/V blocks travel during attention
    attention = compute * model.layers * s * h / (n_act + model.layers * s * h)
    hidden = {"dp": max(0.0, comm_time.get("dp", 0.0) + comm_time.get("edp", 0.0) - 2 / 3 * compute),
              "cp": max(0.0, comm_time.get("cp", 0.0) - attention)}
    exposed = {**critical, **{k: x for k, x in hidden.items() if x > 0}}
    step = busy + sum(exposed.values())
    peak = step * cluster.devices * cluster.flops
    result = Plan(model, cluster, comp, m, memory, comm, comm_time, link, bubble, compute, step, "",
                  stage=stage, ep_payload=payload, exposed=exposed, mfu=mf / peak, hfu=hf / peak,
                  bubble_time=busy - compute)
    result.bottleneck, result.reasons = _diagnose(result)
    return result


def _cpu_bound(pl: Plan, work: float) -> None:
    """A node whose ranks outnumber its host cores (a CPU world): the step is at least the CPU work all the node's
    ranks demand over the cores — ``work`` seconds per rank (its kernels over the step, the optimizer).  When that
    floor is longer than the plan's step, it is the step, and what runs out first."""
    c, n = pl.cluster, pl.cluster.devices_per_node
    pl.cpu_floor = n * work / c.cores
    line = (f"CPU: {n} ranks × {work:.3g} s of kernels share {c.cores} cores: the step takes at least "
            f"{pl.cpu_floor:.3g} s")
    if pl.cpu_floor > pl.step_time:
        scale = pl.step_time / pl.cpu_floor
        pl.step_time, pl.mfu, pl.hfu = pl.cpu_floor, pl.mfu * scale, pl.hfu * scale
        pl.bottleneck = f"time: CPU-bound ({n} ranks on {c.cores} cores)"
        pl.reasons.insert(1, line + f" (> the {pl.cpu_floor * scale:.3g} s the ranks' own timelines take)")
    else:
        pl.reasons.append(line)


def _diagnose(pl: Plan) -> tuple[str, list[str]]:
    """What runs out first, and the reasons: the memory verdict, then every time term largest first."""
    cap, mem = pl.cluster.memory - pl.cluster.memory_margin, pl.memory
    states = mem["params"] + mem["grads"] + mem["optimizer"]
    acts = pl.total_memory - states
    margin = f" (after a {pl.cluster.memory_margin / GB:.0f} GB margin)" if pl.cluster.memory_margin else ""
    reasons = []
    if not pl.fits:     # model states are the fixed cost: no batch size makes them fit
        alone = states > cap
        what = "model states (parameters, gradients, optimizer)" if alone else "activations"
        fix = ("shard them: ZeRO over dp, tp, pp (ep for experts)" if alone else
               "recompute, or split the sequence (tp with SP, cp), or smaller micro-batches")
        reasons.append(f"needs {pl.total_memory / GB:.1f} GB > {cap / GB:.0f} GB per device{margin}: model states "
                       f"{states / GB:.1f} GB, activations {acts / GB:.1f} GB; {what} run out first — {fix}")
        return "memory: " + what, reasons
    reasons.append(f"fits: {pl.total_memory / GB:.1f} of {cap / GB:.0f} GB{margin} "
                   f"({(cap - pl.total_memory) / GB:.1f} GB to spare)")
    times = {"compute": pl.compute_time, "pipeline bubble": pl.bubble_time}
    for axis, x in pl.exposed.items():
        where = "in the critical path" if axis in ("tp", "etp", "pp", "ep", "zero3") else "not hidden by compute"
        times[f"{axis} communication {where}"] = x
    if pl.optimizer_time:
        times["optimizer step"] = pl.optimizer_time
    worst = max(times, key=times.get)
    for k, x in sorted(times.items(), key=lambda kv: -kv[1]):
        if x > 0:
            reasons.append(f"{k}: {x:.3g} s")
    return ("time: " + worst), reasons


def with_sizes(comp: Composition, **kw) -> Composition:
    """A copy of ``comp`` with some fields changed (for widgets and notebooks)."""
    return replace(comp, **kw)
