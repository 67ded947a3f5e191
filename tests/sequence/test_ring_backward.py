"""Exercise 5a.5 (the ring attention backward) and its grader.

The reference and a correct submission written here (not the reference's code) earn full marks,
on the published and on fresh inputs; the stub earns nothing; each classic mistake, written into
that submission, loses points and is named.  The grader's alternatives (its block-by-block
FlashAttention-2 formulas) are themselves checked against autograd.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from exercises.grading import core, session
from exercises.grading.checks.sequence import ring_backward as rb
from tests.conftest import grade_mutant

# A learner's ring backward, written independently of the reference: each step computes the held
# block, then passes the accumulator and K/V on (blocking waits, no overlap).  ``BUG`` picks a mistake.
LEARNER = '''
import math
import torch
from reference import comm
from reference.sequence.blockwise import attention_block, attention_block_backward
from reference.sequence.ring import block_plan

BUG = ""


def ring_attention_backward(dout, q, k, v, out, lse, *, causal=False, layout="contiguous", group=None,
                            kernel="fused"):
    W, r = comm.world_size(group), comm.rank(group)
    nxt, prv = comm.ring_peers(group)
    if BUG == "dkv_backwards":
        send_acc, recv_acc = prv, nxt
    else:
        send_acc, recv_acc = nxt, prv
    n = q.shape[-2]
    wide = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=wide)
    held = (k, v)
    arrived = None                 # the accumulator of the block held, from the previous rank
    mine = None                    # my share of my own block
    kept = [torch.zeros(k.shape, dtype=wide), torch.zeros(v.shape, dtype=wide)]
    for s in range(W):
        j = (r - s) % W
        part_k = torch.zeros(k.shape, dtype=wide)
        part_v = torch.zeros(v.shape, dtype=wide)
        plan = block_plan(r, j, W, "contiguous" if BUG == "contiguous_rules" else layout, causal, n)
        if BUG == "diag_unmasked" and j == r:
            plan = block_plan(r, j, W, layout, False, n)
        for p in plan:
            qs, ks = q[..., p.q, :], held[0][..., p.k, :]
            vs = held[1][..., p.k, :]
            o, l = out[..., p.q, :], lse[..., p.q]
            if BUG in ("local_lse", "local_d"):
                o_blk, l_blk = attention_block(qs, ks, vs, causal=p.causal)
                o, l = (o, l_blk) if BUG == "local_lse" else (o_blk, l)
            a, b, c = attention_block_backward(dout[..., p.q, :], qs, ks, vs, o, l, causal=p.causal)
            if BUG == "scaled_twice":
                a, b = a / math.sqrt(q.shape[-1]), b / math.sqrt(q.shape[-1])
            dq[..., p.q, :] += a
            part_k[..., p.k, :] += b
            part_v[..., p.k, :] += c
        kept[0] += part_k
        kept[1] += part_v
        if s == 0:
            mine = (part_k, part_v)
        elif BUG != "own_only":
            if arrived is not None:
                part_k, part_v = part_k + arrived[0], part_v + arrived[1]
            bufs = (torch.empty_like(part_k), torch.empty_like(part_v))
            comm.exchange([(part_k, send_acc), (part_v, send_acc)], [(bufs[0], recv_acc), (bufs[1], recv_acc)],
                          group=group, step=s, what="dkv").wait()
            arrived = bufs
        if s < W - 1:
            nb = (torch.empty_like(k), torch.empty_like(v))
            comm.exchange([(held[0], nxt), (held[1], nxt)], [(nb[0], prv), (nb[1], prv)], group=group, step=s,
                          what="kv").wait()
            held = nb
    if BUG == "kept":
        return dq.to(q.dtype), kept[0].to(k.dtype), kept[1].to(v.dtype)
    dk, dv = mine
    if arrived is not None:
        dk, dv = dk + arrived[0], dv + arrived[1]
    if BUG == "own_twice":
        dk, dv = dk + mine[0], dv + mine[1]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
'''

# A complete accumulator, one hop short of home: it starts with the owner's share and travels with
# K/V (W − 1 hops), so rank r ends holding rank r+1's finished gradient.
ONE_SHORT = '''
def ring_attention_backward(dout, q, k, v, out, lse, *, causal=False, layout="contiguous", group=None,
                            kernel="fused"):
    W, r = comm.world_size(group), comm.rank(group)
    nxt, prv = comm.ring_peers(group)
    n = q.shape[-2]
    dq = torch.zeros(q.shape, dtype=torch.float64)
    held = [k, v, torch.zeros(k.shape, dtype=torch.float64), torch.zeros(v.shape, dtype=torch.float64)]
    for s in range(W):
        j = (r - s) % W
        for p in block_plan(r, j, W, layout, causal, n):
            a, b, c = attention_block_backward(dout[..., p.q, :], q[..., p.q, :], held[0][..., p.k, :],
                                               held[1][..., p.k, :], out[..., p.q, :], lse[..., p.q],
                                               causal=p.causal)
            dq[..., p.q, :] += a
            held[2][..., p.k, :] += b
            held[3][..., p.k, :] += c
        if s < W - 1:
            nb = [torch.empty_like(t) for t in held]
            comm.exchange([(t, nxt) for t in held], [(t, prv) for t in nb], group=group).wait()
            held = nb
    return dq.to(q.dtype), held[2].to(k.dtype), held[3].to(v.dtype)
'''

MUTANTS = {
    "kept": (LEARNER, "each rank kept the dK/dV shares it computed"),
    "own_only": (LEARNER, "only this rank's own share of its own block"),
    "own_twice": (LEARNER, "counted twice"),
    "one_short": (LEARNER + ONE_SHORT, "hop(s) short of home"),
    "local_d": (LEARNER, "D = rowsum(dO ∘ O) needs the row's FINAL output"),
    "local_lse": (LEARNER, "needs the row's FINAL lse"),
    "diag_unmasked": (LEARNER, "was not masked"),
    "contiguous_rules": (LEARNER, "contiguous layout's causal rule"),
    "scaled_twice": (LEARNER, "the softmax scale 1/√D was applied twice"),
    "dkv_backwards": (LEARNER, "runs the ring the other way round"),      # refused by the ring's send itself
}


def _grade(tmp_path, monkeypatch, package: str, source: str, *, hidden: bool = True):
    pkg = tmp_path / package
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sequence.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        (res,) = session.grade(package, ["5a.5"], include_hidden=hidden)
    finally:
        sys.modules.pop(package, None)
    return res


def _lost(res) -> list[str]:
    return [f"{c.name}: {c.message[:300]}" for c in res.checks if not c.passed]


def test_the_reference_earns_full_marks_on_published_and_fresh_inputs_and_the_stub_nothing(course_grades,
                                                                                          fresh_course_grades):
    # the session's gradings of the whole course, hidden checks included (tests/conftest.py), each done once
    def of(results):
        (res,) = [r for r in results if r.exercise.id == "5a.5"]
        return res
    res = of(course_grades("reference")[0])
    assert res.score == res.max_score == 13 and any(c.hidden for c in res.checks), _lost(res)   # 2 for how it sends
    fresh = of(fresh_course_grades[0])
    assert fresh.score == fresh.max_score, _lost(fresh)
    stub = of(course_grades("exercises")[0])
    assert stub.score == 0 and all("not implemented" in c.message for c in stub.checks)


def test_a_correct_submission_written_elsewhere_earns_full_marks_and_passes_the_feedback_checks(tmp_path, monkeypatch):
    monkeypatch.setattr(core, "_SALT", os.urandom(32))
    res = _grade(tmp_path, monkeypatch, "ring_bwd_correct", LEARNER)
    assert res.score == res.max_score and all(c.passed for c in res.checks), _lost(res)


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(MUTANTS))
def test_each_classic_mistake_loses_points_and_is_named(tmp_path, monkeypatch, bug):
    source, words = MUTANTS[bug]
    failed = grade_mutant(tmp_path, monkeypatch, f"ring_bwd_mutant_{bug}", "sequence",
                          source + f"\nBUG = {bug!r}\n", "5a.5", hidden=False)
    assert any(words in m for m in failed), failed


# ----------------------------------------------------------------------------------------------
# The grader's own arithmetic


@pytest.mark.parametrize("layout", rb.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_block_shares_summed_at_their_owner_are_autograds_gradients(layout, causal):
    W = 3
    inputs = rb.bwd_inputs(2, 4, 12, 8, seed=11, H_kv=2, q_scale=5.0)
    truth = rb.grad_truth(*inputs, causal)
    got = rb._assemble(rb._blocks(inputs, truth, W, layout, causal), W)
    for r in range(W):
        pos = rb.layout_positions(12, r, W, layout)
        for i, name in enumerate(("dq", "dk", "dv")):
            torch.testing.assert_close(got[r][i], truth[name][..., pos, :], atol=1e-10, rtol=1e-9)


def test_grad_truth_is_torchs_own_attention_gradient():
    q, k, v, dout = rb.bwd_inputs(1, 4, 10, 8, seed=12, H_kv=2, q_scale=50.0)
    truth = rb.grad_truth(q, k, v, dout, True)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
    out.backward(dout)
    for name, t in (("out", out), ("dq", qg.grad), ("dk", kg.grad), ("dv", vg.grad)):
        torch.testing.assert_close(truth[name], t.detach(), atol=1e-9, rtol=1e-7)
    assert torch.isfinite(truth["dk"]).all() and truth["dk"].abs().max() > 1      # scores ~ ±50: not vanishing


def test_the_message_judge_counts_kv_and_the_accumulators():
    from exercises.grading.referee import SEND
    W, n, H, D = 4, 4, 2, 8
    hop = 2 * n * H * D                     # K and V (or dK and dV) of one block, in elements

    def log(hops: int):                     # as the referee logs it: per rank, (op, peer, elements, allowed)
        return [[(SEND, (r + 1) % W, hop, True)] * hops for r in range(W)]
    rb.judge_backward_messages(log(2 * (W - 1)), W, n, H, D)
    with pytest.raises(core.CheckFailed, match="and nothing else"):
        rb.judge_backward_messages(log(W - 1), W, n, H, D)
    with pytest.raises(core.CheckFailed, match="one hop too many"):
        rb.judge_backward_messages(log(2 * W - 1), W, n, H, D)
