"""The α–β cost of a message and of a ring collective (Hockney's model; Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005, §2):

    point-to-point of n bytes                 α + n/β
    all-gather / reduce-scatter over p ranks  (p−1)·α + (p−1)/p · n/β      (n: the whole gathered tensor)
    all-reduce (reduce-scatter + all-gather)  2(p−1)·α + 2(p−1)/p · n/β
    all-to-all (pairwise)                     (p−1)·α + (p−1)/p · n/β      (n: what one rank holds)

α is one message step's latency and β the bandwidth one device achieves on the link the rank grid puts
the group on: ``intra_bw · intra_efficiency`` inside a node, ``inter_bw · inter_efficiency`` across
(:mod:`.hardware` cites both).  Where the cluster carries a measured sweep of all-reduce sizes inside a
node (``intra_busbw``, nccl-tests' bus bandwidth), a collective there takes steps/p · n / busbw(n), busbw
interpolated log-log at its size: a 64 MB all-reduce on an A100 node moves at 172 GB/s, not the 235 of a
16 GiB one — α + n/β with one β is too fast between a few MB and a few hundred.  Latency is what makes
many small messages expensive: p·v·m pipeline sends per step, or ZeRO-3's per-layer gathers over
thousands of ranks.

The experts' all-to-all (:func:`expert_all_to_all_time`) is timed by where its group sits (:mod:`.placement`):
inside one node on NVLink; across N nodes, two-tier — of what a rank sends, the share for the l − 1 peers in its
own node crosses NVLink while the share for the p − l others crosses the NIC, both at once:

    t = max( (l−1)·α_intra + (l−1)/p · n/β_intra,   (p−l)·α_inter + (p−l)/p · n/β_inter )

Under node-limited routing (each token to experts on at most M nodes, DeepSeek-V3 §2.1.2) a token crosses the
network once per remote node it targets and is forwarded to its experts there over NVLink (§3.2.2): the NIC
carries n/k · min(M, N, k)·(N−1)/N instead of n·(p−l)/p, and NVLink delivers the k copies.
"""
from __future__ import annotations

import math

from .model import Cluster
from .placement import Span

__all__ = ["KINDS", "link_bandwidth", "link_latency", "collective_time", "sweep_rate", "measured_busbw",
           "expert_all_to_all_time"]

KINDS = ("p2p", "all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def link_bandwidth(cluster: Cluster, link: str) -> float:
    """β: bytes/s one device achieves on ``link`` ("intra" or "inter")."""
    if link == "intra":
        return cluster.intra_bw * cluster.intra_efficiency
    return cluster.inter_bw * cluster.inter_efficiency


def link_latency(cluster: Cluster, link: str) -> float:
    """α: seconds per message step on ``link``."""
    return cluster.alpha_intra if link == "intra" else cluster.alpha_inter


def collective_time(kind: str, nbytes: float, p: int, cluster: Cluster, link: str) -> float:
    """Seconds for one ``kind`` of ``nbytes`` over ``p`` ranks on ``link`` (the formulas above)."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; choose one of {', '.join(KINDS)}")
    if nbytes <= 0 or (p <= 1 and kind != "p2p"):
        return 0.0
    alpha, beta = link_latency(cluster, link), link_bandwidth(cluster, link)
    if kind == "p2p":
        return alpha + nbytes / beta
    steps = 2 * (p - 1) if kind == "all_reduce" else p - 1
    if link == "intra" and cluster.intra_busbw:
        return steps / p * nbytes / sweep_rate(cluster.intra_busbw, nbytes)
    return steps * alpha + steps / p * nbytes / beta


def sweep_rate(sweep: tuple, size: float) -> float:
    """The rate of a measured sweep ((size, rate), ... ascending) at ``size`` — nccl-tests' bus bandwidth by
    message size, or a GEMM's FLOP/s by its FLOPs: log-log interpolation between the two sizes around it;
    below the sweep a fixed time (the smallest size's), above it the last rate."""
    if size <= sweep[0][0]:
        return sweep[0][1] * size / sweep[0][0]        # below the sweep: latency-bound, time ≈ constant
    for (s0, b0), (s1, b1) in zip(sweep, sweep[1:]):
        if size <= s1:
            w = math.log(size / s0) / math.log(s1 / s0)
            return math.exp((1 - w) * math.log(b0) + w * math.log(b1))
    return sweep[-1][1]


measured_busbw = sweep_rate        # its earlier name, for the bus-bandwidth sweep


def expert_all_to_all_time(nbytes: float, p: int, span: Span, cluster: Cluster, *, top_k: int = 1,
                           max_nodes: int = 0) -> float:
    """Seconds for one dispatch (or combine) all-to-all: each of ``p`` ranks holds ``nbytes`` of routed rows,
    spread evenly over the group's ranks; ``span``: the nodes the group spans and the ranks of it a node holds;
    ``top_k`` copies per token and ``max_nodes`` (node-limited routing; 0: none) — the module docstring."""
    if nbytes <= 0 or p <= 1:
        return 0.0
    if span.nodes == 1:
        return collective_time("all_to_all", nbytes, p, cluster, "intra")
    local = span.local
    intra_share = (local - 1) / p
    if max_nodes:
        inter_share = min(max_nodes, span.nodes, top_k) / top_k * (span.nodes - 1) / span.nodes
        intra_share = (p - 1) / p                # every remote copy is forwarded over NVLink once it lands
    else:
        inter_share = (p - local) / p
    intra = (local - 1) * link_latency(cluster, "intra") + intra_share * nbytes / link_bandwidth(cluster, "intra")
    inter = (p - local) * link_latency(cluster, "inter") + inter_share * nbytes / link_bandwidth(cluster, "inter")
    return max(intra, inter)
