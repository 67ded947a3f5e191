"""The step time from first principles: kernels (:mod:`.kernels`), messages (:mod:`.collectives`) and the
pipeline schedule (:mod:`.layout`), for a cluster with its device figures (:mod:`.hardware`).

One layer, one micro-batch, one device (T = s·b/c tokens, weights cut over t)::

    F  = Σ GEMM(M, N, K) + attention core + element-wise bytes / hbm_bw           forward
    B  = Σ [GEMM(M, K, N) + GEMM(K, N, M)] + attention core' + 2 × element-wise     backward (dgrad + wgrad)
         + (m−1)/m · 3·grad_bytes·params / (hbm_bw · μ)        the weight gradients added into .grad, as
         autograd accumulates them over the m micro-batches (Megatron 2021: no fused accumulation; none with
         ``grad_accumulation_fusion``, the wgrad GEMM adding into the buffer itself)
         a MoE layer adds its experts' kernels (:mod:`.experts`); with ``fp8`` the GEMMs run at the FP8 peak and
         every GEMM input (forward) and incoming gradient (backward) is cast first, read 2 bytes, write 1 and a
         transposed copy
    R  = F (full recomputation) | attention core forward (selective: Megatron-Core checkpoints the core
         attention, flash or not) | 0                                               recomputation
    tp = 2 collectives of T·h·e forward, 2 backward, 2 more when recomputing fully — exposed; with
         ``tp_overlap`` the attention's and MLP's are overlapped with their GEMMs at the cost :mod:`.overlap`
         computes from the run's configuration (SMs given to communication, chunks, the last one exposed)
         (Megatron 2021: all-reduces in the critical path; with SP all-gather + reduce-scatter)
    cp = ring: c−1 K/V blocks passed forward, K/V and dK/dV backward, hidden behind attention's core
         (exposed: what exceeds it); all-gather: K/V gathered forward, dK/dV reduce-scattered backward,
         exposed; Ulysses: 4 all-to-alls of q, k, v, out each way, exposed
    ep = 2 all-to-alls forward, 2 backward per MoE layer, timed by where the group sits; exposed, or with
         ``moe_overlap`` hidden behind the layer's compute on SMs the compute gives up (:mod:`.experts`)
    ZeRO-3 = a layer's parameters gathered before its forward and its backward, its gradients
         reduce-scattered after: with ``fsdp_prefetch`` the share fetched ahead (all of the next layer, or
         ``prefetch_limit`` elements of it) hides behind the previous layer's compute (exposed: what exceeds
         it) and the rest waits in the critical path; without it every gather waits

A device runs its chunks (:func:`.layout.device_chunks`); per micro-batch it spends
T_k = Σ chunks (F + B + R + exposed) + its pipeline sends (α + bytes/β each: one forward and one
backward per chunk boundary it owns; 1/t of the activation with ``scatter_gather`` or SP, plus the
all-gather over tp that rebuilds it).  The pipeline (slowest device T_max, bubble factor u from
:func:`.layout.bubble_units`)::

    pipeline = m · T_max + (Σ_k T_k − T_max) · u/(p−1)        (= (m + u)·T when the devices are equal)

Then the gradients: a ring all-reduce over dp·cp (ZeRO-1/2 and the distributed optimizer: reduce-scatter,
then the parameters all-gathered after the step).  With ``dp_overlap`` the reduction hides behind the
last micro-batch's backward and only what exceeds it is exposed, and the parameters' all-gather behind the next
step's first forward (Megatron's overlap_param_gather); without it (Megatron's local DDP) all of
it is, and the last bucket (25 MiB, DDP's default, or the word embedding's gradient, computed last) is exposed
either way.  The optimizer streams each local parameter's state (:func:`optimizer_bytes_per_param`: 52 bytes in
mixed precision with Adam, as Megatron's fp16 optimizer runs it) at hbm_bw · μ.

    step = pipeline + exposed gradient sync + optimizer

MFU = model FLOPs / (step · devices · peak), model FLOPs = (6·N_active + 12·L·s·a·d)·tokens (the
Narayanan/PaLM count: every score, no recomputation); HFU also counts what recomputation repeats.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .collectives import collective_time
from .counts import _stage_params, active_params, padded_vocab, routed_rows
from .experts import a2a_left, expert_layer_time
from .kernels import attention_core_time, attention_gemms, elementwise_bytes, ffn_gemms, gemm_time, memory_time
from .layout import bubble_units, chunk_layers, device_chunks
from .model import Cluster, Composition, Model
from .overlap import resolve, tp_overlap_cost

# torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25): the default bucket, the last one posted as backward ends
DDP_BUCKET_BYTES = 25 * 2 ** 20

__all__ = ["StepTime", "layer_time", "step_time", "model_flops", "optimizer_bytes_per_param"]


@dataclass
class StepTime:
    step: float                         # seconds per optimizer step
    pipeline: float                     # the micro-batches through the pipeline, bubble included
    compute: float                      # the slowest device's kernels over m micro-batches (no waiting)
    bubble: float                       # seconds the slowest device idles in fill and drain
    exposed: dict[str, float]           # axis → seconds of communication nobody hid
    optimizer: float
    model_flops: float
    hardware_flops: float
    mfu: float
    hfu: float
    device_times: list[float] = field(default_factory=list)   # T_k per micro-batch
    device_kernels: list[float] = field(default_factory=list)  # each stage's kernel seconds per micro-batch


def optimizer_bytes_per_param(model: Model) -> float:
    """Bytes the optimizer step streams per local parameter.  Mixed precision (weights below 4 bytes, an fp32
    master copy in the optimizer state), as Megatron's fp16/bf16 optimizer runs it, one pass each: gradients
    cast to fp32 (grad + 4), unscaled and checked for inf (4 + 4), their norm for clipping (4), Adam on the
    master weights (read weight, gradient, m, v; write weight, m, v: 7 × 4), the weights cast back (4 + param).
    Otherwise (one precision): read weight, gradient and state, write weight and state."""
    if model.param_bytes < 4 and model.optimizer_bytes >= 12:
        return (model.grad_bytes + 4) + 8 + 4 + 7 * 4 + (4 + model.param_bytes)
    return model.param_bytes + model.grad_bytes + 2 * model.optimizer_bytes


def model_flops(model: Model, recompute: str = "none") -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step: 6·N_active + 12·L·s·a·d per token, plus what
    recomputation repeats (full: one more forward, 2·N + 4·L·s·a·d; selective: the attention core)."""
    tokens = model.global_batch * model.seq_len
    attn = model.layers * model.seq_len * model.hidden       # a·d = h
    n = active_params(model)
    mf = (6 * n + 12 * attn) * tokens
    extra = {"none": 0.0, "selective": 4 * attn, "full": 2 * n + 4 * attn}[recompute] * tokens
    return mf, mf + extra


