"""Activation recomputation in the composed tiny GPT (``ParallelGPT(..., recompute=)``, Korthikanti et al.
§5): the same training to 1e-12 as without it, less memory kept, and the messages of what runs again.

"full" runs each block's forward again in its backward: with sequence parallelism its two all-gathers
and two reduce-scatters (4·(tp−1)/tp·T·d·b per block and step on tp), and with context parallelism
the ring's K and V passes (2·(cp−1)·T·(d/tp)·b per block).  "selective" runs only the attention core
again: no tp message, the ring's K and V passes again.  Without a pipeline the planner's activations
(``Composition(recompute=)``, Korthikanti's "full" = the layers' inputs) are within 2.5 % of what each
rank keeps (the rest: what ``reference.compose.memory`` says the planner does not model).
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from reference import planner
from reference.compose import measured_bytes
from reference.compose.memory import planner_inputs
from reference.mesh import RankGrid
from tests.workers.recompute_workers import train_recompute

STEPS, BATCH = 2, 4
DENSE = dict(layers=2, d_model=16, heads=2, d_ff=32, seq_len=8)
CASES = [("tp+sp", {"tp": 2}, {"sequence_parallel": True}),
         ("cp×tp+sp", {"cp": 2, "tp": 2}, {"sequence_parallel": True}),
         ("tp×pp gpipe", {"tp": 2, "pp": 2}, {"num_microbatches": 2, "schedule": "gpipe"})]


@pytest.mark.parametrize("name,sizes,kw", CASES, ids=[c[0] for c in CASES])
def test_recomputation_trains_the_same_model_for_less_memory(world, name, sizes, kw):
    n = 1
    for v in sizes.values():
        n *= v
    grid = RankGrid(n, **sizes)
    runs = {rc: world(n).run(train_recompute, sizes, rc, STEPS, batch_size=BATCH, **kw, **DENSE)
            for rc in ("none", "selective", "full")}
    base = runs["none"]
    for rc in ("selective", "full"):
        res = runs[rc]
        assert max(abs(a - b) for a, b in zip(res.values[0]["losses"], base.values[0]["losses"])) <= 1e-12
        for name_, p in base.values[0]["params"].items():
            assert (res.values[0]["params"][name_] - p).abs().max().item() <= 1e-12, (rc, name_)
        for r in range(n):
            for name_, g in base.values[r]["grads"].items():
                assert (res.values[r]["grads"][name_] - g).abs().max().item() <= 1e-12, (rc, r, name_)
    T = BATCH // grid.dp * DENSE["seq_len"] // grid.cp
    d, b, tp, cp = DENSE["d_model"], 8, grid.tp, grid.cp
    for r in range(n):
        acts = {rc: runs[rc].values[r]["activations"] for rc in runs}
        assert acts["full"] < acts["selective"] < acts["none"], (r, acts)
        got = {rc: measured_bytes(runs[rc].trace, r, grid) for rc in runs}
        L_s = DENSE["layers"] // grid.pp
        again_tp = STEPS * (4 if kw.get("sequence_parallel") else 2 * 2) * (tp - 1) * T * d * b // tp * L_s
        again_cp = STEPS * 2 * (cp - 1) * T * (d // tp) * b * L_s
        assert got["full"].get("tp", 0) - got["none"].get("tp", 0) == again_tp, (r, got)
        assert got["selective"].get("tp", 0) == got["none"].get("tp", 0)
        for rc in ("selective", "full"):
            assert got[rc].get("cp", 0) - got["none"].get("cp", 0) == again_cp, (rc, r, got)
            assert got[rc].get("pp") == got["none"].get("pp") and got[rc].get("dp_cp") == got["none"].get("dp_cp")
        if grid.pp == 1:
            model, comp, cluster = planner_inputs(sizes, batch_size=BATCH, **kw, **DENSE)
            for rc, measured in acts.items():
                pl = planner.plan(model, cluster, replace(comp, recompute=rc))
                planned = pl.memory["activations"] + pl.memory["logits"]
                assert abs(planned / measured - 1) <= 0.025, (rc, r, planned, measured)


def test_full_recomputation_is_refused_with_moe_layers(world):
    from reference.launch import WorldError
    with pytest.raises(WorldError, match="MoE"):
        world(2).run(train_recompute, {"tp": 2}, "full", 1, batch_size=BATCH, num_experts=4, **DENSE)
