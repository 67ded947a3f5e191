"""Lecture 5a teaching side: the ring widget's state function and the grader's mistake detectors.

The widget is tested on traces of real runs (the reference ring on a kept-alive world of 4 ranks,
W = 2, 3, 4 on sub-groups).  The detectors are tested by feeding the checks' judging functions
the results of deliberately wrong implementations, run on real ranks where the mistake is in
the communication.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from exercises.grading.checks import sequence as checks
from exercises.grading.core import CheckFailed
from reference import comm
from reference.sequence import attention_block, block_plan, merge_attention, workers  # noqa: F401
from reference.widgets import ring as ringw
from reference.widgets.player import render_png

L = 24          # tokens in the replayed runs (divisible by 2W for W = 2, 3, 4)


@pytest.fixture(scope="module")
def runs(world):
    w = world(4)
    out = {}
    for W in (2, 3, 4):
        for layout in ("contiguous", "zigzag", "striped"):
            for causal in (False, True):
                res = w.run(workers.ring_replay_worker, L, W, layout, causal)
                assert max(v["max_error"] for v in res.values[:W]) < 1e-5
                out[(layout, W, causal)] = ringw.RingRun(res.trace, W, layout, causal, L)
    return out


def _state(run, step):
    return ringw.ring_state(run.trace, step, world_size=run.world_size, layout=run.layout, causal=run.causal,
                            seq_len=run.seq_len)


# ----------------------------------------------------------------------------------------------
# The widget's state


def test_backward_bytes_of_a_learners_ring_whose_messages_say_nothing_are_split_at_the_backwards_start(world):
    """The reference's forward + backward trace, and the same with phase/what stripped from every message (a
    learner's): the forward's bytes are the same; the backward's are one kind, K/V and dK/dV together."""
    from dataclasses import replace

    from reference.sequence.lecture import message_kinds
    from reference.trace import Trace
    trace = world(4).run(workers.ring_timing_worker, 32, 4, backward=True, heads=2, heads_kv=2, head_dim=8).trace
    bare = Trace(replace(e, step=None, meta={}) if e.op in ("send", "recv") else e for e in trace)
    ref, theirs = message_kinds(trace), message_kinds(bare)
    assert set(theirs) == {"forward K/V", "backward K/V and dK/dV"}
    count = lambda t: t.bytes_by_rank()                  # noqa: E731
    assert count(theirs["forward K/V"]) == count(ref["forward K/V"]) and count(ref["forward K/V"])
    both = {r: count(ref["backward K/V"])[r] + count(ref["backward dK/dV"])[r] for r in range(4)}
    assert count(theirs["backward K/V and dK/dV"]) == both


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_a_learners_ring_that_traces_nothing_replays_and_measures_like_the_reference(world, runs, layout):
    """A learner's forward passes no step/what/chunks and opens no trace span: the given kernel still
    measures every block's pairs, and the widget places each hop by its order, as the reference's run."""
    from tests.workers.sequence_workers import ring_forward_of
    W = 4
    res = world(4).run(ring_forward_of, "tests.submissions._ring_attention", L, W, layout, True)
    assert max(v["max_error"] for v in res.values) < 1e-5
    assert not any(e.meta.get("what") or e.step is not None for e in res.trace if e.op in ("send", "recv"))
    theirs, ref = ringw.RingRun(res.trace, W, layout, True, L), runs[(layout, W, True)]
    mine = res.trace.filter(op="compute", what="attn_fwd").meta_sum("pairs")
    assert [mine[r] for r in range(W)] == ringw.expected_pairs(L, W, layout, True)
    for s in range(W):
        a, b = _state(theirs, s), _state(ref, s)
        assert (a.holds, a.sends, a.pairs, a.owner.tolist()) == (b.holds, b.sends, b.pairs, b.owner.tolist())




def test_after_step_s_rank_r_holds_the_kv_of_rank_r_minus_s(runs):
    for (layout, W, causal), run in runs.items():
        for s in range(W):
            st = _state(run, s)
            for r in range(W):
                j = (r - s) % W
                assert st.holds_from[r] == j, (layout, W, causal, s, r)
                assert st.holds[r] == ringw.own_chunks(j, W, layout)
            # the hop posted at step s goes r -> r+1 and carries what r holds now
            if s < W - 1:
                assert [(a, b) for a, b, _, _ in st.sends] == [(r, (r + 1) % W) for r in range(W)]
                assert all(ch == st.holds[a] for a, _, ch, _ in st.sends)
            else:
                assert st.sends == []