def _gemm_pair_times(model, cluster, comp, gemms) -> tuple[float, float]:
    """(forward, backward) seconds of a dict of forward GEMMs {name: (M, N, K)}: each once forward, its dgrad
    [M×N]·[N×K] and wgrad [K×M]·[M×N] backward."""
    kw = dict(elem=model.act_bytes, fp8=comp.fp8)
    fwd = sum(gemm_time(m_, n_, k_, cluster, **kw) for m_, n_, k_ in gemms.values())
    bwd = sum(gemm_time(m_, k_, n_, cluster, **kw) + gemm_time(k_, n_, m_, cluster, **kw)
              for m_, n_, k_ in gemms.values())
    return fwd, bwd


def layer_time(model: Model, cluster: Cluster, comp: Composition, links: dict[str, str], b: int, *,
               moe: bool = False, spans: dict | None = None) -> dict[str, float]:
    """Seconds of one layer, one micro-batch on one device: "F", "B", "R" (kernels) and the exposed
    communication by axis ("tp", "cp", "ep", "etp", "zero3").  A MoE layer adds its experts' terms
    (:mod:`.experts`); ``spans``: where the expert groups sit (:func:`.placement.group_spans`)."""
    t, c, e = comp.tp, comp.cp, model.act_bytes
    tokens = model.seq_len * b / c
    sp = comp.sequence_parallel and t > 1
    passes = 3 if comp.recompute == "full" else 2                       # forward, backward (+ recompute)
    gemms = attention_gemms(model, tokens, t)
    if not moe:
        gemms.update(ffn_gemms(model, tokens, model.ffn, t))
    elif model.shared_experts:      # one MLP of the shared experts' summed size, cut over tp (Megatron-Core's)
        gemms.update({f"shared_{k}": v for k, v in
                      ffn_gemms(model, tokens, model.shared_experts * model.d_shared, t).items()})
    g_f, g_b = _gemm_pair_times(model, cluster, comp, gemms)
    a_f, a_b = attention_core_time(model, cluster, b=b, tp=t, cp=c, flash=comp.flash)
    inner = None
    ex = None
    if moe:
        ex = expert_layer_time(model, cluster, comp, links, spans, passes)
        inner = model.top_k * routed_rows(model, comp.ep) * model.d_expert + model.shared_experts * model.d_shared
    ew = memory_time(elementwise_bytes(model, tokens, t, sequence_parallel=sp, ffn=inner), cluster)
    casts = 0.0
    if comp.fp8:    # each GEMM's input cast to FP8 with a transposed copy forward, each incoming gradient backward
        casts = memory_time(sum(4 * m_ * k_ for m_, n_, k_ in gemms.values()), cluster)
    F = g_f + a_f + ew + casts + (ex["F"] if ex else 0.0)
    B = g_b + a_b + 2 * ew + casts + (ex["B"] if ex else 0.0)
    # selective: Megatron-Core checkpoints the core attention and runs its forward again (flash or not)
    R = {"none": 0.0, "selective": a_f, "full": F}[comp.recompute]
    out = dict(F=F, B=B, R=R, tp=0.0, cp=0.0, ep=0.0, etp=0.0, zero3=0.0)
    if t > 1:
        # all-reduce equivalents of T·h per pass: attention, then the dense FFN or the shared experts, and the
        # routed experts when cut over the same tp ranks (SP's backward re-gathers hide behind the dX GEMMs)
        exposed = 0 if resolve(comp.tp_overlap) else 1 + (0 if moe else 1)
        per = exposed + (1 if moe and model.shared_experts else 0) + (ex["etp_as_tp"] if ex else 0.0)
        out["tp"] = passes * per * collective_time("all_reduce", tokens * model.hidden * e, t, cluster, links["tp"])
        cost_f, cost_b = tp_overlap_cost(model, cluster, comp, tokens, moe=moe)
        out["tp"] += cost_f * (passes - 1) + cost_b
    if c > 1:
        out["cp"] = _cp_exposed(model, cluster, comp, links, tokens, a_f, a_b, passes)
    if ex:
        out["etp"] = ex["etp"]
        out["ep"] = a2a_left(ex["a2a"], F * (passes - 1) + B, cluster, comp.moe_overlap)
    if comp.zero == 3 and comp.dp * c > 1:
        out["zero3"] = _zero3_exposed(model, cluster, comp, links, moe, F, B, R)
    return out


