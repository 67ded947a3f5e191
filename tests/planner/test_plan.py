"""reference.planner: every formula against numbers worked by hand (or printed in the papers), the
ZeRO stage ordering, what runs out first, and the published worked examples (reference.planner.published).
Pure arithmetic: the whole file runs in a few seconds."""
from __future__ import annotations

import re
from dataclasses import replace

import pytest

from reference import planner as P
from reference.planner.published import (GSHARD_600B, GSHARD_PLAN, H100_8K, H100_16K, LLAMA3_70B, LLAMA3_405B,
                                         LLAMA3_405B_8K_PLAN, LLAMA3_405B_16K_PLAN, LLAMA3_405B_LONG,
                                         LLAMA3_405B_LONG_PLAN, TPU_V3_2048)

GPT3 = P.Model("GPT-3 175B shape", layers=96, hidden=12288, heads=96, kv_heads=96, ffn=4 * 12288, vocab=51200,
               seq_len=2048)
TINY = P.Model("tiny", layers=2, hidden=4, heads=2, kv_heads=2, ffn=16, vocab=10, seq_len=8, global_batch=8)
TINY_MOE = P.Model("tiny moe", layers=2, hidden=4, heads=2, kv_heads=2, ffn=16, vocab=10, seq_len=8,
                   global_batch=8, num_experts=4, top_k=2)
TINY_BIG = P.Model("13B-class dense model (Llama-2-13B shape)", layers=40, hidden=5120, heads=40, kv_heads=40,
                   ffn=13824, vocab=32000, seq_len=4096, global_batch=8, gated_ffn=True, dropout=False)
ONE_NODE = P.Cluster("8 GPUs", devices=8, memory=80 * P.GB, flops=1e15, intra_bw=400e9, inter_bw=50e9,
                     devices_per_node=8)
TWO_NODES = P.Cluster("2×4 GPUs", devices=8, memory=80 * P.GB, flops=1e15, intra_bw=400e9, inter_bw=50e9,
                      devices_per_node=4)


# ------------------------------------------------------------------ memory formulas

def test_zero_model_states_match_the_zero_paper_figure_1():
    """ZeRO arXiv:1910.02054 Fig. 1: Ψ = 7.5B, N_d = 64, K = 12 → 120, 31.4, 16.6, 1.9 GB."""
    got = [sum(P.model_state_bytes(7.5e9, z, 64).values()) / 1e9 for z in range(4)]
    assert got == pytest.approx([120.0, 31.40625, 16.640625, 1.875], rel=1e-12)
    assert got[0] > got[1] > got[2] > got[3]


def test_zero_stage_ordering_in_a_plan():
    comps = [P.Composition(dp=8, zero=z) for z in range(4)]
    mem = [P.plan(TINY_BIG, ONE_NODE, c).memory for c in comps]
    states = [m["params"] + m["grads"] + m["optimizer"] for m in mem]
    assert states[0] > states[1] > states[2] > states[3]
    assert mem[3]["params"] == pytest.approx(mem[0]["params"] / 8)
    assert mem[1]["optimizer"] == pytest.approx(mem[0]["optimizer"] / 8) and mem[1]["grads"] == mem[0]["grads"]


def test_activations_match_korthikanti_formulas_by_hand():
    """arXiv:2205.05198 §4 with s=2048, b=1, h=12288, a=96, t=8 (bytes per layer)."""
    A = P.activation_bytes_per_layer
    assert A(GPT3) == 34 * 2048 * 12288 + 5 * 96 * 2048 ** 2 == 2_868_903_936
    assert A(GPT3, tp=8, sequence_parallel=False) == pytest.approx(578_813_952)    # sbh(10+24/t) + 5as²b/t
    assert A(GPT3, tp=8) == pytest.approx(358_612_992)                             # (34sbh + 5as²b)/t
    assert A(GPT3, tp=8, recompute="selective") == pytest.approx(106_954_752)      # 34sbh/t
    assert A(GPT3, tp=8, flash=True) == A(GPT3, tp=8, recompute="selective")
    assert A(GPT3, tp=8, recompute="full") == pytest.approx(6_291_456)             # 2sbh/t
    # context parallel: every sbh term on s/c tokens, the scores for s/c queries × s keys
    assert A(GPT3, cp=4) == pytest.approx(34 * 512 * 12288 + 5 * 96 * 512 * 2048)


