"""Where the expert all-to-all goes: the expert grid unfolded (each expert cut like the dense layers, etp = tp)
and folded (etp = 1), drawn on nodes of 8 devices, with the bytes that cross nodes.

Both grids are :class:`reference.mesh.RankGrid`'s, the bytes :func:`reference.moe.placement.cross_node_bytes`'s
(routing balanced; one MoE layer, forward: the dispatch; the combine sends as much back, the backward both again)::

    64 ranks on 8 nodes of 8, tp = 8, ep = 8; [r] = the highlighted ep group

        unfolded (etp = 8)                       folded (etp = 1)
        node 0  [0] 1  2  3  4  5  6  7          node 0  [0][1][2][3][4][5][6][7]
        node 1  [8] 9 10 11 12 13 14 15          node 1   8  9 10 11 12 13 14 15
        …       one rank on each node            …       the whole group on one node

The state is a plain dict (:func:`grid_state`); :func:`draw_grids` paints it; :func:`expert_grid_player` steps
through the ep groups (Play) with the tensor and expert-parallel sizes as controls.
"""
from __future__ import annotations

from typing import Any

from ..mesh import RankGrid
from ..moe.placement import cross_node_bytes, node_of

__all__ = ["grid_state", "grid_caption", "draw_grids", "expert_grid_player", "MODEL"]

# One MoE layer of a DeepSeek-V3-sized model: 4096 tokens per rank, d = 7168, top-8, bf16 on the wire.
MODEL = {"tokens": 4096, "d_model": 7168, "k": 8, "bytes_per_element": 2}
IN_NODE, ACROSS = "#55A868", "#C44E52"