def _cp_exposed(model, cluster, comp, links, tokens, a_f, a_b, passes) -> float:
    """Context parallelism's exposed seconds per layer: the ring's K/V passes beyond attention's core, or the
    all-gather / Ulysses all-to-alls whole."""
    t, c, e = comp.tp, comp.cp, model.act_bytes
    kv_heads = model.heads if model.mla else model.kv_heads
    kv = tokens * kv_heads * (model.d_qk + model.d_v) * e / min(t, kv_heads)
    if comp.cp_algorithm == "ring":
        hop = collective_time("p2p", kv, 2, cluster, links["cp"])
        fwd_x = max(0.0, (c - 1) * hop - a_f)
        bwd_x = max(0.0, (c - 1) * 2 * hop - a_b)
        return fwd_x * (passes - 1) + bwd_x
    if comp.cp_algorithm == "allgather":
        ag = collective_time("all_gather", kv * c, c, cluster, links["cp"])
        return ag * (passes - 1) + collective_time("reduce_scatter", kv * c, c, cluster, links["cp"])
    if comp.cp_algorithm == "ulysses":
        qkvo = tokens * (model.heads * (model.d_qk + model.d_v) + kv_heads * (model.d_qk + model.d_v)) * e / t
        return 4 * passes * collective_time("all_to_all", qkvo / 4, c, cluster, links["cp"])
    raise ValueError(f"cp_algorithm={comp.cp_algorithm!r}: choose ring, allgather or ulysses")


def _zero3_exposed(model, cluster, comp, links, moe, F, B, R) -> float:
    """ZeRO-3's exposed seconds per layer: the parameter gathers not fetched ahead (or not hidden by the layer
    before), and the gradients' reduce-scatter beyond the backward.  Dense parameters over dp·cp, experts over
    edp."""
    n_dp = comp.dp * comp.cp
    edp = comp.tp * comp.cp * comp.dp // (comp.expert_tp * comp.ep)
    dense, experts, _ = _stage_params(model, comp.tp, comp.ep, 1, 1 if moe else 0, False, False, comp.expert_tp)
    groups = [(dense, n_dp, links["dp"]), (experts, edp, links["edp"])] if experts else [(dense, n_dp, links["dp"])]
    gather = sum(collective_time("all_gather", psi * model.param_bytes, n, cluster, link) for psi, n, link in groups)
    scatter = sum(collective_time("reduce_scatter", psi * model.grad_bytes, n, cluster, link)
                  for psi, n, link in groups)
    # the share of a layer's gather issued ahead of use hides behind the compute before it; the rest
    # waits in the critical path (the reduce-scatter is posted after the layer's backward and overlaps)
    layer = dense + experts
    ahead = 0.0 if not comp.fsdp_prefetch else (1.0 if comp.prefetch_limit is None
                                                else min(1.0, comp.prefetch_limit / layer))
    return 2 * (1 - ahead) * gather + max(0.0, ahead * gather - F) + max(0.0, ahead * gather + scatter - B - R)