def test_plan_memory_adds_up_by_hand():
    comp = P.Composition(dp=2, tp=2, pp=2, zero=1)
    pl = P.plan(TINY_BIG, ONE_NODE, comp)
    c = P.param_counts(TINY_BIG)
    # the last stage holds the most: 20 layers' matrices and the head's vocabulary rows /tp, and
    # 20 × 2 norms + the final norm whole (every tensor rank holds a copy of a norm)
    psi = (c["attention"] + c["ffn"]) / 2 / 2 + 20 * 2 * 5120 + 5120 + 32000 * 5120 / 2
    assert c["norms"] == (40 * 2 + 1) * 5120
    assert pl.memory["params"] == pytest.approx(2 * psi)
    assert pl.memory["grads"] == pytest.approx(2 * psi)
    assert pl.memory["optimizer"] == pytest.approx(12 * psi / 2)
    per_layer = P.activation_bytes_per_layer(TINY_BIG, tp=2)
    m = 8 // 2
    assert pl.micro_batches == m
    assert pl.memory["activations"] == pytest.approx(20 * per_layer * min(m, 2))
    # output layer (Korthikanti §4.3): fp32 logits over V/t, the final norm's and the head's inputs /t (SP)
    assert pl.memory["logits"] == pytest.approx(4 * 4096 * 32000 / 2 + 2 * 2 * 4096 * 5120 / 2)


# ------------------------------------------------------------------ communication formulas

def test_ring_all_reduce_bytes():
    assert P.allreduce_bytes(2e9, 4) == 3e9
    assert P.allreduce_bytes(100, 1) == 0


def test_bytes_per_axis_by_hand():
    e = 2   # bytes per element
    # dp: Ψ = all parameters (one device holds all), 2(N−1)/N·Ψ·2 bytes; ZeRO-3 1.5×
    psi = sum(P.param_counts(TINY).values())
    assert P.plan(TINY, TWO_NODES, P.Composition(dp=8)).comm_bytes == {"dp": 2 * 7 / 8 * psi * e}
    assert (P.plan(TINY, TWO_NODES, P.Composition(dp=8, zero=3)).comm_bytes["dp"]
            == pytest.approx(1.5 * 2 * 7 / 8 * psi * e))
    # tp: 4 all-reduces × 2 layers × 1 micro-batch of s·b·h = 32 elements: 4·2·(2·1/2·64) = 512 bytes,
    # + the vocabulary-parallel embedding's and the head's (64 each), + the cross-entropy's 3 all-reduces
    # of one fp32 number per token (3·32), + with SP the replicated parameters' gradients: 2·2 norms
    # + the final norm, 20 numbers (40 bytes), and the backward's re-gathers of the saved s/t rows by qkv
    # and fc1 of each layer and the head: 5 all-gathers of (t−1)·(s/t)·b·h·2 = 32 bytes
    tiny1 = P.Model("tiny", layers=2, hidden=4, heads=2, kv_heads=2, ffn=16, vocab=10, seq_len=8, global_batch=4)
    pl = P.plan(tiny1, TWO_NODES, P.Composition(dp=4, tp=2))
    assert pl.comm_bytes["tp"] == 512 + 2 * 64 + 3 * 32 + 40 + 5 * 32 and pl.link["tp"] == "intra"
    gathered = P.plan(replace(tiny1, sp_saves_gathered=True), TWO_NODES, P.Composition(dp=4, tp=2))
    assert gathered.comm_bytes["tp"] == 512 + 2 * 64 + 3 * 32 + 40
    assert P.plan(tiny1, TWO_NODES, P.Composition(dp=4, tp=2, sequence_parallel=False)).comm_bytes["tp"] == 736
    # pp: p=4, m=8 micro-batches, boundary s·b·h·2 = 64 bytes, a middle stage sends 8 forward + 8 backward
    tiny8 = P.Model("tiny", layers=4, hidden=4, heads=2, kv_heads=2, ffn=16, vocab=10, seq_len=8, global_batch=16)
    pl = P.plan(tiny8, TWO_NODES, P.Composition(dp=2, pp=4))
    assert pl.micro_batches == 8 and pl.comm_bytes["pp"] == 2 * 8 * 64 and pl.link["pp"] == "inter"
    # cp: c=2, K and V blocks of (s/c)·b·kv·hd = 4·1·2·2 elements each → 64 bytes; 3 passes × (c−1) × 2 layers
    pl = P.plan(tiny1, TWO_NODES, P.Composition(dp=4, cp=2))
    assert pl.comm_bytes["cp"] == 3 * 1 * 2 * 64
    # ep: 4 all-to-alls × 2 MoE layers, each sends (e−1)/e of k·tokens·h·2 = 1/2·2·8·4·2 = 64 bytes
    pl = P.plan(TINY_MOE, TWO_NODES, P.Composition(dp=8, ep=2))
    assert pl.micro_batches == 1
    assert pl.comm_bytes["ep"] == 4 * 2 * 1 * 64 and pl.link["ep"] == "intra"
    # experts' gradients: all-reduce over edp = 4 ranks of this rank's 2 experts × 2 layers × 2·4·16 weights
    assert pl.comm_bytes["edp"] == 2 * 3 / 4 * (2 * 2 * 2 * 4 * 16) * e


