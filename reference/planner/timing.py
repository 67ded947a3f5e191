"""The step time from first principles: kernels (:mod:`.kernels`), messages (:mod:`.collectives`) and the
pipeline schedule (:mod:`.layout`), for a cluster with its device figures (:mod:`.hardware`).

One layer, one micro-batch, one device (T = s·b/c tokens, weights cut over t)::

    F  = Σ GEMM(M, N, K) + attention core + element-wise bytes / hbm_bw           forward
    B  = Σ [GEMM(M, K, N) + GEMM(K, N, M)] + attention core' + 2 × element-wise     backward (dgrad + wgrad)
         + (m−1)/m · 3·grad_bytes·params / (hbm_bw · μ)        the weight gradients added into .grad, as
         autograd accumulates them over the m micro-batches (Megatron 2021: no fused accumulation)
    R  = F (full recomputation) | attention core forward (selective) | 0            recomputation
    tp = 2 collectives of T·h·e forward, 2 backward, 2 more when recomputing fully — exposed unless
         ``tp_overlap`` (Megatron 2021: all-reduces in the critical path; with SP all-gather + reduce-scatter)
    cp = ring: c−1 K/V blocks passed forward, K/V and dK/dV backward, hidden behind attention's core
         (exposed: what exceeds it); all-gather: K/V gathered forward, dK/dV reduce-scattered backward,
         exposed; Ulysses: 4 all-to-alls of q, k, v, out each way, exposed
    ep = 2 all-to-alls forward, 2 backward per MoE layer, exposed
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
last micro-batch's backward and only what exceeds it is exposed; without it (Megatron's local DDP) all of
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
from .counts import _stage_params, active_params, padded_vocab
from .kernels import attention_core_time, elementwise_bytes, gemm_time, layer_gemms, memory_time
from .layout import bubble_units, chunk_layers, device_chunks
from .model import Cluster, Composition, Model

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


def layer_time(model: Model, cluster: Cluster, comp: Composition, links: dict[str, str], b: int, *,
               moe: bool = False) -> dict[str, float]:
    """Seconds of one layer, one micro-batch on one device: "F", "B", "R" (kernels) and the exposed
    communication by axis ("tp", "cp", "ep", "zero3")."""
    t, c, e = comp.tp, comp.cp, model.act_bytes
    tokens = model.seq_len * b / c
    sp = comp.sequence_parallel and t > 1
    gemms = layer_gemms(model, tokens, t, moe=moe)
    g_f = sum(gemm_time(m_, n_, k_, cluster, elem=e) for m_, n_, k_ in gemms)
    g_b = sum(gemm_time(m_, k_, n_, cluster, elem=e) + gemm_time(k_, n_, m_, cluster, elem=e) for m_, n_, k_ in gemms)
    a_f, a_b = attention_core_time(model, cluster, b=b, tp=t, cp=c, flash=comp.flash)
    ew = memory_time(elementwise_bytes(model, tokens, t, sequence_parallel=sp, moe=moe), cluster)
    F, B = g_f + a_f + ew, g_b + a_b + 2 * ew
    R = {"none": 0.0, "selective": 0.0 if comp.flash else a_f, "full": F}[comp.recompute]
    passes = 3 if comp.recompute == "full" else 2                       # forward, backward (+ recompute)
    out = dict(F=F, B=B, R=R, tp=0.0, cp=0.0, ep=0.0, zero3=0.0)
    if t > 1 and not comp.tp_overlap:       # (SP's backward re-gathers hide behind the dX GEMMs, as in Megatron-Core)
        per = (1 + model.top_k * model.capacity_factor) if moe else 2
        out["tp"] = passes * per * collective_time("all_reduce", tokens * model.hidden * e, t, cluster, links["tp"])
    if c > 1:
        kv = 2 * tokens * model.kv_heads * (model.hidden // model.heads) * e / min(t, model.kv_heads)
        if comp.cp_algorithm == "ring":
            hop = collective_time("p2p", kv, 2, cluster, links["cp"])
            fwd_x = max(0.0, (c - 1) * hop - a_f)
            bwd_x = max(0.0, (c - 1) * 2 * hop - a_b)
            out["cp"] = fwd_x * (passes - 1) + bwd_x
        elif comp.cp_algorithm == "allgather":
            ag = collective_time("all_gather", kv * c, c, cluster, links["cp"])
            out["cp"] = ag * (passes - 1) + collective_time("reduce_scatter", kv * c, c, cluster, links["cp"])
        elif comp.cp_algorithm == "ulysses":
            qkvo = tokens * (2 * model.heads + 2 * model.kv_heads) * (model.hidden // model.heads) * e / t
            out["cp"] = 4 * passes * collective_time("all_to_all", qkvo / 4, c, cluster, links["cp"])
        else:
            raise ValueError(f"cp_algorithm={comp.cp_algorithm!r}: choose ring, allgather or ulysses")
    if moe and comp.ep > 1:
        routed = model.top_k * model.capacity_factor * tokens / (t if comp.sequence_parallel else 1) \
            * model.hidden * e
        out["ep"] = 2 * passes * collective_time("all_to_all", routed, comp.ep, cluster, links["ep"])
    if comp.zero == 3 and comp.dp * c > 1:
        n_dp = comp.dp * c // (comp.ep if moe else 1)
        dense, experts, _ = _stage_params(model, t, comp.ep, 1, 1 if moe else 0, False, False)
        gather = collective_time("all_gather", (dense + experts) * model.param_bytes, n_dp, cluster,
                                 links["edp" if moe else "dp"])
        scatter = collective_time("reduce_scatter", (dense + experts) * model.grad_bytes, n_dp, cluster,
                                  links["edp" if moe else "dp"])
        # the share of a layer's gather issued ahead of use hides behind the compute before it; the rest
        # waits in the critical path (the reduce-scatter is posted after the layer's backward and overlaps)
        layer = dense + experts
        ahead = 0.0 if not comp.fsdp_prefetch else (1.0 if comp.prefetch_limit is None
                                                    else min(1.0, comp.prefetch_limit / layer))
        out["zero3"] = (2 * (1 - ahead) * gather + max(0.0, ahead * gather - F)
                        + max(0.0, ahead * gather + scatter - B - R))
    return out


def _chunk_time(model, cluster, comp, links, b, n_layers, n_moe, first, last, accumulate=0.0
                ) -> tuple[float, float, dict]:
    """(kernel seconds, backward-and-recompute seconds, exposed by axis) of one chunk, one micro-batch.
    ``accumulate``: the share of micro-batches whose weight gradients are added into ``.grad`` (m−1 of m)."""
    exposed = dict(tp=0.0, cp=0.0, ep=0.0, zero3=0.0)
    kernels, backward = 0.0, 0.0
    if accumulate:      # .grad += this micro-batch's gradient: read both, write one (grad_bytes each)
        dense, experts, _ = _stage_params(model, comp.tp, comp.ep, n_layers, n_moe, first, last)
        add = accumulate * memory_time(3 * model.grad_bytes * (dense + experts), cluster)
        kernels += add
        backward += add
    for count, moe in ((n_layers - n_moe, False), (n_moe, True)):
        if count:
            lt = layer_time(model, cluster, comp, links, b, moe=moe)
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
              dense_params: float, expert_params: float) -> StepTime:
    """The step of one composition (the module docstring's equations).  ``dense_params`` and
    ``expert_params``: parameters held by the device with the most (for the gradient sync and the
    optimizer)."""
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
        exp = dict(tp=0.0, cp=0.0, ep=0.0, zero3=0.0, pp=0.0)
        for ch in device_chunks(comp, k):
            key = (*chunks[ch], ch == 0, ch == n_chunks - 1)
            if key not in cache:
                cache[key] = _chunk_time(model, cluster, comp, links, b, *key, accumulate=(m - 1) / m)
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
    sharded = comp.zero >= 1 or comp.distributed_optimizer
    sync, sync_exposed = 0.0, 0.0
    if comp.zero < 3:
        groups = [(dense_params, n_dp, links["dp"])]
        if expert_params:
            groups.append((expert_params, n_dp // comp.ep, links["edp"]))
        # with overlap, the last bucket is posted when backward ends: it is exposed whatever the window.  On the
        # device holding the word embedding that bucket is the table's gradient (produced last); else one bucket
        embed = padded_vocab(model, comp.tp) // comp.tp * model.hidden if 0 in device_chunks(comp, slow) else 0
        for (psi, n, link), last in zip(groups, (max(DDP_BUCKET_BYTES, embed * model.grad_bytes), DDP_BUCKET_BYTES)):
            if n <= 1:
                continue
            kind = "reduce_scatter" if sharded else "all_reduce"
            reduce = collective_time(kind, psi * model.grad_bytes, n, cluster, link)
            gather = collective_time("all_gather", psi * model.param_bytes, n, cluster, link) if sharded else 0.0
            if comp.dp_overlap:
                tail = collective_time(kind, min(last, psi * model.grad_bytes), n, cluster, link)
                exposed_reduce = max(tail, reduce - dev_backward[slow])
            else:
                exposed_reduce = reduce
            sync += reduce + gather
            sync_exposed += exposed_reduce + gather
    local = (dense_params / (n_dp if sharded else 1)
             + (expert_params / max(1, n_dp // comp.ep) if sharded else expert_params))
    optimizer = memory_time(local * optimizer_bytes_per_param(model), cluster)
    step = pipeline + sync_exposed + optimizer
    exposed = {a: m * x for a, x in dev_exposed[slow].items() if x > 0}
    if sync_exposed > 0:
        exposed["dp"] = sync_exposed
    mf, hf = model_flops(model, comp.recompute)
    peak = step * cluster.devices * cluster.flops
    return StepTime(step=step, pipeline=pipeline, compute=m * dev_kernels[slow], bubble=fill, exposed=exposed,
                    optimizer=optimizer, model_flops=mf, hardware_flops=hf, mfu=mf / peak, hfu=hf / peak,
                    device_times=dev_time)
