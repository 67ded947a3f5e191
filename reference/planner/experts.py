"""The time of a MoE layer's experts on one device, one micro-batch — everything a dense layer does not have.

A device of the expert grid (:mod:`.placement`) holds E_l = E/ep experts, each cut over etp ranks.  It routes its
own T_r tokens (T/t with sequence parallelism), k choices each; the dispatch all-to-all over the ep group brings
every choice to its expert's ranks, an all-gather over the etp group gives each of them all the rows of its experts
(etp > 1), the experts run, and the reverse (reduce-scatter over etp, combine all-to-all) brings the results
home.  Per device, on the busiest device of the group (:func:`.counts.routed_rows`: ``capacity_factor`` with
padded buffers, else 1 + (load_imbalance − 1)·ep/E dropless)::

    rows per local expert   M_e = etp · k · T_r · rows / E_l
    router                  GEMM [T_r × h]·[h × E], then scores, top-k and their gradients over T_r·E fp32
                            numbers: memory-bound (read and write 4 bytes each, softmax three passes, sigmoid two)
    permutation             gather the k·rows copies into expert order and back, forward and backward: read and
                            write (1 + k·rows)·T_r·h·e twice each way (Megatron-Core's fused permute/unpermute);
                            with etp > 1 the gathered rows are sorted again by expert (etp·k·rows·T_r·h·e, twice)
    experts                 grouped GEMMs at their own shapes, E_l at once: FC1 [M_e × h]·[h × f·(2 if gated)/etp],
                            FC2 [M_e × f/etp]·[f/etp × h]; backward dgrad + wgrad of each
    dispatch, combine       one all-to-all each way forward, the same backward, two more when recomputing whole
                            layers: k·rows·T_r·h·e bytes from each rank, timed by where the group sits
                            (:func:`.collectives.expert_all_to_all_time`: NVLink, the NIC, or both; node-limited)
    etp                     all-gather before the experts and reduce-scatter after, forward and backward, over the
                            etp group (counted with tp's collectives when etp = tp: the same ranks)

With ``moe_overlap`` (Megatron-Core's --overlap-moe-expert-parallel-comm, DeepSeek-V3's DualPipe) the all-to-alls of
one micro-batch run during the other's compute, on :data:`A2A_SMS` SMs the compute gives up while they run: of the
communication c beside the layer's compute W, max(c − W, c·A2A_SMS/SMs) is left in the step.
"""
from __future__ import annotations

from .collectives import collective_time, expert_all_to_all_time
from .counts import routed_rows
from .kernels import gemm_time, memory_time
from .model import Cluster, Composition, Model
from .placement import Span

__all__ = ["A2A_SMS", "expert_layer_time", "routed_tokens", "a2a_left"]

# DeepSeek-V3 Technical Report (arXiv:2412.19437) §3.2.2: "only 20 SMs are sufficient to fully utilize the
# bandwidths of IB and NVLink" for its dispatch and combine kernels — the SMs an overlapped all-to-all holds
A2A_SMS = 20


def routed_tokens(model: Model, comp: Composition) -> float:
    """T_r: the tokens one device routes per micro-batch (its sequence-parallel shard, or all T without SP)."""
    tokens = model.seq_len * model.micro_batch / comp.cp
    return tokens / comp.tp if comp.sequence_parallel else tokens


def expert_layer_time(model: Model, cluster: Cluster, comp: Composition, links: dict[str, str],
                      spans: dict[str, Span] | None, passes: int) -> dict[str, float]:
    """{"F", "B": the experts' kernels forward and backward (router, permutation, grouped GEMMs, FP8 casts),
    "a2a": the dispatch/combine all-to-alls (see :func:`a2a_left`), "etp": the expert-tensor collectives (etp ≠ tp),
    "etp_as_tp": all-reduce-equivalents of T·h to add to tp's collectives when etp = tp > 1} — the module
    docstring's terms; ``passes``: 2, or 3 with full recomputation (the forward runs twice)."""
    h, e, k = model.hidden, model.act_bytes, model.top_k
    t, etp, ep = comp.tp, comp.expert_tp, comp.ep
    local = model.num_experts // ep
    t_r = routed_tokens(model, comp)
    rows = routed_rows(model, ep)
    m_e = etp * k * t_r * rows / local
    up, down = model.d_expert * (2 if model.gated_ffn else 1) / etp, model.d_expert / etp
    g = dict(elem=e, batch=local, fp8=comp.fp8)
    experts_f = gemm_time(m_e, up, h, cluster, **g) + gemm_time(m_e, h, down, cluster, **g)
    experts_b = (gemm_time(m_e, h, up, cluster, **g) + gemm_time(h, up, m_e, cluster, **g)
                 + gemm_time(m_e, down, h, cluster, **g) + gemm_time(down, h, m_e, cluster, **g))
    scores = model.num_experts * 4 * t_r
    router_f = gemm_time(t_r, model.num_experts, h, cluster, elem=e) \
        + memory_time(scores * (3 if model.router == "softmax" else 2) * 2 + t_r * k * 12, cluster)
    router_b = 2 * gemm_time(t_r, model.num_experts, h, cluster, elem=e) + memory_time(scores * 3, cluster)
    permute = memory_time(2 * 2 * (1 + k * rows) * t_r * h * e, cluster)
    if etp > 1:
        permute += memory_time(2 * 2 * etp * k * rows * t_r * h * e, cluster)
    casts = 0.0
    if comp.fp8:     # each GEMM input cast to FP8 (and a transposed copy) forward, each incoming gradient backward
        casts = memory_time(4 * local * m_e * (h + down + up + h), cluster)
    out = dict(F=experts_f + router_f + permute + casts, B=experts_b + router_b + permute + casts,
               a2a=0.0, etp=0.0, etp_as_tp=0.0)
    gathered = etp * k * rows * t_r * h * e
    if etp > 1 and etp != t:
        out["etp"] = passes * (collective_time("all_gather", gathered, etp, cluster, links["etp"])
                               + collective_time("reduce_scatter", gathered, etp, cluster, links["etp"]))
    elif etp > 1:
        out["etp_as_tp"] = k * rows          # AG + RS of k·rows·T·h over tp: k·rows all-reduces of T·h
    if ep > 1:
        span = spans["ep"] if spans else Span(1 if links["ep"] == "intra" else 2, 1)
        one = expert_all_to_all_time(k * rows * t_r * h * e, ep, span, cluster, top_k=k, max_nodes=model.max_nodes)
        out["a2a"] = 2 * passes * one
    return out


def a2a_left(comm: float, work: float, cluster: Cluster, overlap: bool) -> float:
    """Seconds of ``comm`` (the layer's all-to-alls) left in the step beside ``work`` (the layer's compute): all
    of it, or with ``overlap`` max(comm − work, comm·A2A_SMS/SMs) (the module docstring)."""
    if not overlap:
        return comm
    return max(comm - work, comm * A2A_SMS / cluster.sms)
