"""The lecture 6 notebook's runs (recorded for the student release, see ``reference.notebook.recorded``): the six
hangs and their fixes, PyTorch's tools on them, the nine planted silent bugs beside one process, the search
for the first divergence, and the given run of exercise 6.3.  Their programs are in :mod:`.hangs`,
:mod:`.plants` and :mod:`.accumulate`; the figures below draw what they return.
"""
from __future__ import annotations

import threading

from ..compose.lecture import COMPOSED_NEEDS
from ..notebook.recorded import live_world, recordable
from .hangs import CASES, default_faulty, run_hangs

__all__ = ["GALLERY_RANKS", "hang_gallery", "tools_gallery", "plant_gallery", "divergence_map", "given_run_search",
           "fixed_run_search", "bisection_cost", "hang_figure", "map_figure", "PLANT_NEEDS"]

# a planted run goes through every layer of a composed step (lecture 5c's) and lecture 4a's blocks; its
# search through first_divergence (6.2): the release replays the recording until they all pass
PLANT_NEEDS = COMPOSED_NEEDS + ("6.2",)

_KEPT = dict(ignore=("worlds",))     # the notebook's kept worlds are no part of what a recording is matched by

GALLERY_RANKS = {"order": 3, "skip": 2, "p2p": 2, "pipeline": 3, "group": 3, "shape": 2}


@recordable("06.hang_gallery", **_KEPT)
def hang_gallery(timeout: float = 2.0, worlds: dict | None = None) -> dict:
    """Each of the six cases with its bug on its default ranks: six worlds of 2 or 3 ranks (:data:`GALLERY_RANKS`)
    started and run together, each rank with the flight recorder on; while they hang, the flight recorder of
    "order" is dumped and ``py-spy dump`` reads the stacks of "pipeline"'s ranks.  Then each case fixed, on 2 ranks
    (a kept world, ``worlds[2]``).  {case: {"report", "faulty", "fixed"}, "flight_recorder": {rank: entries},
    "py_spy": {"dumps", "frames", "innermost"}}."""
    import tempfile

    from . import tools
    from .hangs import hang_program
    spy: dict = {}
    with tempfile.TemporaryDirectory(prefix="flight-recorder-") as fr_dir, \
            tempfile.TemporaryDirectory(prefix="py-spy-") as pid_dir:
        extra = {"order": {"flight_recorder_dir": fr_dir, "dump_after": 0.3, "world_timeout": timeout + 1},
                 "pipeline": {"num_microbatches": 1, "pid_dir": pid_dir, "world_timeout": timeout + 1.5}}
        bugs = [(n, GALLERY_RANKS[n], default_faulty(n, GALLERY_RANKS[n]),
                 {**extra.get(n, {}), "env": tools.flight_recorder_env()}) for n in CASES]
        # the pid files appear when the program starts, after every world has started: wait as long as that takes
        watcher = threading.Thread(target=lambda: spy.update(tools.spy_on(pid_dir, GALLERY_RANKS["pipeline"],
                                                                           limit=180.0)))
        watcher.start()
        try:
            out = run_hangs(bugs, timeout)
        finally:
            watcher.join()
        recorder = tools.read_flight_recorder(fr_dir, GALLERY_RANKS["order"])
    fixed = {}
    with live_world(2, worlds) as w:
        for name in CASES:
            fixed[name] = {"finished": True, "values": w.run(hang_program, name, default_faulty(name, 2), fixed=True,
                                                             **({"num_microbatches": 1} if name == "pipeline"
                                                                else {})).values}
    gallery = {n: {"report": out[i], "faulty": list(bugs[i][2]), "fixed": fixed[n]} for i, n in enumerate(CASES)}
    return {"cases": gallery, "flight_recorder": recorder, "py_spy": spy}


@recordable("06.tools_gallery")
def tools_gallery(timeout: float = 3.0) -> dict:
    """The other tools on the same hangs, run together on 2 ranks each: TORCH_DISTRIBUTED_DEBUG=DETAIL on
    "order" and "shape", a 1-second process-group timeout on "skip" (:mod:`.tools`'s reports)."""
    from . import tools
    cases = [("order", 2, default_faulty("order", 2), {"env": tools.DETAIL}),
             ("shape", 2, default_faulty("shape", 2), {"env": tools.DETAIL}),
             ("skip", 2, default_faulty("skip", 2), {"group_timeout": 1.0, "world_timeout": 6.0})]
    out = run_hangs(cases, timeout)
    return {"detail_order": out[0], "detail_shape": out[1], "timeout_skip": out[2]}


