"""The first-principles time model (reference.planner: hardware, kernels, collectives, layout, timing):
each formula against numbers worked by hand, each switch changing what it should, and bad input
raising a ValueError that names it.  Pure arithmetic."""
from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from reference import planner as P
from reference.gpt import GPTConfig
from reference.planner.collectives import collective_time
from reference.planner.hardware import PRESETS
from reference.planner.kernels import gemm_efficiency, gemm_time
from reference.planner.layout import bubble_units, chunk_layers, chunks_in_flight

A100 = P.Cluster.preset("a100-80gb-sxm", 64)
GPT = P.Model("GPT 13B-ish", layers=40, hidden=5120, heads=40, kv_heads=40, ffn=4 * 5120, vocab=51200,
              seq_len=2048, micro_batch=1, global_batch=256, biases=True, tied_embeddings=True)
LLAMA = P.Model("Llama-like", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                seq_len=8192, global_batch=64, gated_ffn=True, dropout=False)


# ------------------------------------------------------------------ presets

def test_presets_carry_their_datasheet_figures_and_overrides():
    a, h = P.Cluster.preset("a100-80gb-sxm", 16), P.preset("h100-80gb-sxm", 16)
    assert (a.flops, a.hbm_bw, a.memory, a.sms, a.devices_per_node) == (312e12, 2039e9, 80e9, 108, 8)
    assert (h.flops, h.hbm_bw, h.sms, h.intra_bw, h.inter_bw) == (989e12, 3.35e12, 132, 450e9, 50e9)
    # the H100's GEMMs at the sustained (power-saturated) share of its burst MAMF; FP8 at its own peak and ceiling
    assert a.first_principles and h.gemm_ceiling == pytest.approx(794.5 / 989 * 755.5 / 852.1)
    assert (h.fp8_flops, a.fp8_flops) == (1979e12, 0.0) and h.fp8_gemm_ceiling == pytest.approx(1402.6 / 1979 * 755.5
                                                                                                  / 852.1)
    h8 = P.Cluster.preset("h800-80gb-sxm", 2048)
    assert (h8.flops, h8.fp8_flops, h8.intra_bw * h8.intra_efficiency, h8.inter_bw) == (989e12, 1979e12, 160e9, 50e9)
    assert P.Cluster.preset("h100-80gb-sxm", 8, inter_bw=25e9).inter_bw == 25e9
    assert not P.Cluster.preset("a100-80gb-sxm", 8, mfu=0.5).first_principles     # the override wins
    assert set(PRESETS) >= {"a100-80gb-sxm", "h100-80gb-sxm", "h800-80gb-sxm"}
    with pytest.raises(ValueError, match="unknown hardware preset 'b300'"):
        P.Cluster.preset("b300", 8)


# ------------------------------------------------------------------ kernels

def test_gemm_is_the_larger_roofline_bound():
    # a square 8192³ GEMM: 128·64 = 2048 tiles of 64×128... of 256×128 → 32·64 tiles on 108 SMs
    m = n = k = 8192
    eff = gemm_efficiency(m, n, A100)
    best = max(m * n / (math.ceil(m / tm) * tm * math.ceil(n / tn) * tn) * (w := math.ceil(m / tm) * math.ceil(n / tn)
               / 108) / math.ceil(w) for tm, tn in ((256, 128), (128, 256), (128, 128)))
    assert eff == pytest.approx(A100.gemm_ceiling * best)
    assert gemm_time(m, n, k, A100) == pytest.approx(2 * m * n * k / (312e12 * eff))
    # a skinny GEMM (K = 64, the head dimension) is bound by memory, not FLOPs: at the bandwidth a
    # streaming kernel reaches (88 % of the datasheet's 2,039 GB/s)
    t = gemm_time(4096, 4096, 64, A100, batch=32)
    assert t == pytest.approx(2 * 32 * (4096 * 64 * 2 + 4096 * 4096) / (2039e9 * 1.80 / 2.04))