def test_pairs_per_rank_match_the_formulas_and_the_trace(runs):
    for (layout, W, causal), run in runs.items():
        st = _state(run, W - 1)
        assert st.pairs == ringw.expected_pairs(L, W, layout, causal) == st.expected
        per_rank = run.trace.filter(op="compute", what="attn_fwd").meta_sum("pairs")
        assert [per_rank.get(r, 0) for r in range(W)] == st.pairs
    c = L // 4
    assert ringw.expected_pairs(L, 4, "contiguous", True) == [c * c * r + c * (c + 1) // 2 for r in range(4)]
    assert ringw.expected_pairs(L, 4, "zigzag", True) == [L * (L + 1) // 8] * 4
    assert sum(ringw.expected_pairs(L, 3, "striped", True)) == L * (L + 1) // 2


def test_score_tiles_fill_step_by_step_every_unmasked_score_once_by_the_rank_owning_the_query(runs):
    for (layout, W, causal), run in runs.items():
        qown = torch.zeros(L, dtype=torch.long)
        for r in range(W):
            for c in ringw.own_chunks(r, W, layout):
                qown[ringw.chunk_tokens(c, L, W, layout)] = r
        prev = None
        for s in range(W):
            st = _state(run, s)
            assert int(st.new.sum()) == sum(st.pairs_step)            # tiles of this step = pairs of this step
            done = st.owner >= 0
            if prev is not None:
                assert (done & ~st.new == prev).all()                 # earlier tiles stay, new ones are new
            prev = done
            rows = torch.from_numpy(st.owner)
            assert ((rows == qown[:, None]) | (rows < 0)).all()        # Q is stationary: rank r fills its rows
        masked = torch.ones(L, L, dtype=torch.bool).triu(1) if causal else torch.zeros(L, L, dtype=torch.bool)
        assert (torch.from_numpy(st.owner == ringw.MASKED) == masked).all()
        assert not (st.owner == ringw.EMPTY).any()                     # after the last step all are done


def test_contiguous_causal_shows_imbalance_and_skipped_blocks_zigzag_does_not(runs):
    cont, zig = _state(runs[("contiguous", 4, True)], 3), _state(runs[("zigzag", 4, True)], 3)
    assert cont.computed == [False, False, False, True]               # only rank 3 still has work
    assert cont.imbalance == pytest.approx(max(cont.expected) / (sum(cont.expected) / 4))
    assert cont.imbalance > 1.7 and zig.imbalance == 1.0
    assert all(zig.computed)


def test_ring_state_rejects_a_step_outside_the_ring(runs):
    with pytest.raises(ValueError):
        _state(runs[("zigzag", 2, True)], 2)


def test_draw_ring_renders_every_layout_and_the_player_switches_runs(runs):
    for key in (("contiguous", 4, True), ("zigzag", 3, False), ("striped", 2, True)):
        png = render_png(ringw.draw_ring, _state(runs[key], 1), figsize=(12, 4.2), dpi=40)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    player = ringw.ring_player(runs, layout="contiguous", world_size=4, causal=True)
    player.widget()
    player.controls["layout"].value = "zigzag"                         # rebuild: re-selects a recorded run
    assert player.n_steps == 4 and player.state_at(3).expected == [L * (L + 1) // 8] * 4
    player.controls["world_size"].value = 2
    assert player.n_steps == 2 and player.state_at(1).layout == "zigzag"


def test_overlap_stats_measure_the_part_of_each_message_spent_computing():
    from reference.trace import Event
    tr = [Event(0, "compute", start=10.0, end=11.0), Event(0, "send", peer=1, start=10.0, end=11.5),
          Event(0, "recv", peer=1, start=10.0, end=11.5), Event(1, "compute", start=10.0, end=10.2),
          Event(1, "recv", peer=0, start=10.1, end=10.5)]
    st = ringw.overlap_stats(tr)
    assert st[0] == pytest.approx({"compute": 1.0, "comm": 1.5, "overlap": 1.0, "exposed": 0.5, "hidden": 2 / 3})
    assert st[1]["overlap"] == pytest.approx(0.1) and st[1]["exposed"] == pytest.approx(0.3)
    assert ringw.timeline(tr)[1]["comm"] == [pytest.approx((0.1, 0.5))]


# ----------------------------------------------------------------------------------------------
# The grader's detectors.  First the exercise stubs match the reference's signatures and docstrings.


def test_exercise_stubs_have_the_reference_signatures_and_docstrings():
    import inspect
    ref, ex = importlib.import_module("reference.sequence"), importlib.import_module("exercises.sequence")
    for name in ex.__all__:
        assert inspect.signature(getattr(ex, name)) == inspect.signature(getattr(ref, name)), name
        assert getattr(ex, name).__doc__ == getattr(ref, name).__doc__, name


def _naive_merge(oa, la, ob, lb):
    ea, eb = torch.exp(la), torch.exp(lb)
    return (ea.unsqueeze(-1) * oa + eb.unsqueeze(-1) * ob) / (ea + eb).unsqueeze(-1), torch.log(ea + eb)


def test_merge_detectors_name_the_missing_running_max_and_plain_averaging():
    small = checks.merge_case(1, 2, 4, 3, 3, 8, seed=1)
    large = checks.merge_case(1, 2, 4, 3, 3, 8, seed=1, scale=30.0)
    checks.judge_merge(merge_attention(*large["args"]), large, "large")      # the reference passes
    checks.judge_merge(_naive_merge(*small["args"]), small, "small")          # naive is right on small logits
    with pytest.raises(CheckFailed, match="running max"):
        checks.judge_merge(_naive_merge(*large["args"]), large, "large logits ×30")
    oa, la, ob, lb = small["args"]
    with pytest.raises(CheckFailed, match="plain average"):
        checks.judge_merge(((oa + ob) / 2, torch.logaddexp(la, lb)), small, "small")
    with pytest.raises(CheckFailed, match="max\\(lse_a, lse_b\\)"):
        checks.judge_merge((merge_attention(*small["args"])[0], torch.maximum(la, lb)), small, "small")


def _shard_results(fn, cases):
    return [{"value": fn(x, r, W, layout, dim), "contiguous": True, "input_intact": True}
            for x, r, W, layout, dim in cases]


@pytest.mark.parametrize("mistake, words", [
    (lambda x, r, W: torch.cat([x.chunk(2 * W, -2)[r], x.chunk(2 * W, -2)[r + W]], -2), "second chunk is r \\+ W"),
    (lambda x, r, W: torch.cat([x.chunk(2 * W, -2)[2 * W - 1 - r], x.chunk(2 * W, -2)[r]], -2), "wrong order"),
    (lambda x, r, W: x.chunk(W, -2)[r], "contiguous layout"),
])
def test_shard_detectors_name_zigzag_mistakes_from_the_tokens_held(mistake, words):
    cases = checks._shard_cases(("zigzag",), (4,), lambda W, _: 16, lambda S: (1, 2, S, 2), -2)
    with pytest.raises(CheckFailed, match=words):
        checks.judge_shards(_shard_results(lambda x, r, W, layout, dim: mistake(x, r, W), cases), cases)


def test_shard_detector_recognises_striped_done_as_contiguous():
    cases = checks._shard_cases(("striped",), (3,), lambda W, _: 9, lambda S: (1, 1, S, 2), -2)
    with pytest.raises(CheckFailed, match="contiguous layout"):
        checks.judge_shards(_shard_results(lambda x, r, W, layout, dim: x.chunk(W, dim)[r].contiguous(), cases),
                            cases)


# A deliberately wrong learner ring, run on real ranks.  The grader's harness calls
# ``ring_attention_forward`` of this module; ``_BUG`` picks the mistake.

_BUG = ""


def ring_attention_forward(q, k, v, *, causal=False, layout="contiguous", group=None, kernel="fused"):
    r, W, n = comm.rank(), comm.world_size(), q.shape[-2]
    nxt, prv = comm.ring_peers()
    if _BUG == "direction":
        nxt, prv = prv, nxt
    out = lse = None
    kc, vc = k, v
    for s in range(W):
        j = (r - s) % W
        hop = None
        if s < W - 1:
            kb, vb = torch.empty_like(kc), torch.empty_like(vc)
            hop = comm.exchange([(kc, nxt), (vc, nxt)], [(kb, prv), (vb, prv)], step=s, what="kv")
        plan = block_plan(r, j, W, "contiguous" if _BUG == "contiguous_rules" else layout, causal, n)
        if _BUG == "diag_unmasked" and j == r:
            plan = block_plan(r, j, W, layout, False, n)
        if _BUG == "striped_inclusive" and j > r:
            plan = block_plan(r, r, W, layout, causal, n)
        if _BUG == "compute_masked" and not plan:
            attention_block(q, kc, vc)                                  # computed, then thrown away
        for p in plan:
            o, lse_blk = attention_block(q[..., p.q, :], kc[..., p.k, :], vc[..., p.k, :], causal=p.causal)
            if out is None:
                out, lse = o, lse_blk
            else:
                out[..., p.q, :], lse[..., p.q] = merge_attention(out[..., p.q, :], lse[..., p.q], o, lse_blk)
        if hop is not None:
            hop.wait()
            kc, vc = kb, vb
    return out, lse


def buggy_ring_worker(bug: str, causal: bool, layout: str, mine):
    global _BUG
    _BUG = bug
    try:
        return checks.ring_harness(__name__, mine, causal, layout)
    finally:
        _BUG = ""


def sent(trace: list[dict], W: int, itemsize: int = 8) -> list[list[tuple]]:
    """The sends of a trace as the referee logs them: per rank, (op, peer, elements, allowed)."""
    from exercises.grading.referee import SEND
    return [[(SEND, e["peer"], e["nbytes"] // itemsize, True) for e in trace if e["op"] == "send" and e["rank"] == r]
            for r in range(W)]


def run_buggy(world, bug: str, shards, causal: bool, layout: str):
    return world(len(shards)).run(buggy_ring_worker, bug, causal, layout, per_rank=[(s,) for s in shards])


@pytest.mark.parametrize("bug, layout, words", [
    ("", "zigzag", None),
    ("direction", "contiguous", "ring runs the other way"),
    ("diag_unmasked", "contiguous", "not masked"),
    ("contiguous_rules", "zigzag", "contiguous layout's rule"),
    ("striped_inclusive", "striped", "STRICTLY causal"),
])
def test_ring_detectors_name_the_mistake(world, bug, layout, words):
    W = 4
    qkv = checks.ring_inputs(1, 2, 16, 8, seed=7)
    res = run_buggy(world, bug, checks.shard_inputs(qkv, W, layout), True, layout)
    trace = [e.to_dict() for e in res.trace]
    if words is None:
        checks.judge_ring(res.values, trace, qkv, True, layout, W)
        checks.judge_ring_messages(sent(trace, W), W, 4, 2, 8)
        return
    with pytest.raises(CheckFailed, match=words):
        checks.judge_ring(res.values, trace, qkv, True, layout, W)


def test_ring_checks_see_kv_sent_the_wrong_way_and_masked_blocks_computed(world):
    W = 4
    qkv = checks.ring_inputs(1, 2, 16, 8, seed=8)
    shards = checks.shard_inputs(qkv, W, "contiguous")
    res = run_buggy(world, "direction", shards, False, "contiguous")
    checks.judge_ring(res.values, [e.to_dict() for e in res.trace], qkv, False, "contiguous", W)   # output fine ...
    with pytest.raises(CheckFailed, match="ring runs the other way"):                              # ... messages not
        checks.judge_ring_messages(sent([e.to_dict() for e in res.trace], W), W, 4, 2, 8)
    res = run_buggy(world, "compute_masked", shards, True, "contiguous")
    trace = [e.to_dict() for e in res.trace]
    checks.judge_ring(res.values, trace, qkv, True, "contiguous", W)
    with pytest.raises(CheckFailed, match="Skip fully masked blocks"):
        checks.judge_skipping(res.values, trace, W, 4)
    res = run_buggy(world, "", shards, True, "contiguous")
    checks.judge_skipping(res.values, [e.to_dict() for e in res.trace], W, 4)


def test_ulysses_detector_describes_heads_and_tokens_received():
    X = checks.heads_tokens_tensor(1, 8, 8, 2)
    W = 4
    right = [{"seq_to_heads": X[:, 2 * r:2 * r + 2], "heads_to_seq": X[:, :, 2 * r:2 * r + 2],
              "round_trip": X[:, :, 2 * r:2 * r + 2]} for r in range(W)]
    checks.judge_ulysses(right, X, W)
    interleaved = [dict(v, seq_to_heads=X[:, r::W]) for r, v in enumerate(right)]
    with pytest.raises(CheckFailed, match="interleaved"):
        checks.judge_ulysses(interleaved, X, W)
    shuffled = [dict(v, seq_to_heads=X[:, 2 * r:2 * r + 2].roll(2, dims=2)) for r, v in enumerate(right)]
    with pytest.raises(CheckFailed, match="tokens are in the order"):
        checks.judge_ulysses(shuffled, X, W)
    with pytest.raises(CheckFailed, match="raised nothing"):
        checks.judge_ulysses_error([{"raised": "ValueError"}] * 3 + [{"raised": None}], W, 6)


def test_a_trace_without_compute_events_shows_the_blocks_the_ring_order_implies(runs):
    run = runs[("zigzag", 4, True)]
    messages_only = [e for e in run.trace if e.op != "compute"]
    for s in range(4):
        full, bare = _state(run, s), ringw.ring_state(messages_only, s, world_size=4, layout="zigzag", causal=True,
                                                      seq_len=L)
        assert bare.inferred and not full.inferred
        assert bare.holds == full.holds and bare.pairs == full.pairs and (bare.owner == full.owner).all()
    bare = ringw.ring_state([], 2, world_size=3, layout="contiguous", causal=True, seq_len=L)
    assert bare.holds_from == [1, 2, 0] and bare.computed == [False, False, True]   # only rank 2 looks back



def test_peak_memory_per_rank_is_the_formula_in_a_world_with_glibc_defaults():
    """Lecture 5a section 7: the peak a causal explicit-kernel forward adds per rank is 3·n²·H·b + 3·n·H·D·b,
    within 30 % at L = 2048 on W = 1 and 2, twice in the same world (the second on a heap the first has used)."""
    from reference.launch import World
    from reference.sequence import lecture
    with World(2, timeout=60, echo=False, keep_freed_memory=False) as w:
        for _ in range(2):
            rows = lecture.memory_per_rank(lengths=(2048,), sizes=(1, 2), heads=2, head_dim=64, world=w)
            if any(r["peak"] is None for r in rows):
                pytest.skip("/proc/self/clear_refs is not available here")
            for r in rows:
                ratio = r["peak"] / lecture.memory_formula(r["L"], r["W"], 2, 64, 4)
                assert 0.7 <= ratio <= 1.3, (r, ratio)


def test_peak_memory_is_refused_in_ranks_that_keep_freed_memory(world):
    """Ranks that keep freed memory never raise their high-water mark: the worker refuses to measure there
    (memory_per_rank, handed such a world, measures in one of its own instead)."""
    from reference.launch import WorldError
    with pytest.raises(WorldError, match="keep_freed_memory=False"):
        world(2).run(workers.peak_memory_worker, 256, 2, heads=2, head_dim=64)


# ----------------------------------------------------------------------------------------------
# The lecture's arithmetic: packed documents, RoPE, recomputation, and what the timeline's step adds up


def _document_pairs_by_mask(docs, held):
    """Ground truth: the document-causal mask written out, its rows summed over the tokens a rank holds."""
    doc = torch.cat([torch.full((d,), i) for i, d in enumerate(docs)])
    L = len(doc)
    mask = (doc[:, None] == doc[None, :]) & torch.ones(L, L, dtype=torch.bool).tril()
    return [int(mask[h].sum()) for h in held]


@pytest.mark.parametrize("docs, W", [([16], 2), ([24, 8, 16, 8, 8], 4), ([12, 6, 6], 3)])
def test_document_pairs_are_the_document_masks_rows_on_each_layout(docs, W):
    from reference.sequence import lecture
    from reference.sequence.layouts import positions
    L = sum(docs)
    for layout in ("contiguous", "zigzag"):
        held = [positions(L, r, W, layout) for r in range(W)]
        assert lecture.document_pairs(docs, W, layout) == _document_pairs_by_mask(docs, held)
    starts = [sum(docs[:i]) for i in range(len(docs))]
    held = [torch.cat([s + positions(d, r, W, "zigzag") for s, d in zip(starts, docs)]) for r in range(W)]
    per_doc = lecture.document_pairs(docs, W, "per-document zigzag")
    assert per_doc == _document_pairs_by_mask(docs, held)
    assert len(set(per_doc)) == 1 and sum(per_doc) == sum(d * (d + 1) // 2 for d in docs)   # balanced, all pairs
    with pytest.raises(ValueError):
        lecture.document_pairs(docs, W, "striped")


def test_packed_documents_unbalance_zigzag_and_per_document_zigzag_restores_it():
    from reference.sequence import lecture
    docs = [2048, 1024, 512, 256, 256]
    one = lecture.document_pairs([4096], 4, "zigzag")
    zig, per_doc = lecture.document_pairs(docs, 4, "zigzag"), lecture.document_pairs(docs, 4, "per-document zigzag")
    assert len(set(one)) == 1 and len(set(per_doc)) == 1
    assert max(zig) / (sum(zig) / 4) > 1.4


def test_rope_rotates_by_position_so_scores_depend_on_the_distance_only():
    from reference.sequence.lecture import rope
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64) for _ in range(2))
    # against the complex-number definition: feature pair (2i, 2i+1) times e^{i·pos·base^(−2i/D)}
    pos = torch.tensor([5])
    z = torch.view_as_complex(q.reshape(1, 1, 1, 4, 2).contiguous())
    theta = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    want = torch.view_as_real(z * torch.polar(torch.ones(4, dtype=torch.float64), 5 * theta)).flatten(-2)
    assert torch.allclose(rope(q, pos), want, atol=1e-14)
    score = lambda a, b: float((rope(q, torch.tensor([a])) * rope(k, torch.tensor([b]))).sum())   # noqa: E731
    assert score(9, 4) == pytest.approx(score(105, 100), abs=1e-12) and score(9, 4) != pytest.approx(score(9, 8))


def test_rope_on_a_zigzag_shard_needs_the_global_positions():
    from reference.sequence import lecture
    rz = lecture.rope_under_zigzag(seq_len=16, world_size=2)
    assert rz["positions"] == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert rz["global_error"] == [0.0, 0.0]
    assert min(rz["local_error"]) > 0.5 and min(rz["attention_error"]) > 0.1


def test_full_recomputation_keeps_each_layers_input_and_one_layer_rebuilt():
    from reference.sequence import lecture
    s, h, layers = 4096, 4096, 32
    assert lecture.activation_bytes(s) == layers * 34 * s * h                       # fused, 16-bit
    assert lecture.activation_bytes(s, recompute="full") == layers * 2 * s * h + 34 * s * h
    assert lecture.attention_flop_share(131072) == pytest.approx(131072 / (12 * 4096))
    with pytest.raises(ValueError):
        lecture.activation_bytes(s, recompute="selective")


def test_the_timelines_step_covers_every_ranks_compute_and_the_blocks_alone_are_timed(world):
    from reference.sequence import lecture
    tl = lecture.ring_timeline(seq_len=256, world_size=2, heads=2, head_dim=16, world=world(4))
    stats = ringw.overlap_stats(tl["trace"])
    assert set(stats) == {0, 1} and tl["pairs"] == [256 * 257 // 4] * 2            # zigzag: balanced
    assert all(tl["seconds"] >= st["compute"] for st in stats.values())
    assert all(a > 0 for a in tl["alone"]) and len(tl["comm_cpu"]) == 2
    assert all(c is None or c >= 0 for c in tl["comm_cpu"])


def test_the_head_limit_demo_reports_every_ranks_error_before_any_message_and_keeps_the_world(world):
    from reference.sequence import lecture
    w = world(4)
    limit = lecture.ulysses_head_limit(heads=6, world=w)
    assert [limit[r][0] for r in range(4)] == ["ValueError"] * 4 and limit["all_to_alls"] == 0
    assert "6 heads" in limit[0][1] and w.alive                      # caught on the ranks: the world stays up
