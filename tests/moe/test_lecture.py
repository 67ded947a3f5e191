"""Lecture 5b's teaching side: the routing widget's state function, and the grader's 5b checks.

* ``routing_state`` on hand-made traces (exact expectations) and on a real expert-parallel run
  (its counts agree with the layer's own statistics; top-2 moves exactly twice top-1's bytes).
* Every 5b mistake detector fires on the mistake it names and stays silent on the right answer.
* The grader end to end: the reference gets full marks, the stubs zero, and two classic mistakes
  (divide by the expert-dp size; second choices before first choices) get named.
"""
from __future__ import annotations

import textwrap

import pytest
import torch

from exercises.grading import feedback as fb
from exercises.grading.checks import moe as checks
from reference.moe import load_balancing_loss, top_k_gating
from reference.moe.oracles import dispatch_combine_single, ep_dp_local_grads
from reference.moe.workers import routing_run
from reference.trace import Event
from reference.widgets.routing import bytes_per_phase, phases, routing_state
from tests.conftest import grade_mutant

# ----------------------------------------------------------------------------------------------
# The widget's state function on a hand-made trace


def _route_event(rank: int, routing: dict, E: int, k: int, C) -> Event:
    return Event(rank, "route", meta={"where": "expert_parallel", "num_experts": E, "k": k, "capacity": C,
                                      "expert_index": routing["expert_index"].tolist(),
                                      "weight": routing["weight"].double().tolist(),
                                      "kept": routing["kept"].tolist(), "slot": routing["slot"].tolist()})


def _a2a(rank: int, what: str, W: int, rows_per_dest: int, row_bytes: int) -> Event:
    return Event(rank, "all_to_all", nbytes=W * rows_per_dest * row_bytes,
                 meta={"what": what, "send_splits": [rows_per_dest] * W,
                       "send_bytes": [rows_per_dest * row_bytes] * W, "tokens_per_dest": [1] * W})


