"""The α–β cost of a message and of a ring collective (Hockney's model; Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005, §2):

    point-to-point of n bytes                 α + n/β
    all-gather / reduce-scatter over p ranks  (p−1)·α + (p−1)/p · n/β      (n: the whole gathered tensor)
    all-reduce (reduce-scatter + all-gather)  2(p−1)·α + 2(p−1)/p · n/β
    all-to-all (pairwise)                     (p−1)·α + (p−1)/p · n/β      (n: what one rank holds)

α is one message step's latency and β the bandwidth one device achieves on the link the rank grid puts
the group on: ``intra_bw · intra_efficiency`` inside a node, ``inter_bw · inter_efficiency`` across
(:mod:`.hardware` cites both).  Latency is what makes many small messages expensive: p·v·m pipeline
sends per step, or ZeRO-3's per-layer gathers over thousands of ranks.
"""
from __future__ import annotations

from .model import Cluster

__all__ = ["KINDS", "link_bandwidth", "link_latency", "collective_time"]

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
    return steps * alpha + steps / p * nbytes / beta
