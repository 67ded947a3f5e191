"""The lecture 5b notebook's runs for §8, experts at frontier scale (recorded for the student release, see
``reference.notebook.recorded``): fine-grained experts' costs, the nodes a token reaches, the time cost of an
imbalanced load, the all-to-all hidden behind the experts, the bytes a folded expert grid keeps inside a node, and
the loss-free bias counted over too few ranks.  Their measurements and rank functions are in
:mod:`.frontier_workers`; the balancing runs over training are :func:`.lecture.balance_over_training`.
"""
from __future__ import annotations

import torch

from ..notebook.recorded import live_world, recordable

_NB = dict(ignore=("worlds",))

FINE_GRAINED = ({"num_experts": 8, "k": 2, "expert_ffn": 256},                         # Mixtral-like: 8 experts, top-2
                {"num_experts": 32, "k": 8, "expert_ffn": 64},                         # each cut in 4, top-8
                {"num_experts": 32, "k": 7, "expert_ffn": 64, "shared_experts": 1})    # one of the 8 always on


@recordable("05b.fine_grained", needs=("5b.1", "5b.2"), **_NB)
def fine_grained(configs: tuple = FINE_GRAINED, d_model: int = 64) -> list[dict]:
    """:func:`.frontier_workers.fine_grained_costs` of each configuration (one process)."""
    from .frontier_workers import fine_grained_costs
    return fine_grained_costs(list(configs), d_model=d_model)


@recordable("05b.nodes_per_token", needs=("5b.1",), **_NB)
def nodes_per_token(num_experts: int = 64, nodes: int = 8, k: int = 8, max_nodes: int = 4) -> dict:
    """:func:`.frontier_workers.nodes_per_token`: the nodes a token's experts span, without and with a limit M."""
    from .frontier_workers import nodes_per_token as count
    return count(num_experts=num_experts, nodes=nodes, k=k, max_nodes=max_nodes)


IMBALANCE = {"d_model": 128, "d_ff": 1024, "num_experts": 8, "k": 2, "tokens": 512}


def imbalance_story(rows: list[dict]) -> list[str]:
    """How an :func:`imbalance_cost` result contradicts lecture 5b §8.3: the lightest rank must wait longer in the
    combine at the largest push than any rank waited without one, and the busiest rank's experts must take more CPU
    time.  (The busiest rank's own wait is not compared: it arrives last and waits a fraction of a millisecond.)"""
    first, last = rows[0], rows[-1]
    broken = []
    lightest = min(range(len(last["rows"])), key=last["rows"].__getitem__)
    if last["combine_s"][lightest] <= max(first["combine_s"]):
        broken.append("the lightest rank did not wait longer in the combine as the load skewed")
    if max(last["experts_cpu_s"]) <= max(first["experts_cpu_s"]):
        broken.append("the busiest rank's experts did not take more CPU time")
    return broken


@recordable("05b.imbalance_cost", needs=("5b.1",), timed=True, story=imbalance_story, **_NB)
def imbalance_cost(skews: tuple = (0.0, 0.05, 0.1, 0.2), reps: int = 3, worlds: dict | None = None) -> list[dict]:
    """The dropless expert-parallel layer on 2 ranks (:data:`IMBALANCE`, float32), its choices pushed towards
    rank 0's experts by each bias in ``skews`` (:func:`.frontier_workers.skewing_bias`): per skew, the best of
    ``reps`` steps (forward + backward) — the rows each rank's experts received, max/mean of them, each rank's
    expert CPU time (forward), the wall time of its experts' forward and of its combine all-to-all (trace: the
    wait for the busiest rank), and the step (the slowest rank's wall time)."""
    from .frontier_workers import ep_step
    rows = []
    with live_world(2, worlds) as w:
        w.run(ep_step, IMBALANCE)                                                   # warm-up
        for skew in skews:
            best = None
            for _ in range(reps):
                res = w.run(ep_step, IMBALANCE, skew=skew)
                step = max(v["seconds"] for v in res.values)
                if best is None or step < best["step_s"]:
                    best = {"skew": skew, "step_s": step, **_per_rank(res, IMBALANCE["num_experts"])}
            rows.append(best)
    return rows