def test_pipeline_bubble():
    assert P.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert P.bubble_fraction(4, 8, v=2) == pytest.approx(3 / 19)
    assert P.bubble_fraction(1, 8) == 0


def test_recomputation_and_interleaving_in_a_plan():
    none = P.plan(TINY_BIG, ONE_NODE, P.Composition(tp=8))
    full = P.plan(TINY_BIG, ONE_NODE, P.Composition(tp=8, recompute="full"))
    # full: 2·s·b·h/t per layer kept, plus one layer rebuilt during its backward; 6 tp all-reduces instead of 4
    assert full.memory["activations"] == pytest.approx(40 * 2 * 4096 * 5120 / 8)
    assert full.memory["recompute"] == pytest.approx(none.memory["activations"] / 40)
    # the layers' forward all-reduces (2 of their 4) run again, m = 8 micro-batches; embedding, head, loss do not
    assert full.comm_bytes["tp"] - none.comm_bytes["tp"] == pytest.approx(8 * 40 * 2 * 2 * 7 / 8 * 4096 * 5120 * 2)
    assert full.compute_time == pytest.approx(none.compute_time * 8 / 6)
    tiny = P.Model("t", layers=8, hidden=4, heads=2, kv_heads=2, ffn=16, vocab=10, seq_len=8, global_batch=8)
    plain = P.plan(tiny, ONE_NODE, P.Composition(pp=4, dp=2))
    inter = P.plan(tiny, ONE_NODE, P.Composition(pp=4, dp=2, virtual_stages=2))
    assert plain.bubble == pytest.approx(3 / 7) and inter.bubble == pytest.approx(3 / 11)


def test_compute_time_is_6_n_tokens_over_the_cluster():
    pl = P.plan(TINY_BIG, ONE_NODE, P.Composition(dp=8))
    n = sum(P.param_counts(TINY_BIG).values())
    flops = 6 * (n + 40 * 4096 * 5120) * 8 * 4096
    assert pl.compute_time == pytest.approx(flops / (8 * 1e15 * 0.4))
    moe = P.param_counts(GSHARD_600B)
    assert P.active_params(GSHARD_600B) == pytest.approx(sum(moe.values()) - moe["experts"] * (1 - 2 / 2048))


# ------------------------------------------------------------------ what runs out first

def test_a_model_that_does_not_fit_at_tp1_fits_at_tp8():
    at1 = P.plan(TINY_BIG, ONE_NODE, P.Composition(dp=8))
    at8 = P.plan(TINY_BIG, ONE_NODE, P.Composition(tp=8, recompute="selective"))
    assert not at1.fits and at1.bottleneck == "memory: model states (parameters, gradients, optimizer)"
    assert "shard them" in at1.reasons[0]
    assert at8.fits and at8.bottleneck.startswith("time:")
    assert at8.link["tp"] == "intra"


def test_tensor_groups_across_nodes_use_the_slow_links():
    inside = P.plan(TINY_BIG, TWO_NODES, P.Composition(dp=2, tp=4))
    across = P.plan(TINY_BIG, TWO_NODES, P.Composition(tp=8))
    assert inside.link["tp"] == "intra" and across.link["tp"] == "inter"
    assert across.comm_time["tp"] / across.comm_bytes["tp"] == pytest.approx(1 / 50e9)