def _plant_runs(name: str, world, steps: int):
    from .plants import PLANTS
    from .runs import record_many, record_single
    p = PLANTS[name]
    run = dict(p.run)
    run["steps"] = max(run.get("steps", 2), steps)
    single = record_single(run.get("family", "gpt"), run["steps"],
                           **{k: v for k, v in run.items() if k in ("clip_grad_norm", "num_experts", "top_k",
                                                                    "moe_every")})
    parallel = record_many([dict(run, plant=name, where=p.where)], world.world_size, world)[0]
    return parallel, single


@recordable("06.plant_gallery", needs=PLANT_NEEDS, **_KEPT)
def plant_gallery(steps: int = 3, worlds: dict | None = None) -> dict:
    """Each plant of :data:`.plants.PLANTS` on its grid (2 ranks) beside one process for ``steps`` steps:
    {plant: {"losses", "single_losses", "grad_norms" (per rank, when clipping), "single_norms",
    "divergence" (first_divergence, as a dict), "expect"}}."""
    from dataclasses import asdict

    from . import first_divergence
    from .plants import PLANTS
    out = {}
    with live_world(2, worlds) as w:
        for name, p in PLANTS.items():
            parallel, single = _plant_runs(name, w, steps)
            d = first_divergence(parallel, single)
            out[name] = {"losses": parallel.info["losses"], "single_losses": single.info["losses"],
                         "grad_norms": parallel.info["grad_norms"], "single_norms": single.info["grad_norms"],
                         "divergence": asdict(d) if d else None, "axis": p.axis, "title": p.title,
                         "symptom": p.symptom}
    return out


def _map(parallel, single, atol: float = 1e-9, rtol: float = 1e-6) -> list[dict]:
    """Every record of ``single`` in order, with the largest |difference| of ``parallel``'s pieces."""
    rows = []
    for rec in single.records:
        other = parallel.get(rec.key)
        if other is None:
            continue
        whole, worst, ranks = rec.whole(), 0.0, []
        for rank, offsets, block in other.pieces:
            want = whole[tuple(slice(o, o + n) for o, n in zip(offsets, block.shape))]
            diff = float((block - want).abs().nan_to_num(nan=float("inf")).max()) if block.numel() else 0.0
            scale = float(want.abs().max()) if want.numel() else 0.0
            if diff > atol + rtol * scale:
                ranks.append(rank)
            worst = max(worst, diff)
        rows.append({"step": rec.step, "phase": rec.phase, "module": rec.module, "tensor": rec.tensor,
                     "diff": worst, "ranks": sorted(set(ranks))})
    return rows


@recordable("06.divergence_map", needs=COMPOSED_NEEDS, variants=[{"plant": "cp_causal_block"}],
            **_KEPT)
def divergence_map(plant: str = "tp_no_f", steps: int = 2, worlds: dict | None = None) -> list[dict]:
    """The largest |parallel − single| of every record of a planted run, in the order one process made
    them (what :func:`map_figure` draws): where the runs part, and how the difference spreads."""
    with live_world(2, worlds) as w:
        parallel, single = _plant_runs(plant, w, steps)
    return _map(parallel, single)


def _accumulation_search(step: str, worlds: dict | None) -> dict:
    from dataclasses import asdict

    from . import first_divergence
    from .accumulate import record_accumulation, record_accumulation_single
    from .runs import merge
    single = record_accumulation_single(steps=2)
    with live_world(2, worlds) as w:
        parallel = merge(w.run(record_accumulation, step, steps=2).values)
    d = first_divergence(parallel, single)
    return {"losses": parallel.info["losses"], "single_losses": single.info["losses"],
            "divergence": asdict(d) if d else None}


@recordable("06.given_run_search", needs=("6.2",), **_KEPT)
def given_run_search(worlds: dict | None = None) -> dict:
    """Exercise 6.3's given step on 2 ranks × 2 micro-batches of padded documents, searched against one
    process with first_divergence."""
    return _accumulation_search("given", worlds)


@recordable("06.fixed_run_search", needs=("6.2", "6.3"), **_KEPT)
def fixed_run_search(worlds: dict | None = None) -> dict:
    """The same with the repaired step (exercise 6.3): no divergence."""
    return _accumulation_search("fixed", worlds)