def _panel(name: str, world: int, devices_per_node: int, tp: int, ep: int, etp: int, group: int,
           model: dict) -> dict[str, Any]:
    """One grid: its ep groups, the highlighted one and what its first rank's dispatch sends where."""
    try:
        grid = RankGrid(world, tp=tp, dp=world // tp, ep=ep, etp=etp)
    except ValueError as e:
        return {"name": name, "etp": etp, "error": str(e)}
    groups = grid.all_groups("ep")
    members = groups[group % len(groups)]
    sender = members[0]
    b = cross_node_bytes(grid, devices_per_node, rank=sender, **model)
    return {"name": name, "etp": etp, "error": None, "groups": groups, "members": members, "sender": sender,
            "tp_group": grid.ranks("tp", sender), "etp_group": grid.ranks("etp", sender),
            "edp_group": grid.ranks("edp", sender), "nodes_spanned": b["nodes_spanned"],
            "remote_peers": b["remote_peers"], "dispatch_bytes": b["dispatch_bytes"],
            "cross_node_bytes": b["cross_node_bytes"],
            "peers": [(r, node_of(r, devices_per_node) != node_of(sender, devices_per_node))
                      for r in members if r != sender]}


def grid_state(tp: int = 8, ep: int = 8, group: int = 0, *, world: int = 64, devices_per_node: int = 8,
               model: dict | None = None) -> dict[str, Any]:
    """Both expert grids of ``world`` ranks (``tp`` × dp = world/tp dense; ep groups of ``ep``), unfolded
    (etp = tp) and folded (etp = 1), with their ``group``-th ep group highlighted (groups sorted by their
    smallest rank).  A grid that cannot be built holds the ``ValueError``'s message instead ("error").

    Returns {"world", "devices_per_node", "tp", "ep", "group", "n_groups", "model", "panels": [unfolded,
    folded]}, each panel {"name", "etp", "error", "groups", "members", "sender" (the group's first rank),
    "tp_group", "etp_group", "edp_group" (the sender's), "nodes_spanned", "remote_peers", "dispatch_bytes",
    "cross_node_bytes" (the sender's dispatch, one layer, forward), "peers": [(rank, crosses a node)]}.
    """
    if world % devices_per_node or world % tp:
        raise ValueError(f"{world} ranks must fill nodes of {devices_per_node} and divide by tp={tp}")
    model = dict(MODEL if model is None else model)
    panels = [_panel("unfolded", world, devices_per_node, tp, ep, tp, group, model),
              _panel("folded", world, devices_per_node, tp, ep, 1, group, model)]
    n_groups = max((len(p["groups"]) for p in panels if not p["error"]), default=1)
    return {"world": world, "devices_per_node": devices_per_node, "tp": tp, "ep": ep, "group": group % n_groups,
            "n_groups": n_groups, "model": model, "panels": panels}


def _mb(nbytes: float) -> str:
    if not nbytes:
        return "0 bytes"
    return f"{nbytes / 1e6:,.0f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:,.0f} kB"


def grid_caption(st: dict) -> str:
    parts = []
    for p in st["panels"]:
        if p["error"]:
            parts.append(f"{p['name']}: cannot be built ({p['error']})")
            continue
        parts.append(f"{p['name']} (etp {p['etp']}): ep group {_short(p['members'])} on {p['nodes_spanned']} "
                     f"node(s); rank {p['sender']} sends {_mb(p['cross_node_bytes'])} of its "
                     f"{_mb(p['dispatch_bytes'])} dispatch across nodes")
    m = st["model"]
    return (f"tp {st['tp']}, ep {st['ep']}, one MoE layer forward ({m['tokens']} tokens × d {m['d_model']} × "
            f"top-{m['k']}, {m['bytes_per_element']} B): " + " | ".join(parts))


def _short(ranks: list[int]) -> str:
    return "{" + (", ".join(map(str, ranks)) if len(ranks) <= 8 else
                  f"{ranks[0]}, {ranks[1]}, …, {ranks[-1]}") + "}"


def draw_grids(fig, st: dict) -> None:
    """Paint :func:`grid_state`: one panel per grid, a row of boxes per node, the highlighted ep group filled,
    its first rank's all-to-all joined to its peers: each peer in its node (green), and one arrow per other node
    it reaches (red, as thick as the peers there)."""
    import textwrap

    from matplotlib.patches import FancyArrowPatch, Rectangle
    D, world = st["devices_per_node"], st["world"]
    nodes = world // D
    fig.subplots_adjust(left=0.02, right=0.98, top=0.93, bottom=0.06, wspace=0.12)
    for i, p in enumerate(st["panels"]):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.set_xlim(-1.6, D + 0.2)
        ax.set_ylim(nodes + 1.3, -0.3)
        ax.set_aspect("equal")
        ax.set_axis_off()
        title = f"{p['name']}: etp = {p['etp']}" + ("" if p["error"] else f", ep groups of {st['ep']}")
        ax.set_title(title, fontsize=11, fontweight="bold")
        if p["error"]:
            ax.text(D / 2 - 0.7, nodes / 2, "cannot be built:\n" + "\n".join(textwrap.wrap(p["error"], 44)),
                    ha="center", va="center", fontsize=9, color=ACROSS)
            continue
        members, tp_group = set(p["members"]), set(p["tp_group"])
        for n in range(nodes):
            ax.add_patch(Rectangle((-0.1, n - 0.1), D + 0.2, 0.9, fill=False, edgecolor="#999999", lw=0.8))
            ax.text(-0.25, n + 0.35, f"node {n}", ha="right", va="center", fontsize=8, color="#555555")
            for d in range(D):
                r = n * D + d
                face = "#4C72B0" if r in members else ("#DCE6F2" if r in tp_group else "#F2F2F2")
                ax.add_patch(Rectangle((d + 0.05, n), 0.9, 0.7, facecolor=face, edgecolor="#333333", lw=0.5))
                ax.text(d + 0.5, n + 0.35, str(r), ha="center", va="center", fontsize=7,
                        color="white" if r in members else "#333333")
        s = p["sender"]
        at = lambda r: (r % D + 0.5, r // D + 0.35)   # noqa: E731
        remote: dict[int, list[int]] = {}
        for r, across in p["peers"]:
            if across:
                remote.setdefault(r // D, []).append(r)
            else:
                ax.add_patch(FancyArrowPatch(at(s), at(r), arrowstyle="-|>", mutation_scale=7, lw=1.0,
                                             color=IN_NODE, connectionstyle="arc3,rad=0.35", alpha=0.9))
        for n, peers in remote.items():
            ax.add_patch(FancyArrowPatch(at(s), at(peers[0]), arrowstyle="-|>", mutation_scale=8,
                                         lw=0.8 + 0.5 * len(peers), color=ACROSS, alpha=0.75,
                                         connectionstyle=f"arc3,rad={0.3 if n % 2 else -0.3}"))
        ax.text(D / 2 - 0.7, nodes + 0.05, f"rank {s}'s dispatch: {_mb(p['cross_node_bytes'])} of "
                f"{_mb(p['dispatch_bytes'])} across nodes\n({p['remote_peers']} of {len(p['members']) - 1} peers "
                f"on {len(remote)} other node(s))", ha="center", va="top", fontsize=9,
                color=ACROSS if p["cross_node_bytes"] else IN_NODE)
    fig.text(0.5, 0.01, "filled: the ep group   light blue: its first rank's tp group   arrows: that rank's "
             "all-to-all (green: inside its node; red: to another node, thicker for more peers there)",
             ha="center", fontsize=8, color="#444444")


def expert_grid_player(tp: int = 8, ep: int = 8, *, tps=(1, 2, 4, 8), eps=(2, 4, 8, 16, 32, 64), world: int = 64,
                       devices_per_node: int = 8, figsize=(12, 6.2)):
    """A :class:`~reference.widgets.player.Player` stepping through the ep groups of both grids, with
    dropdowns for tp and ep."""
    import ipywidgets as widgets

    from .player import Player

    controls = {"tp": widgets.Dropdown(options=list(tps), value=tp, description="tp",
                                       layout=widgets.Layout(width="130px")),
                "ep": widgets.Dropdown(options=list(eps), value=ep, description="ep",
                                       layout=widgets.Layout(width="130px"))}

    def build(tp, ep):
        n = grid_state(tp, ep, 0, world=world, devices_per_node=devices_per_node)["n_groups"]
        return (lambda step: grid_state(tp, ep, step, world=world, devices_per_node=devices_per_node)), n

    state_at, n = build(tp, ep)
    return Player(state_at, n, draw_grids, controls=controls, rebuild=build, caption=grid_caption, figsize=figsize,
                  title="The expert all-to-all, unfolded and folded (Play: each ep group in turn)")