@pytest.mark.parametrize("comp,words", [
    (P.Composition(dp=4), "dp·tp·pp·cp = 4·1·1·1 = 4 but the cluster has 8"),
    (P.Composition(dp=1, tp=8), "tp=8 must divide heads=2"),
    (P.Composition(dp=1, pp=8), "pp=8 × virtual_stages=1 is more than layers=2"),
    (P.Composition(dp=8, ep=3), "ep=3 must divide"),
    (P.Composition(dp=8, zero=4), "zero=4 (0–3)"),
    (P.Composition(dp=8, recompute="some"), "recompute='some'"),
])
def test_bad_compositions_raise_value_error_naming_sizes(comp, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        P.plan(TINY_MOE, TWO_NODES, comp)


# ------------------------------------------------------------------ published worked examples

def test_parameter_counts_match_the_published_sizes():
    assert sum(P.param_counts(LLAMA3_405B).values()) == pytest.approx(405e9, rel=0.005)
    assert sum(P.param_counts(LLAMA3_70B).values()) == pytest.approx(70.6e9, rel=0.005)
    total = sum(P.param_counts(GSHARD_600B).values())
    assert 600e9 <= total <= 620e9                                   # "600B"
    assert P.param_counts(GSHARD_600B)["experts"] == 18 * 2048 * 2 * 1024 * 8192


def test_llama3_published_compositions_fit_and_plain_data_parallelism_does_not():
    for cluster, comp in ((H100_8K, LLAMA3_405B_8K_PLAN), (H100_16K, LLAMA3_405B_16K_PLAN)):
        pl = P.plan(LLAMA3_405B, cluster, comp)
        assert pl.fits, pl.summary()
        assert pl.link["tp"] == "intra" and pl.link["pp"] == "inter"
    dp_only = P.plan(LLAMA3_405B, H100_16K, P.Composition(dp=2048, pp=8, zero=1))
    assert not dp_only.fits and dp_only.bottleneck.startswith("memory: model states")


def test_long_context_needs_context_parallelism():
    """Llama 3 405B at 131,072 tokens on 16K H100s (published: TP 8, CP 16, PP 16, DP 8)."""
    assert P.plan(LLAMA3_405B_LONG, H100_16K, LLAMA3_405B_LONG_PLAN).fits
    # without recomputing whole layers, no composition without cp fits: activations run out
    ok, bad = P.search(LLAMA3_405B_LONG, H100_16K, zero_stages=(1,), recompute=("none",), flash=True, top=10 ** 6)
    assert ok and all(pl.comp.cp > 1 for pl in ok)
    no_cp = [pl for pl in bad if pl.comp.cp == 1]
    assert no_cp and all(pl.bottleneck == "memory: activations" for pl in no_cp[:3])
    # with full recomputation cp=1 fits, but 128 sequences per step cannot feed dp × pp: the bubble
    ok, _ = P.search(LLAMA3_405B_LONG, H100_16K, zero_stages=(1,), recompute=("full",), flash=True, top=10 ** 6)
    best_no_cp = min((pl for pl in ok if pl.comp.cp == 1), key=lambda pl: pl.step_time)
    assert best_no_cp.step_time > 3 * ok[0].step_time and ok[0].comp.cp > 1
    assert best_no_cp.bottleneck == "time: pipeline bubble"


def test_gshard_needs_expert_parallelism():
    published = P.plan(GSHARD_600B, TPU_V3_2048, GSHARD_PLAN)
    assert published.fits, published.summary()
    no_ep = P.plan(GSHARD_600B, TPU_V3_2048, P.with_sizes(GSHARD_PLAN, ep=1))
    assert not no_ep.fits and no_ep.bottleneck.startswith("memory: model states")
    assert no_ep.total_memory > 100 * published.total_memory
    ok, _ = P.search(GSHARD_600B, TPU_V3_2048, zero_stages=(0,), recompute=("none",), top=5, etp_sizes=(1,))
    assert ok and all(pl.comp.ep >= 64 for pl in ok)


def test_search_ranks_fitting_plans_by_step_time_with_reasons():
    ok, bad = P.search(TINY_BIG, TWO_NODES, zero_stages=(0, 1), recompute=("none",), top=50)
    assert ok and bad
    assert [pl.step_time for pl in ok] == sorted(pl.step_time for pl in ok)
    assert all(pl.fits for pl in ok) and not any(pl.fits for pl in bad)
    assert all(pl.reasons for pl in ok + bad)
    assert "runs out first" in ok[0].summary()
