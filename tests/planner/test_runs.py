"""reference.planner against published training runs (reference.planner.runs): Narayanan et al. 2021
Tables 1 and 2 (step time, memory), Korthikanti et al. 2022 Table 2 (activation memory) and §4.2.3
(interleaving's first stage).  Every number below is computed from the rows' data and the model; a row
the planner cannot express raises in ``plan`` and fails here."""
from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from reference import planner as P
from reference.planner.collectives import collective_time
from reference.planner.runs import (HELD_OUT_RUNS, KORTHIKANTI_TABLE_2, NARAYANAN_TABLE_1, NARAYANAN_TABLE_2,
                                    PUBLISHED_RUNS, compare, gpt, narayanan_flops)

ROWS = compare()


def _errors() -> list[float]:
    return [r["error"] for r in ROWS]


def test_every_published_row_is_expressed_and_fits_in_memory():
    """The papers ran every row: the planner builds each composition and it fits (after the margin)."""
    assert len(ROWS) == len(NARAYANAN_TABLE_1) + len(NARAYANAN_TABLE_2) == 22
    for r in ROWS:
        pl = r["plan"]
        assert pl.fits, f"{r['run'].name}: {pl.summary()}"
        assert pl.cluster.first_principles and pl.mfu > 0 and pl.hfu > pl.mfu      # full recomputation
        print(f"{r['run'].name:42s} published {r['published']:8.2f} s  predicted {r['predicted']:8.2f} s  "
              f"{r['error']:+.1%}")


def test_parameter_counts_match_the_papers_column():
    """Table 1's parameter column is the paper's P = 12lh²(1 + 13/(12h) + (V+s)/(12lh)); the planner counts
    the same GPT (biases, LayerNorm, learned positions, tied embeddings): equal at the table's one decimal."""
    for run in NARAYANAN_TABLE_1:
        published = float(run.name.split(": ")[1].rstrip("B"))
        counted = sum(P.param_counts(run.model).values()) / 1e9
        assert abs(counted - published) <= 0.05, (run.name, counted)


def test_published_step_is_the_papers_flops_over_its_throughput():
    run = NARAYANAN_TABLE_1[-1]
    m = run.model
    flops = 96 * m.global_batch * 2048 * 128 * 25600 ** 2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600))
    assert narayanan_flops(m) == pytest.approx(flops, rel=1e-12)
    assert run.step_time == pytest.approx(flops / (163e12 * 3072), rel=1e-12)


def test_step_time_error_over_the_shipped_rows():
    """The issue's targets over the 22 rows: median |error| ≤ 10 %, worst ≤ 20 % (today 2.9 % and 12.1 %), with
    the runs' GEMMs at a CUDA 11 stack's benchmark (reference/planner/runs.py).  At today's shape-searched
    ceiling (the preset's) the same model is 11.1 % / 19.4 %: printed, so the sensitivity stays in sight."""
    errors = [abs(e) for e in _errors()]
    today = [abs(r["error"]) for r in compare(ceiling=P.PRESETS["a100-80gb-sxm"]["gemm_ceiling"])]
    print(f"median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}; at today's GEMM ceiling "
          f"{statistics.median(today):.1%}, {max(today):.1%}")
    assert statistics.median(errors) <= 0.10 and max(errors) <= 0.20
    assert statistics.median(today) > statistics.median(errors)         # the ceiling is what moved it