def _per_rank(res, num_experts: int) -> dict:
    """Rows each rank's experts received (from every rank's choices), max/mean, and per rank the forward's expert
    CPU time, and from the trace the wall time of its experts' forward and of its combine all-to-all (which waits
    for the busiest rank)."""
    load = torch.tensor([v["tokens_per_expert"] for v in res.values]).sum(0)
    W = len(res.values)
    rows = load.view(W, num_experts // W).sum(1).tolist()
    combine, experts = [0.0] * W, [0.0] * W
    for e in res.trace:
        if e.op == "all_to_all" and e.meta.get("what") == "combine":
            combine[e.rank] += e.end - e.start
        elif e.op == "compute" and e.meta.get("what") == "experts":
            experts[e.rank] += e.end - e.start
    return {"rows": rows, "max_over_mean": max(rows) / (sum(rows) / W),
            "experts_cpu_s": [v["experts_cpu_s"] for v in res.values], "experts_s": experts, "combine_s": combine}


OVERLAP = {"d_model": 128, "d_ff": 256, "num_experts": 8, "k": 2, "tokens": 1024}


def overlap_story(result: dict) -> list[str]:
    """How an :func:`overlap_hidden` result contradicts lecture 5b §8.6: the plain layer hides nothing, the overlapped
    one a real share (at least 10 %) of its all-to-all time."""
    if result["plain"]["hidden"] > 0.0 or result["overlapped"]["hidden"] < 0.1:
        return ["the overlapped halves hid less than a tenth of the all-to-all time, or the plain layer hid some"]
    return []


@recordable("05b.overlap_hidden", needs=("5b.1",), timed=True, story=overlap_story, **_NB)
def overlap_hidden(reps: int = 3, worlds: dict | None = None) -> dict:
    """The dropless expert-parallel layer on 2 ranks (:data:`OVERLAP`, float32), plain and in two overlapped
    halves: for each, the median step (forward + backward) over ``reps`` and the fraction of the dispatch and
    combine all-to-alls' time hidden behind the experts (:func:`.overlap.hidden_fraction`, from the trace); and
    the last overlapped step's trace (for Perfetto: ``Trace.to_chrome``)."""
    import statistics

    from .frontier_workers import ep_step
    from .overlap import hidden_fraction
    out = {}
    with live_world(2, worlds) as w:
        for overlap in (False, True):
            w.run(ep_step, OVERLAP, overlap=overlap)                               # warm-up
            steps, hidden = [], []
            for _ in range(reps):
                res = w.run(ep_step, OVERLAP, overlap=overlap)
                steps.append(max(v["seconds"] for v in res.values))
                hidden.append(hidden_fraction(res.trace))
            out["overlapped" if overlap else "plain"] = {
                "step_s": statistics.median(steps), "hidden": statistics.median(h["fraction"] for h in hidden),
                "all_to_all_s": statistics.median(h["all_to_all_s"] for h in hidden),
                "all_to_alls": hidden[-1]["count"]}
            out["trace" if overlap else "plain_trace"] = res.trace
    return out


FOLDING = {"d_model": 64, "d_ff": 128, "num_experts": 8, "k": 2, "tokens": 256}


@recordable("05b.folding_bytes", needs=("5b.1", "5b.2"), **_NB)
def folding_bytes(worlds: dict | None = None) -> dict:
    """One dropless expert-parallel forward on 4 ranks in two "nodes" of 2 (float32, :data:`FOLDING`), over the
    ep group of ``RankGrid(4, tp=2, dp=2, ep=2)`` unfolded (etp = tp = 2) and folded (etp = 1): per grid, the
    ep groups, the bytes each rank's dispatch sent to the other node (trace) and the formula's
    (:func:`.placement.cross_node_bytes`, balanced routing)."""
    from ..mesh import RankGrid
    from .frontier_workers import folded_dispatch
    from .placement import cross_node_bytes, measured_cross_node_bytes
    out = {}
    with live_world(4, worlds) as w:
        for name, etp in (("unfolded", 2), ("folded", 1)):
            sizes = dict(tp=2, dp=2, ep=2, etp=etp)
            grid = RankGrid(4, **sizes)
            res = w.run(folded_dispatch, sizes, FOLDING)
            measured = measured_cross_node_bytes(res.trace, grid, 2)
            formula = cross_node_bytes(grid, 2, tokens=FOLDING["tokens"], d_model=FOLDING["d_model"],
                                       k=FOLDING["k"], bytes_per_element=4)
            out[name] = {"ep_groups": grid.all_groups("ep"), "measured": [measured.get(r, 0) for r in range(4)],
                         "formula": formula["cross_node_bytes"], "dispatch_bytes": formula["dispatch_bytes"]}
    return out


@recordable("05b.bias_drift", needs=("5b.5",), **_NB)
def bias_drift(steps: int = 20, worlds: dict | None = None) -> list[dict]:
    """:func:`.frontier_workers.bias_drift` on 4 ranks (ep = 2): each rank's bias after ``steps`` loss-free updates
    counted over its ep group, and over every rank."""
    from .frontier_workers import bias_drift as drift
    with live_world(4, worlds) as w:
        return w.run(drift, steps=steps).values