def test_small_shapes_are_less_efficient_than_large_ones():
    assert gemm_efficiency(2048, 25600 * 3 // 8, A100) > gemm_efficiency(256, 25600 * 3 // 64, A100)
    assert gemm_efficiency(300, 300, A100) < 0.5 * A100.gemm_ceiling          # 3 tiles on 108 SMs


# ------------------------------------------------------------------ collectives

def test_alpha_beta_costs():
    plain = replace(A100, intra_busbw=())                       # α–β alone, without the measured sweep
    beta, alpha = 300e9 * A100.intra_efficiency, A100.alpha_intra
    assert collective_time("all_reduce", 1e9, 8, plain, "intra") == pytest.approx(14 * alpha + 2 * 7 / 8 * 1e9 / beta)
    assert collective_time("all_gather", 1e9, 8, plain, "intra") == pytest.approx(7 * alpha + 7 / 8 * 1e9 / beta)
    # with the sweep (nccl-tests on an A100 node): a measured size takes exactly the measured time
    assert collective_time("all_reduce", 2 ** 26, 8, A100, "intra") == pytest.approx(684.6e-6, rel=2e-3)
    assert collective_time("all_reduce", 2 ** 34, 8, A100, "intra") == pytest.approx(127997e-6, rel=2e-3)
    # between two sizes, log-log: a 48 MiB all-reduce moves between the 32 and 64 MiB rows' bandwidths
    mid = 2 * 7 / 8 * 48 * 2 ** 20 / collective_time("all_reduce", 48 * 2 ** 20, 8, A100, "intra")
    assert 138.49e9 < mid < 171.54e9
    # and α + n/β with the 16 GiB bandwidth would be too fast there
    assert collective_time("all_reduce", 2 ** 26, 8, plain, "intra") < 0.85 * 684.6e-6
    assert collective_time("p2p", 1e6, 2, A100, "inter") == pytest.approx(A100.alpha_inter + 1e6 / (25e9 * 0.74))
    assert collective_time("all_reduce", 1e9, 1, A100, "intra") == 0.0
    # latency dominates tiny messages: a thousand 1 MB all-reduces cost more than one of 1 GB
    assert 1000 * collective_time("all_reduce", 1e6, 8, A100, "intra") > collective_time("all_reduce", 1e9, 8, A100,
                                                                                          "intra")
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        collective_time("broadcast", 1.0, 2, A100, "intra")


# ------------------------------------------------------------------ layout and schedules

def test_stage_layout_with_embedding_only_and_loss_only_chunks():
    comp = P.Composition(dp=16, pp=4, zero=1, recompute="full", stage_layout=(0, 20, 20, 0))
    assert [n for n, _ in chunk_layers(GPT, comp)] == [0, 20, 20, 0]
    pl = P.plan(GPT, A100, comp)
    assert pl.fits
    first, second = (P.plan(GPT, A100, comp, stage=k) for k in (0, 1))
    assert first.memory["params"] < second.memory["params"]               # the embedding alone
    # pp · v = 4 > 2 layers: rejected without a layout, accepted with one
    tiny = P.Model("t", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=100, seq_len=64, global_batch=8)
    four = P.Cluster.preset("a100-80gb-sxm", 4)
    with pytest.raises(ValueError, match=re.escape("pp=4 × virtual_stages=1 is more than layers=2")):
        P.plan(tiny, four, P.Composition(pp=4))
    assert P.plan(tiny, four, P.Composition(pp=4, stage_layout=(0, 1, 1, 0))).fits


@pytest.mark.parametrize("comp,words", [
    (P.Composition(dp=16, pp=4, stage_layout=(10, 10, 10)), "stage_layout has 3 entries; pp=4 × virtual_stages=1"),
    (P.Composition(dp=16, pp=4, stage_layout=(10, 10, 10, 5)), "sums to 35 layers, the model has layers=40"),
    (P.Composition(dp=16, pp=4, stage_layout=(20, 0, 20, 0)), "only the first (embedding-only) and last"),
    (P.Composition(dp=21, tp=3), "dp·tp·pp·cp = 21·3·1·1 = 63 but the cluster has 64"),
    (P.Composition(dp=8, tp=8, schedule="pipedream"), "schedule='pipedream'"),
    (P.Composition(dp=16, cp=4, cp_algorithm="tree"), "cp_algorithm='tree'"),
    (P.Composition(dp=64, micro_batch=3), "do not split into dp=64 × micro_batch=3"),
])
def test_bad_input_names_what_is_wrong(comp, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        P.plan(GPT, A100, comp)


def test_bubble_by_schedule_and_activations_in_flight():
    c = P.Composition(pp=8, dp=8)
    assert bubble_units(c) == 7 and bubble_units(P.with_sizes(c, schedule="zb_h1")) == pytest.approx(7 / 3)
    assert bubble_units(P.with_sizes(c, virtual_stages=4)) == pytest.approx(7 / 4)
    assert chunks_in_flight(c, 0, 32) == 8 and chunks_in_flight(P.with_sizes(c, schedule="gpipe"), 0, 32) == 32
    assert chunks_in_flight(P.with_sizes(c, virtual_stages=4), 0, 32) == 4 * 8 + 8 - 1
    steps = {s: P.plan(GPT, A100, P.with_sizes(c, schedule=s)).step_time for s in ("gpipe", "1f1b", "zb_h1")}
    assert steps["gpipe"] == steps["1f1b"] > steps["zb_h1"]
    inter = P.plan(GPT, A100, P.with_sizes(c, virtual_stages=5))
    assert inter.bubble_time < P.plan(GPT, A100, c).bubble_time


# ------------------------------------------------------------------ switches

def test_recomputation_by_granularity_costs_time_and_counts_in_hfu_only():
    plans = {r: P.plan(GPT, A100, P.Composition(dp=8, tp=8, recompute=r)) for r in ("none", "selective", "full")}
    assert plans["none"].step_time < plans["selective"].step_time < plans["full"].step_time
    assert plans["none"].hfu == pytest.approx(plans["none"].mfu)
    assert plans["full"].hfu / plans["full"].mfu == pytest.approx(P.model_flops(GPT, "full")[1] / P.model_flops(GPT)[0])
    mf = P.model_flops(GPT)[0]
    assert plans["full"].mfu == pytest.approx(mf / (plans["full"].step_time * 64 * 312e12))


def test_overlap_switches_expose_what_they_should():
    base = P.Composition(dp=8, tp=8)
    exposed, overlapped = (P.plan(GPT, A100, P.with_sizes(base, tp_overlap=o)).exposed["tp"] for o in (False, True))
    assert 0 < overlapped < 0.5 * exposed          # overlap hides most of it, and is not free (.overlap)
    z3 = P.Composition(dp=64, zero=3, recompute="full", micro_batch=1)
    hidden, shown = (P.plan(GPT, A100, P.with_sizes(z3, fsdp_prefetch=f)).exposed["zero3"] for f in (True, False))
    assert hidden < shown
    ring, gather = (P.plan(LLAMA, A100, P.Composition(dp=8, tp=2, cp=4, cp_algorithm=a, flash=True))
                    for a in ("ring", "allgather"))
    assert ring.exposed.get("cp", 0.0) < gather.exposed["cp"]
    ulysses = P.plan(LLAMA, A100, P.Composition(dp=8, tp=2, cp=4, cp_algorithm="ulysses", flash=True))
    assert ulysses.exposed["cp"] > 0


def test_scatter_gather_and_distributed_optimizer():
    c = P.Composition(dp=2, tp=8, pp=4, sequence_parallel=False)
    plain, sg = P.plan(GPT, A100, c), P.plan(GPT, A100, P.with_sizes(c, scatter_gather=True))
    assert sg.comm_bytes["pp"] == pytest.approx(plain.comm_bytes["pp"] / 8)
    assert sg.exposed["pp"] < plain.exposed["pp"]
    dist = P.plan(GPT, A100, P.with_sizes(c, distributed_optimizer=True))
    assert dist.memory["optimizer"] == pytest.approx(plain.memory["optimizer"] / 2)


def test_the_memory_margin_is_kept_free():
    pl = P.plan(GPT, A100, P.Composition(dp=8, tp=8))
    tight = P.Cluster.preset("a100-80gb-sxm", 64, memory_margin=80e9 - pl.total_memory + 1)
    assert pl.fits and not P.plan(GPT, tight, P.Composition(dp=8, tp=8)).fits
    assert "margin" in P.plan(GPT, tight, P.Composition(dp=8, tp=8)).reasons[0]


def test_search_tries_every_divisor_and_gives_reasons():
    assert P.divisors(12) == [1, 2, 3, 4, 6, 12]
    cluster = P.Cluster.preset("a100-80gb-sxm", 24)
    ok, bad = P.search(GPT, cluster, zero_stages=(0, 1), recompute=("selective",), cp_sizes=(1,), top=200)
    assert {3, 6, 12, 24} <= {pl.comp.pp for pl in ok + bad}                # pipeline sizes that are not 2^k
    assert {pl.comp.tp for pl in ok + bad} == {1, 2, 4, 8}                  # tp divides the 40 heads
    assert [pl.step_time for pl in ok] == sorted(pl.step_time for pl in ok)
    assert all(pl.reasons[0].startswith("fits") and len(pl.reasons) > 1 for pl in ok)
    why = P.explain(ok[-1], ok[0])
    assert why[0].startswith(str(ok[-1].comp)) and why[-1].startswith("  to settle it")


# ------------------------------------------------------------------ what the published runs taught the model

def test_a_middle_stage_holds_no_embedding_and_a_zero3_layer_gathers_only_its_own_parameters():
    """Tied embeddings live on the first and last stages; a middle stage (and one layer's ZeRO-3 gather)
    has none of the V·h table (the planner once counted it there: every 175B layer gathered 0.63B more)."""
    comp = P.Composition(dp=4, pp=4, tp=4)
    layers = [P.stage_layers(GPT, 4, k)[0] for k in range(4)]
    per_layer = 12 * GPT.hidden ** 2 / 4
    middle = P.plan(GPT, A100, comp, stage=1).memory["params"] / GPT.param_bytes
    first = P.plan(GPT, A100, comp, stage=0).memory["params"] / GPT.param_bytes
    assert middle == pytest.approx(layers[1] * per_layer, rel=0.01)
    assert first - middle > 0.9 * GPT.vocab * GPT.hidden / 4


def test_zero3_prefetch_limit_leaves_the_rest_of_each_gather_in_the_critical_path():
    z3 = P.Composition(dp=64, zero=3, recompute="full")
    exposed = {lim: P.plan(GPT, A100, P.with_sizes(z3, prefetch_limit=lim)).exposed.get("zero3", 0.0)
               for lim in (None, 5e7, 0.0)}
    off = P.plan(GPT, A100, P.with_sizes(z3, fsdp_prefetch=False)).exposed["zero3"]
    assert exposed[None] < exposed[5e7] < exposed[0.0] == pytest.approx(off, rel=0.05)


def test_gradient_accumulation_costs_memory_traffic_per_extra_micro_batch():
    one, many = (P.plan(replace(GPT, global_batch=8 * m), A100, P.Composition(dp=8, tp=8)) for m in (1, 8))
    per_micro = many.compute_time / 8 - one.compute_time
    params = P.device_params(GPT, P.Composition(dp=8, tp=8))[0]
    assert per_micro * 8 == pytest.approx(7 * 3 * GPT.grad_bytes * params / (A100.hbm_bw * A100.memory_efficiency),
                                          rel=0.02)


def test_the_mixed_precision_optimizer_streams_52_bytes_per_parameter():
    """Megatron's fp16 optimizer, one pass each: cast the gradient (2 + 4), unscale (4 + 4), its norm (4),
    Adam on the fp32 master (7 × 4), cast the weight back (4 + 2); one precision: weight, grad, state."""
    assert P.optimizer_bytes_per_param(GPT) == 52
    assert P.optimizer_bytes_per_param(P.tiny_gpt(GPTConfig(vocab=64), batch_size=2)) == 8 + 8 + 2 * 16
    one = P.plan(GPT, A100, P.Composition(dp=64))
    assert one.optimizer_time == pytest.approx(P.device_params(GPT, P.Composition(dp=64))[0] * 52
                                               / (A100.hbm_bw * A100.memory_efficiency))


def test_with_overlap_only_the_last_bucket_of_the_gradient_sync_is_exposed():
    """torch DDP's last bucket is posted as backward ends: exposed whatever the window (the word embedding's
    gradient on the device holding it, else a 25 MiB bucket); without overlap, all of it."""
    from reference.planner.timing import DDP_BUCKET_BYTES
    comp, big_batch = P.Composition(dp=64, recompute="full"), replace(GPT, micro_batch=32, global_batch=64 * 32)
    # (micro-batches of 32 sequences: one backward long enough to hide all but the last bucket)
    plans = {o: P.plan(big_batch, A100, P.with_sizes(comp, dp_overlap=o)) for o in (True, False)}
    table = P.padded_vocab(GPT, 1) * GPT.hidden * GPT.grad_bytes
    assert table > DDP_BUCKET_BYTES
    assert plans[True].exposed["dp"] == pytest.approx(collective_time("all_reduce", table, 64, A100, "inter"))
    assert plans[False].exposed["dp"] > 5 * plans[True].exposed["dp"]


# ------------------------------------------------------------------ a CPU world measured here (planner.machine)

CPU = P.Cluster("2 CPU ranks (figures as measured)", devices=2, memory=8 * P.GB, flops=40e9, intra_bw=2e9,
                inter_bw=2e9, devices_per_node=2, hbm_bw=15e9, sms=1, gemm_ceiling=1.0, attention_ceiling=0.5,
                alpha_intra=1e-4, alpha_inter=1e-4, gemm_sweep=((1e4, 4e9), (1e6, 30e9), (1e9, 15e9)), cores=2)


def test_a_measured_gemm_sweep_times_gemms_by_their_size():
    """With a measured sweep a GEMM runs at the sweep's rate for its FLOPs (log-log between the sizes around it),
    not at the GPU tile model's: a tiny GEMM costs the smallest one's time, a huge one the last rate."""
    assert gemm_time(100, 100, 50, CPU) == pytest.approx(1e6 / 30e9)                # 2·100·100·50 = 1e6 FLOPs
    between = 2 * 1000 * 1000 * 50                                                   # 1e8: between 1e6 and 1e9
    rate = math.exp(math.log(30e9) + (math.log(15e9) - math.log(30e9)) * math.log(1e8 / 1e6) / math.log(1e3))
    assert gemm_time(1000, 1000, 50, CPU) == pytest.approx(between / rate)
    assert gemm_time(10, 10, 10, CPU) == pytest.approx(1e4 / 4e9)                   # below the sweep: a fixed time


def test_ranks_sharing_cores_put_a_floor_under_the_step():
    """Eight ranks on two cores: the step takes at least the eight ranks' CPU work over the two cores, and the
    planner says so; two ranks on two cores keep their own timelines."""
    tiny = P.tiny_gpt(GPTConfig(vocab=27, layers=2, d_model=64, heads=2, d_ff=256, seq_len=32), batch_size=8,
                      micro_batch=1)
    two = P.plan(tiny, CPU, P.Composition(dp=2, flash=True, sequence_parallel=False, micro_batch=4))
    eight = P.plan(tiny, replace(CPU, devices=8, devices_per_node=8),
                   P.Composition(dp=8, flash=True, sequence_parallel=False))
    assert two.cpu_floor <= two.step_time and not two.bottleneck.startswith("time: CPU")
    assert eight.bottleneck == "time: CPU-bound (8 ranks on 2 cores)" and eight.step_time == eight.cpu_floor
    assert eight.cpu_floor == pytest.approx(8 * (eight.compute_time + eight.optimizer_time) / 2)
    assert "CPU shared by ranks" in P.time_terms(eight) and eight.reasons[1].startswith("CPU: 8 ranks")