def _chunk_time(model, cluster, comp, links, b, n_layers, n_moe, first, last, accumulate=0.0, spans=None
                ) -> tuple[float, float, dict]:
    """(kernel seconds, backward-and-recompute seconds, exposed by axis) of one chunk, one micro-batch.
    ``accumulate``: the share of micro-batches whose weight gradients are added into ``.grad`` (m−1 of m);
    none with ``grad_accumulation_fusion`` (the wgrad GEMM adds into the gradient buffer itself)."""
    exposed = dict(tp=0.0, cp=0.0, ep=0.0, etp=0.0, zero3=0.0)
    kernels, backward = 0.0, 0.0
    if accumulate and not comp.grad_accumulation_fusion:  # .grad += this micro-batch's: read both, write one
        dense, experts, _ = _stage_params(model, comp.tp, comp.ep, n_layers, n_moe, first, last, comp.expert_tp)
        add = accumulate * memory_time(3 * model.grad_bytes * (dense + experts), cluster)
        kernels += add
        backward += add
    for count, moe in ((n_layers - n_moe, False), (n_moe, True)):
        if count:
            lt = layer_time(model, cluster, comp, links, b, moe=moe, spans=spans)
            kernels += count * (lt["F"] + lt["B"] + lt["R"])
            backward += count * (lt["B"] + lt["R"])
            for k in exposed:
                exposed[k] += count * lt[k]
    t, e = comp.tp, model.act_bytes
    tokens = model.seq_len * b / comp.cp
    if first:       # embedding lookup (+ dropout), its gradient scattered back
        kernels += 3 * memory_time(tokens * model.hidden * (2 * e + 1), cluster)
        if t > 1 and not comp.tp_overlap:
            exposed["tp"] += collective_time("all_reduce", tokens * model.hidden * e, t, cluster, links["tp"])
    if last:        # final norm, the head's GEMMs and the cross-entropy over V/t (loss_bytes per logit)
        vocab = -(-model.vocab // t)
        head = (gemm_time(tokens, vocab, model.hidden, cluster, elem=e)
                + gemm_time(tokens, model.hidden, vocab, cluster, elem=e)
                + gemm_time(model.hidden, vocab, tokens, cluster, elem=e))
        # the vocabulary-parallel cross-entropy as Megatron writes it, one kernel per line: logits cast to
        # loss_bytes (if they are not already), max, subtract, exp, sum, divide (8 passes of loss_bytes);
        # backward: grad × softmax (2) and the cast back
        lb, cast = model.loss_bytes, (model.loss_bytes + e if model.loss_bytes != e else 0)
        ce_f = memory_time(tokens * vocab * (8 * lb + cast), cluster)
        ce_b = memory_time(tokens * vocab * (2 * lb + cast), cluster)
        norm = 3 * memory_time(2 * e * tokens * model.hidden, cluster)
        kernels += head + ce_f + ce_b + norm
        backward += head * 2 / 3 + ce_b
        if t > 1 and not comp.tp_overlap:
            exposed["tp"] += collective_time("all_reduce", tokens * model.hidden * e, t, cluster, links["tp"]) \
                + 3 * collective_time("all_reduce", tokens * model.loss_bytes, t, cluster, links["tp"])
    return kernels, backward, exposed


def step_time(model: Model, cluster: Cluster, comp: Composition, links: dict[str, str], m: int, b: int,
              dense_params: float, expert_params: float, spans: dict | None = None) -> StepTime:
    """The step of one composition (the module docstring's equations).  ``dense_params`` and
    ``expert_params``: parameters held by the device with the most (for the gradient sync and the
    optimizer); ``spans``: where the expert groups sit (:func:`.placement.group_spans`)."""
    p, v, t = comp.pp, comp.virtual_stages, comp.tp
    chunks = chunk_layers(model, comp)
    n_chunks = p * v
    sp_or_sg = comp.scatter_gather or (comp.sequence_parallel and t > 1)
    boundary = model.seq_len / comp.cp * b * model.hidden * model.act_bytes / (t if sp_or_sg else 1)
    send = collective_time("p2p", boundary, 2, cluster, links["pp"]) if p > 1 else 0.0
    if p > 1 and comp.scatter_gather and t > 1 and not (comp.sequence_parallel and t > 1):
        send += collective_time("all_gather", boundary * t, t, cluster, links["tp"])
    cache: dict[tuple, tuple] = {}
    dev_time, dev_kernels, dev_backward, dev_exposed = [], [], [], []
    for k in range(p):
        total, kern, back = 0.0, 0.0, 0.0
        exp = dict(tp=0.0, cp=0.0, ep=0.0, etp=0.0, zero3=0.0, pp=0.0)
        for ch in device_chunks(comp, k):
            key = (*chunks[ch], ch == 0, ch == n_chunks - 1)
            if key not in cache:
                cache[key] = _chunk_time(model, cluster, comp, links, b, *key, accumulate=(m - 1) / m, spans=spans)
            kc, bc, ec = cache[key]
            kern += kc
            back += bc
            for a, x in ec.items():
                exp[a] += x
            exp["pp"] += send * ((ch != 0) + (ch != n_chunks - 1))
        total = kern + sum(exp.values())
        dev_time.append(total)
        dev_kernels.append(kern)
        dev_backward.append(back)
        dev_exposed.append(exp)
    slow = max(range(p), key=lambda i: dev_time[i])
    t_max = dev_time[slow]
    u = bubble_units(comp)
    fill = (sum(dev_time) - t_max) * (u / (p - 1)) if p > 1 else 0.0
    pipeline = m * t_max + fill
    # --- gradient synchronisation over dp·cp (experts over edp) and the optimizer
    n_dp = comp.dp * comp.cp
    edp = comp.tp * comp.cp * comp.dp // (comp.expert_tp * comp.ep)
    sharded = comp.zero >= 1 or comp.distributed_optimizer
    forward = dev_kernels[slow] - dev_backward[slow]        # the slow device's forward of one micro-batch
    sync, sync_exposed = 0.0, 0.0
    if comp.zero < 3:
        groups = [(dense_params, n_dp, links["dp"])]
        if expert_params:
            groups.append((expert_params, edp, links["edp"]))
        # with overlap, the last bucket is posted when backward ends: it is exposed whatever the window.  On the
        # device holding the word embedding that bucket is the table's gradient (produced last); else one bucket
        embed = padded_vocab(model, comp.tp) // comp.tp * model.hidden if 0 in device_chunks(comp, slow) else 0
        for (psi, n, link), last in zip(groups, (max(DDP_BUCKET_BYTES, embed * model.grad_bytes), DDP_BUCKET_BYTES)):
            if n <= 1:
                continue
            kind = "reduce_scatter" if sharded else "all_reduce"
            reduce = collective_time(kind, psi * model.grad_bytes, n, cluster, link)
            gather = collective_time("all_gather", psi * model.param_bytes, n, cluster, link) if sharded else 0.0
            if comp.dp_overlap:     # the gradients during the last backward; the parameters (sharded) during the
                #                     next step's first forward, bucket by bucket as Megatron's overlap_param_gather
                tail = collective_time(kind, min(last, psi * model.grad_bytes), n, cluster, link)
                exposed_reduce = max(tail, reduce - dev_backward[slow])
                first = collective_time("all_gather", min(last, psi * model.param_bytes), n, cluster, link)
                exposed_gather = max(first, gather - forward) if sharded else 0.0
            else:
                exposed_reduce, exposed_gather = reduce, gather
            sync += reduce + gather
            sync_exposed += exposed_reduce + exposed_gather
    local = (dense_params / (n_dp if sharded else 1)
             + (expert_params / max(1, edp) if sharded else expert_params))
    # the optimizer streams its state; with FP8 it also casts every local weight to FP8 once (read 2, write 1 and
    # a transposed copy), as TransformerEngine caches the cast weights over a step's micro-batches
    per_param = optimizer_bytes_per_param(model) + (4 if comp.fp8 else 0)
    optimizer = memory_time(local * per_param, cluster)
    step = pipeline + sync_exposed + optimizer
    exposed = {a: m * x for a, x in dev_exposed[slow].items() if x > 0}
    if sync_exposed > 0:
        exposed["dp"] = sync_exposed
    mf, hf = model_flops(model, comp.recompute)
    peak = step * cluster.devices * cluster.flops
    return StepTime(step=step, pipeline=pipeline, compute=m * dev_kernels[slow], bubble=fill, exposed=exposed,
                    optimizer=optimizer, model_flops=mf, hardware_flops=hf, mfu=mf / peak, hfu=hf / peak,
                    device_times=dev_time, device_kernels=dev_kernels)