def test_held_out_h100_runs_within_the_targets():
    """19 runs the model was not developed against (NVIDIA's DGX Cloud recipes on H100, NeMo 24.09: GPT-3 175B,
    Llama 3.1 70B and 405B, Nemotron-4 340B, 64 to 2,304 GPUs), with every setting their own YAML states: median
    |error| ≤ 10 % and worst ≤ 20 % (today 7.4 % and 12.6 %, all still too fast).  Printed beside the same rows
    with TP communication counted as exposed: the overlap the recipes configure costs time but hides most of it,
    so the truth lies between the two columns."""
    rows = compare(HELD_OUT_RUNS)
    assert len(rows) == 19 and len({r["run"].name for r in rows}) == 19
    exposed = compare(HELD_OUT_RUNS, tp_overlap=False)
    for r, x in zip(rows, exposed):
        run, pl = r["run"], r["plan"]
        assert run.published_step is not None and run.comp.tp_overlap and run.comp.distributed_optimizer
        print(f"{run.name:42s} published {r['published']:6.2f} s  predicted {r['predicted']:6.2f} s  "
              f"{r['error']:+.1%}   TP exposed {x['error']:+.1%}   MFU {pl.mfu:.1%} (the recipe: "
              f"{run.tflops_per_gpu * 1e12 / run.cluster.flops:.1%})   {pl.total_memory / P.GB:.1f} GB")
        assert x["predicted"] > r["predicted"] and not x["run"].comp.tp_overlap   # the switch reaches the plan
    errors = [abs(r["error"]) for r in rows]
    print(f"median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}")
    assert statistics.median(errors) <= 0.10 and max(errors) <= 0.20


@pytest.mark.parametrize("run", HELD_OUT_RUNS, ids=lambda r: r.name)
def test_held_out_runs_fit_in_memory(run):
    """The recipes ran every row, so each fits — Nemotron-4 340B on 128 GPUs too, now that its optimizer state is
    counted as its recipe keeps it (bf16: 6 bytes per parameter, not 12) and an interleaved stage holds the layers
    of the chunk-forwards in flight, not an average chunk's."""
    pl = P.plan(run.model, run.cluster, run.comp)
    assert pl.fits, pl.summary()


def test_nemotron_fits_for_the_reason_its_recipe_states():
    """The same 128-GPU row with the fp32 optimizer state Megatron's own optimizer keeps (12 bytes) does not fit:
    the recipe's bf16 state (distributed_fused_adam, dtype bf16) is what makes room."""
    run = next(r for r in HELD_OUT_RUNS if r.name.startswith("Nemotron") and r.cluster.devices == 128)
    fp32_state = P.plan(replace(run.model, optimizer_bytes=12), run.cluster, run.comp)
    bf16_state = P.plan(run.model, run.cluster, run.comp)
    assert bf16_state.fits and not fp32_state.fits
    assert fp32_state.memory["optimizer"] == pytest.approx(2 * bf16_state.memory["optimizer"])


def test_error_no_longer_grows_with_model_size():
    """One fixed MFU (0.4, the simple model's default) cannot fit both ends of Table 1 (today +5 % at 1.7B, +50 %
    at 1T, as the papers reach 44 → 52 % of peak); shape-dependent efficiency keeps them less than half as far
    apart (−11 % and +4 %)."""
    first, last = ROWS[0], ROWS[len(NARAYANAN_TABLE_1) - 1]
    fixed = [P.plan(r["run"].model, replace(r["run"].cluster, mfu=0.4), r["run"].comp).step_time / r["published"] - 1
             for r in (first, last)]
    spread, fixed_spread = abs(first["error"] - last["error"]), abs(fixed[0] - fixed[1])
    print(f"1.7B {first['error']:+.1%}, 1T {last['error']:+.1%}; MFU 0.4: {fixed[0]:+.1%}, {fixed[1]:+.1%}")
    assert spread < 0.5 * fixed_spread, (spread, fixed_spread)


def test_zero3_at_micro_batch_1_is_communication_bound_and_ranks_like_the_paper():
    """Table 2: ZeRO-3 loses throughput as the micro-batch shrinks (144 → 88 → 44 teraFLOP/s); the
    planner's per-layer gathers are exposed once the layer's compute no longer hides them."""
    zero3 = [r for r in ROWS if r["run"].comp.zero == 3]
    for group in (zero3[:3], zero3[3:]):
        predicted = [narayanan_flops(r["run"].model) / (r["predicted"] * r["run"].cluster.devices) for r in group]
        published = [r["run"].tflops_per_gpu * 1e12 for r in group]
        assert predicted == sorted(predicted, reverse=True) and published == sorted(published, reverse=True)
        assert group[-1]["plan"].exposed["zero3"] > group[-1]["plan"].compute_time      # b = 1: gathers dominate
        assert group[0]["plan"].exposed["zero3"] < group[0]["plan"].compute_time


