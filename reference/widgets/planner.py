"""Lecture 5c's planner widget: pick a model, a cluster and axis sizes; see the rank grid coloured by
group, memory per device against the device's capacity, and the bytes each axis moves per step.

    ┌──────────── rank grid: one row per node ────────────┐ ┌── memory per device ──┐
    │ node 0  [0][1][2][3][4][5][6][7]   colour = group   │ │ ▇ params ▇ grads ...  │
    │ node 1  [8] ...                      on the axis of │ │ ── capacity           │
    │  ...                                 this frame     │ ├── bytes per axis ─────┤
    └──────────────────────────────────────────────────────┘ │ tp ▇▇▇ intra 0.8 s    │
                                                             └───────────────────────┘

Each frame of the player colours the grid by one axis (tp, cp, dp, pp, etp, ep, edp: the ones with more
than one rank), so Play walks through the groups a rank belongs to.  One row per node makes the
bandwidth argument visible: tensor groups inside a row (fast links), pipeline groups across rows.

:func:`planner_state` is the pure state function (tested); :func:`draw_planner` paints it;
:func:`planner_player` wraps both in the course's :class:`~reference.widgets.player.Player`.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..mesh import RankGrid
from ..planner import GB, Cluster, Composition, Model, plan

__all__ = ["planner_state", "shown_axes", "draw_planner", "planner_caption", "planner_player"]

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "recompute", "logits")
MEMORY_COLOURS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52",
                  "recompute": "#8172B3", "logits": "#937860"}
PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C",
           "#CCB974", "#64B5CD", "#1F77B4", "#FF7F0E")


def shown_axes(comp: Composition) -> list[str]:
    """The axes a frame can colour by: those with more than one rank per group (tp if none)."""
    etp = comp.expert_tp
    sizes = dict(tp=comp.tp, cp=comp.cp, dp=comp.dp, pp=comp.pp, ep=comp.ep,
                 etp=etp if comp.ep > 1 and etp != comp.tp else 1,      # shown when it is not the dense tp
                 edp=comp.tp * comp.cp * comp.dp // max(etp * comp.ep, 1))
    axes = [a for a in ("tp", "cp", "dp", "pp", "etp", "ep", "edp") if sizes[a] > 1 and (a != "edp" or comp.ep > 1)]
    return axes or ["tp"]


def planner_state(model: Model, cluster: Cluster, comp: Composition, axis: str = "tp", *,
                  max_nodes: int = 8) -> dict[str, Any]:
    """What the widget shows for one composition, coloured by ``axis``.

    Returns a dict: ``error`` (the ValueError text when the composition is impossible, else None),
    ``nodes`` (rows of global ranks, one per node shown), ``rank0_group``, ``group`` (rank → index of its group on
    ``axis``), ``nodes_total``, ``axis``, ``memory`` (part → bytes), ``capacity``, ``fits``,
    ``comm`` (axis → (bytes, seconds, link)), ``bubble``, ``step_time``, ``bottleneck``,
    ``reasons``, ``title``.
    """
    state: dict[str, Any] = dict(axis=axis, title=f"{model.name} on {cluster.name}: {comp}", error=None,
                                 capacity=cluster.memory)
    try:
        pl = plan(model, cluster, comp)
    except ValueError as e:
        state["error"] = str(e)
        return state
    grid = RankGrid(cluster.devices, dp=comp.dp, tp=comp.tp, pp=comp.pp, cp=comp.cp, ep=comp.ep, etp=comp.etp)
    per_node = cluster.devices_per_node
    nodes_total = -(-cluster.devices // per_node)
    shown = min(nodes_total, max_nodes)
    ranks = [r for r in range(min(cluster.devices, shown * per_node))]
    group = {}
    index: dict[int, int] = {}                     # smallest member → colour index, in order of appearance
    for r in ranks:
        first = grid.ranks(axis, r)[0]
        group[r] = index.setdefault(first, len(index))
    first_group = grid.ranks(axis, 0)
    state.update(
        rank0_group=first_group,
        nodes=[ranks[i * per_node:(i + 1) * per_node] for i in range(shown)], nodes_total=nodes_total,
        group=group, group_size=grid.sizes[axis], crosses_nodes=grid.crosses_nodes(axis, per_node),
        describe=RankGrid.describe(axis),
        memory={k: pl.memory.get(k, 0.0) for k in MEMORY_PARTS}, fits=pl.fits,
        comm={k: (pl.comm_bytes[k], pl.comm_time[k], pl.link[k]) for k in pl.comm_bytes},
        bubble=pl.bubble, step_time=pl.step_time, compute_time=pl.compute_time, bottleneck=pl.bottleneck,
        reasons=list(pl.reasons), micro_batches=pl.micro_batches)
    return state


def planner_caption(st: dict) -> str:
    if st["error"]:
        return f"cannot build: {st['error']}"
    where = "crosses nodes (slow links)" if st["crosses_nodes"] else "inside a node (fast links)"
    return (f"{st['axis']} groups of {st['group_size']}: {st['describe']}; {where}. "
            f"Step ≈ {st['step_time']:.3g} s, bubble {st['bubble']:.0%}; runs out first: {st['bottleneck']}")


def draw_planner(fig, st: dict) -> None:
    """Paint :func:`planner_state`: the rank grid by node, memory bars, bytes per axis."""
    from matplotlib.patches import Rectangle

    if st["error"]:
        ax = fig.add_subplot(111)
        ax.set_axis_off()
        ax.text(0.5, 0.5, "cannot build this composition:\n" + st["error"], ha="center", va="center",
                fontsize=11, color="#C44E52", wrap=True)
        return
    grid_ax = fig.add_axes([0.02, 0.08, 0.55, 0.8])
    mem_ax = fig.add_axes([0.66, 0.56, 0.16, 0.32])
    com_ax = fig.add_axes([0.66, 0.08, 0.31, 0.34])
    # rank grid: one row per node
    nodes = st["nodes"]
    cols = max(len(n) for n in nodes)
    grid_ax.set_xlim(-1.6, cols)
    grid_ax.set_ylim(len(nodes) + 0.2, -0.2)
    grid_ax.set_axis_off()
    small = cols > 16
    for y, row in enumerate(nodes):
        grid_ax.text(-0.2, y + 0.45, f"node {y}", ha="right", va="center", fontsize=7)
        for x, r in enumerate(row):
            colour = PALETTE[st["group"][r] % len(PALETTE)]
            grid_ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.8, facecolor=colour, edgecolor="white"))
            if not small:
                grid_ax.text(x + 0.5, y + 0.45, str(r), ha="center", va="center", fontsize=7, color="white")
    more = f" (nodes 0–{len(nodes) - 1} of {st['nodes_total']})" if st["nodes_total"] > len(nodes) else ""
    g0 = st["rank0_group"]
    members = ", ".join(map(str, g0[:6])) + (", …" if len(g0) > 6 else "")
    grid_ax.set_title(f"{st['axis']} groups{more}; rank 0's: {{{members}}} ({len(g0)} ranks)", fontsize=9)
    fig.suptitle(st["title"], fontsize=10)
    # memory per device, stacked against the capacity
    bottom = 0.0
    for part in MEMORY_PARTS:
        v = st["memory"][part] / GB
        if v > 0:
            mem_ax.bar([0], [v], bottom=bottom, color=MEMORY_COLOURS[part], label=f"{part} {v:.1f}")
            bottom += v
    cap = st["capacity"] / GB
    mem_ax.axhline(cap, color="black", ls="--", lw=1)
    mem_ax.text(-0.55, cap, f"capacity {cap:.0f} GB", va="bottom", fontsize=7)
    mem_ax.set_xlim(-0.6, 0.6)
    mem_ax.set_ylim(0, max(bottom, cap) * 1.15)
    mem_ax.set_xticks([])
    mem_ax.set_ylabel("GB per device", fontsize=8)
    mem_ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    mem_ax.set_title("memory per device: " + ("fits" if st["fits"] else "DOES NOT FIT"), fontsize=9,
                     color="black" if st["fits"] else "#C44E52")
    # bytes per axis per step, coloured by link
    names = list(st["comm"])
    if names:
        vals = [st["comm"][k][0] / GB for k in names]
        colours = ["#55A868" if st["comm"][k][2] == "intra" else "#C44E52" for k in names]
        com_ax.barh(names, vals, color=colours)
        for i, k in enumerate(names):
            com_ax.text(vals[i], i, f" {st['comm'][k][1]:.2g} s {st['comm'][k][2]}", va="center", fontsize=7)
        com_ax.set_xlim(0, max(vals) * 1.6)
    com_ax.set_xlabel("GB sent per device per step (green: inside a node)", fontsize=8)
    com_ax.tick_params(labelsize=8)
    com_ax.set_title("communication per axis", fontsize=9)


def planner_player(models: dict[str, Model], clusters: dict[str, Cluster], *, model: str | None = None,
                   cluster: str | None = None, comp: Composition | None = None, figsize=(11, 5)):
    """A Player whose controls pick model, cluster, tp, pp, cp, ep, the experts' tensor size etp ("= tp": cut like
    the MLP; 1: whole experts, the expert grid folded), ZeRO stage and recomputation (dp = devices / (tp·pp·cp));
    its frames walk through the axes of the composition."""
    import ipywidgets as widgets

    from .player import Player

    comp = comp or Composition()
    model = model or next(iter(models))
    cluster = cluster or next(iter(clusters))
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]

    def choice(desc, options, value, width="120px"):
        return widgets.Dropdown(options=options, value=value, description=desc,
                                layout=widgets.Layout(width=width), style={"description_width": "initial"})
    controls = {
        "model": choice("model", list(models), model, "260px"),
        "cluster": choice("cluster", list(clusters), cluster, "260px"),
        "tp": choice("tp", sizes[:6], comp.tp), "pp": choice("pp", sizes[:8], comp.pp),
        "cp": choice("cp", sizes[:9], comp.cp), "ep": choice("ep", sizes, comp.ep),
        "etp": choice("etp", [("= tp", 0)] + [(str(x), x) for x in sizes[:4]], comp.etp or 0),   # 0: the dense tp
        "zero": choice("ZeRO", [0, 1, 2, 3], comp.zero),
        "recompute": choice("recompute", ["none", "selective", "full"], comp.recompute, "170px"),
    }

    def build(model, cluster, tp, pp, cp, ep, etp, zero, recompute):
        m, c = models[model], clusters[cluster]
        dp = max(1, c.devices // (tp * pp * cp))
        # the starting plan's interleaving and stage layout (e.g. Llama 3's embedding-only first chunk) hold while
        # its pipeline does; another pp drops them
        same_pp = pp == comp.pp
        new = replace(comp, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp or None, zero=zero, recompute=recompute,
                      virtual_stages=comp.virtual_stages if same_pp else 1,
                      stage_layout=comp.stage_layout if same_pp else None, micro_batches=None)
        axes = shown_axes(new)
        cache: dict[int, dict] = {}

        def state_at(step: int) -> dict:
            if step not in cache:
                cache[step] = planner_state(m, c, new, axes[min(step, len(axes) - 1)])
            return cache[step]
        return state_at, len(axes)

    state_at, n = build(model, cluster, comp.tp, comp.pp, comp.cp, comp.ep, comp.etp or 0, comp.zero, comp.recompute)
    return Player(state_at, n, draw_planner, controls=controls, rebuild=build, caption=planner_caption,
                  figsize=figsize, title="Where does it run out of room?", interval_ms=1500)
