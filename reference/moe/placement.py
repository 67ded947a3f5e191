"""Lecture 5b, part 6 — where the experts live, and what their all-to-all sends across nodes.

Node n holds ranks ``n·D … n·D + D − 1`` (D devices per node).  An expert-parallel group's rank j
holds experts ``j·E/ep … (j+1)·E/ep − 1``, so every expert has a node (:func:`expert_nodes`), and
every dispatched token row a destination node.  With routing balanced over the experts, a token's
k rows go to each of the ep ranks with probability 1/ep, so one rank's dispatch sends

    k · T · d · b · (ep ranks of its group on OTHER nodes) / ep        bytes across nodes

and the combine sends the same back (forward; the backward doubles both).  Folding decides the
numerator: tp = 8 on 8-device nodes puts the unfolded ep group one rank per node (7 of 8 peers
remote), the folded one (etp = 1) inside the node (0 remote).  :func:`cross_node_bytes` computes it
from a :class:`reference.mesh.RankGrid`; :func:`measured_cross_node_bytes` reads the same from the
trace of a real run (what the rows' destinations really were, routing imbalance included).
Node-limited routing (``max_nodes=M``) caps the remote destinations of a token at M − 1 nodes
whatever k is (DeepSeek-V3 trains with k = 8 and M = 4).
"""
from __future__ import annotations

__all__ = ["node_of", "expert_nodes", "cross_node_bytes", "measured_cross_node_bytes"]


def node_of(rank: int, devices_per_node: int) -> int:
    """The node of a global rank: ranks n·D … n·D + D − 1 share node n."""
    if devices_per_node < 1:
        raise ValueError(f"devices_per_node must be >= 1, got {devices_per_node}")
    return rank // devices_per_node


def expert_nodes(num_experts: int, group_ranks: list[int], devices_per_node: int) -> list[int]:
    """The node of each of ``num_experts`` experts spread over the expert-parallel group ``group_ranks``
    (global ranks in group order; group rank j holds experts j·E/ep …)."""
    ep = len(group_ranks)
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {ep} ranks")
    per = num_experts // ep
    return [node_of(group_ranks[e // per], devices_per_node) for e in range(num_experts)]


def cross_node_bytes(grid, devices_per_node: int, *, tokens: int, d_model: int, k: int,
                     bytes_per_element: int = 2, rank: int = 0) -> dict:
    """Bytes ``rank``'s dispatch sends to other nodes per MoE layer, forward, with routing balanced.

    tokens: T tokens this rank routes; k: experts per token.  Returns {"ep_group", "remote_peers",
    "dispatch_bytes" (all rows leaving the rank, own rank excluded), "cross_node_bytes",
    "nodes_spanned"}.  The combine returns the same bytes; the backward sends both again.
    """
    group = grid.ranks("ep", rank)
    me = node_of(rank, devices_per_node)
    remote = sum(node_of(r, devices_per_node) != me for r in group)
    ep = len(group)
    row = k * tokens * d_model * bytes_per_element
    return {"ep_group": group, "remote_peers": remote, "dispatch_bytes": row * (ep - 1) // ep,
            "cross_node_bytes": row * remote // ep,
            "nodes_spanned": len({node_of(r, devices_per_node) for r in group})}


def measured_cross_node_bytes(trace_, grid, devices_per_node: int, *, whats=("dispatch",)) -> dict[int, int]:
    """Per rank: the bytes its all-to-alls (``what`` in ``whats``) sent to ranks on other nodes, read from the
    trace (``meta["send_bytes"]`` per group rank, mapped to global ranks through the ep group)."""
    out: dict[int, int] = {}
    for e in trace_:
        if e.op != "all_to_all" or e.meta.get("what") not in whats:
            continue
        group = grid.ranks("ep", e.rank)
        me = node_of(e.rank, devices_per_node)
        sent = sum(b for r, b in zip(group, e.meta["send_bytes"]) if node_of(r, devices_per_node) != me)
        out[e.rank] = out.get(e.rank, 0) + sent
    return out