def test_every_settings_the_rows_state_reach_the_plan():
    """Table 1's scripts: local DDP (not overlapped) exposes the whole gradient sync; torch DDP hides all of
    it but its last bucket, the word embedding's gradient (computed last, 51,200 × 2,304 fp16 on row 1)."""
    local = next(r for r in ROWS if not r["run"].comp.dp_overlap and r["run"].comp.zero == 0)
    torch_ddp = ROWS[0]
    run = torch_ddp["run"]
    last = collective_time("all_reduce", 51200 * 2304 * 2, run.comp.dp, run.cluster, "inter")
    assert local["plan"].exposed["dp"] > 0
    assert torch_ddp["plan"].exposed["dp"] == pytest.approx(last)
    flipped = P.plan(local["run"].model, local["run"].cluster, P.with_sizes(local["run"].comp, dp_overlap=True))
    assert flipped.step_time < local["plan"].step_time


# ------------------------------------------------------------------ activation memory (Korthikanti et al. 2022)

@pytest.mark.parametrize("technique,uses_tp,sp,recompute,formula", KORTHIKANTI_TABLE_2,
                         ids=[row[0] for row in KORTHIKANTI_TABLE_2])
def test_activation_memory_equals_korthikanti_table_2(technique, uses_tp, sp, recompute, formula):
    """GPT-3 175B shape (Korthikanti Table 3: a 96, h 12,288, s 2,048, t 8), b = 1: the planner's bytes per
    layer equal the row's formula."""
    model = gpt("GPT-3 175B", 96, 12288, 96, batch=1, micro_batch=1, source="Korthikanti et al. 2022")
    t = 8 if uses_tp else 1
    got = P.activation_bytes_per_layer(model, tp=t, sequence_parallel=sp, recompute=recompute)
    assert got == pytest.approx(formula(2048, 1, 12288, 96, t), rel=1e-12), technique


@pytest.mark.parametrize("run", [r for r in NARAYANAN_TABLE_1 if r.comp.virtual_stages > 1], ids=lambda r: r.name)
def test_interleaved_first_stage_holds_korthikanti_factor(run):
    """§4.2.3: with v chunks per device the first stage holds L·(1 + (p−1)/(p·v)) layers' activations (without
    dropout: the embedding's dropout mask, one per chunk-0 forward in flight, is no layer's)."""
    comp = P.with_sizes(run.comp, recompute="none")
    model = replace(run.model, dropout=False)
    p, v = comp.pp, comp.virtual_stages
    first = P.plan(model, run.cluster, comp, stage=0).memory["activations"]
    per_layer = P.activation_bytes_per_layer(model, tp=comp.tp, sequence_parallel=False)
    factor = first / (per_layer * model.layers)
    assert factor == pytest.approx(1 + (p - 1) / (p * v), rel=0.02)
    plain = P.plan(model, run.cluster, P.with_sizes(comp, virtual_stages=1), stage=0).memory["activations"]
    assert plain / (per_layer * model.layers) == pytest.approx(1.0, rel=0.02)


# ------------------------------------------------------------------ the search against the papers' choices

@pytest.mark.parametrize("run", PUBLISHED_RUNS, ids=lambda r: r.name)
def test_search_finds_the_published_plan_or_explains_why_not(run):
    """The published composition is within 10 % of the search's best, or the planner names the terms that
    differ (with its numbers) and the measurement that would settle it."""
    published = P.plan(run.model, run.cluster, run.comp)
    ok, _ = P.search(run.model, run.cluster, zero_stages=(0, 1, 3), recompute=("full",),
                     virtual_stages=sorted({1, run.comp.virtual_stages}), base=run.comp, cp_sizes=(1,), top=3)
    best = ok[0]
    assert best.step_time <= published.step_time * (1 + 1e-9)          # the published plan is in the space
    assert all(pl.reasons and pl.reasons[0].startswith("fits") for pl in ok)
    if published.step_time > 1.10 * best.step_time:
        why = P.explain(published, best)
        terms = P.time_terms(published)
        assert any(line.strip().split(":")[0] in terms or line.strip().split(":")[0] in P.time_terms(best)
                   for line in why[1:-2]), why
        assert why[-1].startswith("  to settle it, measure")