@recordable("06.bisection_cost", needs=COMPOSED_NEEDS, **_KEPT)
def bisection_cost(steps: int = 8, bug_step: int = 6, worlds: dict | None = None) -> dict:
    """A run of ``steps`` steps whose dense gradients are summed (dp_sum) from step ``bug_step`` on: how
    many records the bisection compares before it answers, against walking every record from step 0."""
    from . import first_divergence
    from .records import Run
    from .runs import record_many, record_single
    single = record_single("gpt", steps)
    with live_world(2, worlds) as w:
        parallel = record_many([dict(sizes={"dp": 2}, steps=steps, plant="dp_sum", where={"step": bug_step})], 2,
                               w)[0]
    fetched = []

    class Counting(Run):
        def get(self, key):
            fetched.append(tuple(key))
            return super().get(key)
    counting = Counting(parallel.records, parallel.world_size, parallel.info)
    d = first_divergence(counting, single)
    first = next(i for i, r in enumerate(single.records) if r.key == (d.step, d.phase, d.module, d.tensor))
    return {"steps": steps, "bug_step": bug_step, "records": len(single.records), "compared": len(fetched),
            "linear": first + 1, "divergence": (d.step, d.phase, d.module, d.tensor), "rows": _map(parallel, single)}


# ----------------------------------------------------------------------------------------------
# Figures (matplotlib; headless runs keep them as static images)


_STATE_COLOURS = {"blocked": "#d62728", "running": "#ff7f0e", "finished": "#2ca02c", "raised": "#9467bd",
                  "died": "#000000", "peer gone": "#7f7f7f"}


def hang_figure(gallery: dict):
    """One row per case, one box per rank coloured by its state in the report, what it waits in beneath."""
    import matplotlib.pyplot as plt
    names = list(gallery)
    W = max(g["report"].get("world_size", 0) for g in gallery.values())
    fig, ax = plt.subplots(figsize=(2.6 * W + 2.2, 0.78 * len(names) + 0.6))
    for y, name in enumerate(reversed(names)):
        report = gallery[name]["report"]
        ax.text(-0.15, y, name, ha="right", va="center", fontsize=10, fontweight="bold")
        for r, v in sorted(report.get("ranks", {}).items(), key=lambda kv: int(kv[0])):
            r = int(r)
            colour = _STATE_COLOURS.get(v["state"], "#cccccc")
            at_fault = r in gallery[name]["faulty"]
            ax.add_patch(plt.Rectangle((r + 0.04, y - 0.36), 0.92, 0.72, color=colour, alpha=0.85,
                                       lw=2.5 if at_fault else 0, ec="black"))
            words = v["blocked_in"] or v["state"]
            ax.text(r + 0.5, y + 0.12, f"rank {r}" + (" ✱" if at_fault else ""), ha="center", va="center",
                    color="white", fontsize=8.5, fontweight="bold")
            ax.text(r + 0.5, y - 0.17, words[:30], ha="center", va="center", color="white", fontsize=7)
    ax.set_xlim(-1.6, W)
    ax.set_ylim(-0.6, len(names) - 0.4)
    ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _STATE_COLOURS.values()]
    ax.legend(handles, list(_STATE_COLOURS), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=6, fontsize=8,
              frameon=False)
    ax.set_title("what each rank was doing when the course's timeout fired (✱ = where the bug was planted)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def map_figure(rows: list[dict], title: str = ""):
    """The largest |difference| of every record, in order (log scale), coloured by phase; the first record
    past the tolerance marked."""
    import matplotlib.pyplot as plt
    colours = {"forward": "#1f77b4", "backward": "#d62728", "grad": "#2ca02c", "param": "#9467bd"}
    fig, ax = plt.subplots(figsize=(11, 3.2))
    floor = 1e-18
    for phase, c in colours.items():
        xs = [i for i, r in enumerate(rows) if r["phase"] == phase]
        ax.scatter(xs, [max(rows[i]["diff"], floor) for i in xs], s=9, color=c, label=phase)
    first = next((i for i, r in enumerate(rows) if r["ranks"]), None)
    if first is not None:
        r = rows[first]
        ax.axvline(first, color="black", lw=0.8, ls="--")
        ax.annotate(f"first: step {r['step']} {r['phase']}\n{r['module']} {r['tensor']} (ranks {r['ranks']})",
                    (first, max(r["diff"], floor)), xytext=(8, -30), textcoords="offset points", fontsize=8)
    for s in sorted({r["step"] for r in rows})[1:]:
        ax.axvline(next(i for i, r in enumerate(rows) if r["step"] == s), color="grey", lw=0.5)
    ax.set_yscale("log")
    ax.set_xlabel("record, in the order one process made them (grey lines: a new step)")
    ax.set_ylabel("max |parallel − single|")
    ax.legend(fontsize=8, ncol=4, loc="upper left")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