def _synthetic(W=2, E=4, k=2, C=2, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    routings = []
    for r in range(W):
        logits = torch.randn(T, E, generator=g, dtype=torch.float64) * 2
        logits[:, 0] += 1.5                       # expert 0 over-subscribed: drops
        routings.append(top_k_gating(logits, k, C))
    E_local = E // W
    trace = [_route_event(r, routings[r], E, k, C) for r in range(W)]
    trace += [_a2a(r, what, W, E_local * (C or 2), 64) for r in range(W) for what in ("dispatch", "combine")]
    return trace, routings


def test_phases_top1_skips_the_second_queue():
    assert phases(1) == ["tokens", "route", "queue 1st", "dispatch", "experts", "combine", "sum"]
    assert phases(2) == ["tokens", "route", "queue 1st", "queue 2nd", "dispatch", "experts", "combine", "sum"]


def test_state_queues_first_choices_before_second_and_drops_exactly_the_unkept():
    trace, routings = _synthetic()
    names = phases(2)
    st0 = routing_state(trace, 0)
    assert not st0["show_choices"] and all(x is None for b in st0["send"] for row in b for x in row)
    st1 = routing_state(trace, names.index("queue 1st"))
    st2 = routing_state(trace, names.index("queue 2nd"))
    for r, routing in enumerate(routings):
        kept, slot, idx = routing["kept"], routing["slot"], routing["expert_index"]
        first = {(int(idx[t, 0]), int(slot[t, 0])): (t, 0) for t in range(len(idx)) if kept[t, 0]}
        got1 = {(e, c): x for e, row in enumerate(st1["send"][r]) for c, x in enumerate(row) if x is not None}
        assert got1 == first
        everything = {(int(idx[t, j]), int(slot[t, j])): (t, j) for t in range(len(idx)) for j in range(2)
                      if kept[t, j]}
        got2 = {(e, c): x for e, row in enumerate(st2["send"][r]) for c, x in enumerate(row) if x is not None}
        assert got2 == everything
        assert sorted(st2["dropped"][r]) == sorted((t, j, int(idx[t, j])) for t in range(len(idx)) for j in range(2)
                                                   if not kept[t, j])
        assert all(j == 0 for _, j, _ in st1["dropped"][r])
    assert sum(len(d) for d in st2["dropped"]) == sum(int((~r["kept"]).sum()) for r in routings) > 0


def test_state_dispatch_puts_each_kept_assignment_on_its_experts_rank_at_source_block_and_slot():
    W, E, C = 2, 4, 2
    trace, routings = _synthetic(W=W, E=E, C=C)
    names = phases(2)
    before = routing_state(trace, names.index("queue 2nd"))
    assert all(x is None for rows in before["recv"] for row in rows for x in row)
    st = routing_state(trace, names.index("dispatch"))
    E_local = E // W
    want = set()
    for src, routing in enumerate(routings):
        for t in range(routing["kept"].shape[0]):
            for j in range(2):
                if routing["kept"][t, j]:
                    e, sl = int(routing["expert_index"][t, j]), int(routing["slot"][t, j])
                    want.add((e // E_local, e % E_local, src * C + sl, (src, t, j)))
    got = {(r, i, c, x) for r in range(W) for i in range(E_local) for c, x in enumerate(st["recv"][r][i])
           if x is not None}
    assert got == want
    assert st["moved"] == "dispatch" and not st["returned"]
    assert routing_state(trace, names.index("experts"))["computing"]


def test_state_sum_is_the_kept_weight_and_zero_for_fully_dropped_tokens():
    trace, routings = _synthetic(C=1, T=8)
    st = routing_state(trace, 99)                          # clamped to the last phase
    assert st["phase"] == "sum" and st["step"] == len(phases(2)) - 1
    for r, routing in enumerate(routings):
        want = (routing["weight"] * routing["kept"]).sum(1)
        assert torch.allclose(torch.tensor(st["output"][r], dtype=torch.float64), want, atol=1e-12)
        lost = ~routing["kept"].any(1)
        assert bool(lost.any())                            # the case has fully dropped tokens
        assert all(st["output"][r][t] == 0 for t in torch.nonzero(lost).flatten().tolist())


def test_bytes_per_phase_counts_only_rows_that_leave_the_rank():
    trace, _ = _synthetic(W=2, E=4, C=2)
    b = bytes_per_phase(trace)
    # E_local·C = 4 rows of 64 bytes per destination; one destination is the rank itself.
    assert b["dispatch"] == {r: {"total": 512, "off_rank": 256, "tokens_off_rank": 1} for r in range(2)}
    st = routing_state(trace, 0)
    assert st["bytes"]["formula"] == {"per_all_to_all": 4 * 2 * 64, "off_rank": 1 * 2 * 2 * 64, "row_bytes": 64}


def test_state_without_route_events_says_what_to_record():
    with pytest.raises(ValueError, match="route"):
        routing_state([Event(0, "send", peer=1, nbytes=8)], 0)


def test_state_of_a_real_run_matches_the_layer_and_top2_sends_twice_the_bytes(world):
    w = world(2)
    res = {k: w.run(routing_run, 4, k, 1.0, 8, 16, 3) for k in (1, 2)}
    off = {}
    for k, run in res.items():
        st = routing_state(run.trace, len(phases(k)) - 1)
        for r, v in enumerate(run.values):
            assert len(st["dropped"][r]) == v["dropped"]
            assert sum(1 for s in st["output"][r] if s == 0) == v["y_zero_rows"]
        off[k] = [st["bytes"]["dispatch"][r]["off_rank"] for r in range(2)]
        assert off[k] == [st["bytes"]["formula"]["off_rank"]] * 2
    # C = ceil(k·cf·T/E) = 2k: the padded buffers, and the bytes, double with k.
    assert off[2] == [2 * b for b in off[1]] and off[1][0] > 0


def test_a_learners_dispatch_and_combine_that_label_nothing_replay_like_the_references(world):
    """5b.3's all-to-alls need not say which is which: in a forward the first is the dispatch, the second
    the combine.  The reference's trace with its dispatch/combine labels stripped gives the same states."""
    from dataclasses import replace
    from reference.widgets.routing import bytes_per_phase
    trace = world(2).run(routing_run, 4, 2, 1.0, 8, 16, 3).trace
    graded = ("what", "tokens_per_dest", "tokens_per_src")
    bare = [replace(e, meta={k: v for k, v in e.meta.items() if k not in graded})
            if e.op == "all_to_all" and e.meta.get("what") in ("dispatch", "combine") else e for e in trace]
    assert bytes_per_phase(bare)["dispatch"] and all(e.meta.get("what") is None for e in bare if e.op == "all_to_all")
    for step in range(len(phases(2))):
        want, got = routing_state(trace, step), routing_state(bare, step)
        for phase in ("dispatch", "combine"):
            for r in (0, 1):
                want["bytes"][phase][r]["tokens_off_rank"] = got["bytes"][phase][r]["tokens_off_rank"] = None
        assert got == want


# ----------------------------------------------------------------------------------------------
# The 5b detectors


def _mm(what_, value_, expected_, **extra) -> fb.Mismatch:
    return fb.Mismatch(what_, value_, expected_, extra=extra, rank=extra.pop("rank", None),
                       world_size=extra.pop("world_size", None))


def _token_order_slots(idx: torch.Tensor, E: int, C: int):
    """The classic mistake: slots handed out token by token, second choice right after the first."""
    counts = [0] * E
    slot = torch.full_like(idx, -1)
    for t in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if counts[e] < C:
                slot[t, j] = counts[e]
            counts[e] += 1
    return slot >= 0, slot


def test_gating_detectors_name_each_mistake_and_stay_quiet_on_the_truth():
    logits, C = checks._second_before_first_logits(), 4
    want = top_k_gating(logits, 2, C)
    ok = {key: v.clone() for key, v in want.items()}
    base = {"want": want, "k": 2, "capacity": C}

    # second choices take slots in token order
    kept, slot = _token_order_slots(want["expert_index"], 4, C)
    bad = {**ok, "kept": kept, "slot": slot}
    assert "first choice" in checks.second_choice_took_slots(_mm('routing["kept"]', kept, want["kept"], got=bad,
                                                                 **base))
    assert checks.second_choice_took_slots(_mm('routing["kept"]', ok["kept"], want["kept"], got=ok, **base)) is None

    # renormalised after dropping
    w = want["weight"] * want["kept"]
    renorm = w / w.sum(1, keepdim=True)
    assert "AFTER dropping" in checks.renormalised_after_dropping(_mm('routing["weight"]', renorm, want["weight"],
                                                                      **base))
    assert checks.renormalised_after_dropping(_mm('routing["weight"]', ok["weight"], want["weight"], **base)) is None

    # capacity off by one: slot <= C keeps one more
    demand_logits = checks._logits(12, 4, seed=2, hot={0: 1.5})
    want1 = top_k_gating(demand_logits, 1, 3)
    more = top_k_gating(demand_logits, 1, 4)
    msg = checks.capacity_off_by_one(_mm('routing["kept"]', more["kept"], want1["kept"], got=more, want=want1, k=1,
                                         capacity=3))
    assert "slot < capacity" in msg
    fewer = top_k_gating(demand_logits, 1, 2)
    assert "one fewer" in checks.capacity_off_by_one(_mm('routing["kept"]', fewer["kept"], want1["kept"], got=fewer,
                                                         want=want1, k=1, capacity=3))
    assert checks.capacity_off_by_one(_mm('routing["kept"]', want1["kept"], want1["kept"], got=want1, want=want1,
                                          k=1, capacity=3)) is None

    # softmax over the top-k only
    ones = torch.ones_like(want1["weight"])
    assert "raw probability" in checks.softmax_over_top_k(_mm('routing["weight"]', ones, want1["weight"], k=1))
    top_only = torch.zeros_like(want["probs"]).scatter(1, want["expert_index"], want["weight"])
    assert "ALL E experts" in checks.softmax_over_top_k(_mm('routing["probs"]', top_only, want["probs"], k=2))
    assert checks.softmax_over_top_k(_mm('routing["probs"]', want["probs"], want["probs"], k=2)) is None


def test_aux_loss_detectors_name_local_counts_missing_k_and_missing_E():
    per_rank = checks._aux_inputs([5, 8, 11], 6, 2, seed=25)
    probs = torch.cat([p for p, _ in per_rank])
    idx = torch.cat([i for _, i in per_rank])
    want = load_balancing_loss(probs, idx, 6)
    local = [load_balancing_loss(p, i, 6) for p, i in per_rank]
    extra = {"k": 2, "E": 6, "local": local, "sizes": [5, 8, 11], "values": local}
    m = lambda got, r=0: _mm("load-balancing loss", got, want, rank=r, world_size=3, **extra)  # noqa: E731
    assert "its own 8 tokens" in checks.local_batch_loss(m(local[1], 1))
    assert "mean of the ranks' local losses" in checks.local_batch_loss(m(torch.stack(local).mean()))
    assert "k = 2" in checks.aux_scale_mistakes(m(2 * want))
    assert "×E is missing" in checks.aux_scale_mistakes(m(want / 6))
    for d in checks.AUX_DETECT:
        assert d(_mm("load-balancing loss", want, want, rank=0, world_size=3, k=2, E=6, local=local,
                     sizes=[5, 8, 11], values=[want] * 3)) is None


def test_dispatch_detectors_name_wrong_rank_and_wrong_combine_weights():
    W, E, C, T, d = 2, 4, 4, 6, 3
    g = torch.Generator().manual_seed(0)
    per_rank = []
    for _ in range(W):
        x = torch.randn(T, d, generator=g, dtype=torch.float64)
        per_rank.append((x, top_k_gating(torch.randn(T, E, generator=g, dtype=torch.float64), 2, C)))
    from reference.moe import dispatch
    singles = [dispatch(x, rt, E, C) for x, rt in per_rank]                 # (E, C, d) each
    # Wrong placement: rank r gets experts e with e % W == r (interleaved instead of blocks).
    wrong = torch.cat([s[[0, 2]] for s in singles], dim=1)                  # rank 0 with experts 0 and 2
    right = torch.cat([s[[0, 1]] for s in singles], dim=1)
    msg = checks.sent_to_wrong_rank(_mm("buffer", wrong, right, rank=0, per_rank=per_rank, E=E))
    assert "e // (E/W)" in msg and "e mod W" in msg

    x, routing = per_rank[0]
    truth = dispatch_combine_single(x, routing, E, C, torch.ones(T, d, dtype=torch.float64))
    parts = truth["per_assignment"]
    no_w = parts.sum(1)
    assert "not applied" in checks.combine_weights_wrong(_mm("y", no_w, truth["out"], per_assignment=parts,
                                                             routing=routing))
    twice = (parts * routing["weight"].unsqueeze(-1) ** 2).sum(1)
    assert "twice" in checks.combine_weights_wrong(_mm("y", twice, truth["out"], per_assignment=parts,
                                                       routing=routing))
    assert checks.combine_weights_wrong(_mm("y", truth["out"], truth["out"], per_assignment=parts,
                                            routing=routing)) is None


def test_grad_sync_detector_names_the_expert_parallel_size():
    data = ep_dp_local_grads(4, 2, seed=41)
    want = data["want_experts"][0][0]
    edp = 4 // 2
    wrong = sum(data["experts"][r][0] for r in (0, 2)) / edp       # divided by the expert-dp size
    msg = checks.off_by_ep_size(_mm("expert gradient 0", wrong, want, world_size=4, ep=2))
    assert "EP = 2×" in msg and "expert-data-parallel size" in msg
    assert checks.off_by_ep_size(_mm("expert gradient 0", want, want, world_size=4, ep=2)) is None


def test_grad_sync_check_data_carries_the_balance_loss_and_a_summed_router_gradient_is_named():
    data = ep_dp_local_grads(4, 2, seed=41)
    plain = ep_dp_local_grads(4, 2, seed=41, c_aux=0.0, c_z=0.0)
    assert (data["want_dense"][0] - plain["want_dense"][0]).abs().max() > 1e-3   # aux + z reach the router
    want = data["want_dense"][0]
    summed = sum(data["dense"][r][0] for r in range(4))
    msg = checks.dense_not_averaged(_mm("dense (router) gradient 0", summed, want, world_size=4))
    assert "N = 4×" in msg and "MEAN" in msg
    assert checks.dense_not_averaged(_mm("dense (router) gradient 0", want, want, world_size=4)) is None


# ----------------------------------------------------------------------------------------------
# The grader, end to end


@pytest.mark.slow
def test_reference_scores_full_marks_and_stubs_score_zero(course_grades):
    ids = ["5b.1", "5b.2", "5b.3", "5b.4"]
    ref = {r.exercise.id: r for r in course_grades("reference")[0]}
    for i in ids:
        assert ref[i].score == ref[i].max_score > 0, [c.message for c in ref[i].checks if not c.passed]
    stubs = {r.exercise.id: r for r in course_grades("exercises")[0]}
    assert all(stubs[i].score == 0 for i in ids)


MUTANTS = {
    "divide_by_expert_dp": ("sync_moe_gradients", '''
        def sync_moe_gradients(dense_params, expert_params, *, dp_group, expert_dp_group):
            from reference import comm
            for p in dense_params:
                comm.all_reduce(p.grad, group=dp_group); p.grad /= comm.world_size(dp_group)
            for p in expert_params:
                comm.all_reduce(p.grad, group=expert_dp_group); p.grad /= comm.world_size(expert_dp_group)
        '''),
    "token_order_slots": ("top_k_gating", '''
        def top_k_gating(logits, k, capacity):
            import torch
            probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
            p, idx = probs.topk(k, -1)
            w = p if k == 1 else p / p.sum(-1, keepdim=True)
            flat = torch.nn.functional.one_hot(idx, probs.shape[1]).reshape(-1, probs.shape[1])  # token-major
            pos = ((flat.cumsum(0) - 1) * flat).sum(-1).view(idx.shape)
            kept = torch.ones_like(pos, dtype=torch.bool) if capacity is None else pos < capacity
            return {"probs": probs, "expert_index": idx, "weight": w, "kept": kept,
                    "slot": torch.where(kept, pos, torch.full_like(pos, -1))}
        '''),
}


@pytest.mark.parametrize("mutant,ex_id,words", [("divide_by_expert_dp", "5b.4", "expert-data-parallel size"),
                                                 ("token_order_slots", "5b.1", "before any second choice")])
def test_grader_names_the_classic_mistake(tmp_path, monkeypatch, mutant, ex_id, words):
    name, body = MUTANTS[mutant]
    src = "from reference.moe import *  # noqa\nfrom reference.moe import dispatch, combine, sync_moe_gradients\n"
    failed = grade_mutant(tmp_path, monkeypatch, f"moe_mutant_{mutant}", "moe", src + textwrap.dedent(body), ex_id)
    assert any(words in m for m in failed), failed


# ----------------------------------------------------------------------------------------------
# The drawing and the stubs' contract


@pytest.mark.parametrize("W,E,k,C", [(1, 4, 1, 2), (2, 4, 2, 1), (4, 8, 2, None)])
def test_every_phase_draws_for_top1_top2_and_dropless(W, E, k, C):
    from reference.widgets.player import render_png
    from reference.widgets.routing import draw_routing, routing_caption, routing_player
    trace, _ = _synthetic(W=W, E=E, k=k, C=C, T=5)
    for step in range(len(phases(k))):
        st = routing_state(trace, step)
        assert render_png(draw_routing, st, figsize=(8, 4.5), dpi=40).startswith(b"\x89PNG")
        assert routing_caption(st)
    if C is None:
        assert st["dropless"] and not any(st["dropped"])
    player = routing_player({(k, 1.0, E, W): trace}, k=k, capacity_factor=1.0, num_experts=E, world_size=W)
    assert player.n_steps == len(phases(k))


def test_exercise_stubs_have_the_reference_signatures_and_docstrings():
    import inspect

    import exercises.moe as stubs
    import reference.moe as ref
    for name in ("top_k_gating", "load_balancing_loss", "dispatch", "combine", "sync_moe_gradients"):
        a, b = getattr(stubs, name), getattr(ref, name)
        assert inspect.signature(a) == inspect.signature(b), name
        assert a.__doc__ == b.__doc__, name
        with pytest.raises(NotImplementedError, match="Exercise 5b"):
            a(*[None] * len([p for p in inspect.signature(a).parameters.values()
                             if p.default is inspect.Parameter.empty and p.kind != p.KEYWORD_ONLY]),
              **{p.name: None for p in inspect.signature(a).parameters.values()
                 if p.kind == p.KEYWORD_ONLY and p.default is inspect.Parameter.empty})
