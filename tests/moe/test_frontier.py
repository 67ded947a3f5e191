"""Frontier MoE pieces on one process (lecture 5b, part 2): the sigmoid router, the loss-free bias, the
sequence-wise balance loss, node-limited routing, fine-grained and shared experts, the grouped GEMM against
the per-expert loop, the hidden fraction of an all-to-all and the bytes that cross nodes.  Each against a
truth written out here independently (loops, hand-made examples), float64 where the path allows."""
from __future__ import annotations

import pytest
import torch

from reference.mesh import RankGrid
from reference.moe import (MoELayer, load_balancing_loss, loss_free_bias_update, make_expert, node_limited_mask,
                           run_experts, sequence_balance_loss, sequence_ids, top_k_gating, top_k_routing)
from reference.moe.overlap import hidden_fraction
from reference.moe.placement import cross_node_bytes, expert_nodes, measured_cross_node_bytes
from reference.trace import Event, Trace

G = torch.Generator().manual_seed(0)


def randn(*shape, scale=1.0):
    return scale * torch.randn(*shape, generator=G, dtype=torch.float64)


# ------------------------------------------------------------------------------------------ routing


def test_defaults_are_the_exercises_top_k_gating():
    logits = randn(12, 6)
    a, b = top_k_routing(logits, 2, 3), top_k_gating(logits, 2, 3)
    assert all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("k", [1, 2, 8])
def test_sigmoid_router_weights_are_scores_normalised_over_the_chosen_k(k):
    logits = randn(10, 16, scale=3.0)
    r = top_k_routing(logits, k, None, router="sigmoid")
    s = torch.sigmoid(logits)
    for t in range(10):
        best = sorted(range(16), key=lambda e: -float(s[t, e]))[:k]          # by hand
        assert r["expert_index"][t].tolist() == best
        top = s[t, best]
        want = top if k == 1 else top / top.sum()
        torch.testing.assert_close(r["weight"][t], want, rtol=0, atol=1e-15)
    torch.testing.assert_close(r["probs"], s / s.sum(1, keepdim=True), rtol=0, atol=1e-15)


def test_sigmoid_router_with_large_logits_stays_finite():
    r = top_k_routing(randn(8, 8, scale=400.0), 2, None, router="sigmoid")
    assert all(torch.isfinite(r[key].double()).all() for key in ("probs", "weight"))


def test_loss_free_bias_changes_the_choice_not_the_weights():
    logits = randn(32, 8)
    bias = torch.zeros(8, dtype=torch.float64)
    bias[3] = 10.0                                        # expert 3 wins every token's first choice ...
    r = top_k_routing(logits, 2, None, router="sigmoid", bias=bias)
    assert (r["expert_index"][:, 0] == 3).all()
    s = torch.sigmoid(logits).gather(1, r["expert_index"])
    torch.testing.assert_close(r["weight"], s / s.sum(1, keepdim=True))   # ... its weight is its own score


def test_bias_update_steps_each_expert_by_gamma_towards_the_mean_load():
    bias = torch.zeros(4, dtype=torch.float64)
    loss_free_bias_update(bias, torch.tensor([5, 1, 3, 3]), 0.01)          # mean 3
    assert bias.tolist() == [-0.01, 0.01, 0.0, 0.0]


def test_node_limited_mask_by_hand():
    # 6 experts on 3 nodes: {0, 1} {2, 3} {4, 5}; k = 2, M = 1 → node score = best single expert (⌈2/1⌉ = 2: sum of 2)
    scores = torch.tensor([[0.9, 0.0, 0.5, 0.5, 0.1, 0.2],       # node sums 0.9, 1.0, 0.3 → node 1
                           [0.1, 0.1, 0.0, 0.0, 0.9, 0.0]])      # 0.2, 0.0, 0.9 → node 2
    mask = node_limited_mask(scores, torch.tensor([0, 0, 1, 1, 2, 2]), 1, 2)
    assert mask.tolist() == [[False, False, True, True, False, False], [False, False, False, False, True, True]]
    with pytest.raises(ValueError, match="fewer than k=3"):
        node_limited_mask(scores, torch.tensor([0, 0, 1, 1, 2, 2]), 1, 3)
    with pytest.raises(ValueError, match="fewer than k=3"):         # and when a layer is built, before any message
        MoELayer(4, 8, 6, k=3, dropless=True, node_of_expert=[0, 0, 1, 1, 2, 2], max_nodes=1)


def test_sequence_balance_loss_is_the_mean_of_each_sequences_own_loss():
    probs = torch.softmax(randn(12, 4), -1)
    idx = probs.topk(2, -1).indices
    seq = sequence_ids(3, 4)                              # 3 sequences of 4 tokens, contiguous
    want = sum(load_balancing_loss(probs[4 * i:4 * i + 4], idx[4 * i:4 * i + 4], 4) for i in range(3)) / 3
    torch.testing.assert_close(sequence_balance_loss(probs, idx, 4, sequence=seq, num_sequences=3), want)
    # sequence-first layout (the composed model's (S, B) tokens): the same sequences, strided
    sf = sequence_ids(3, 4, sequence_first=True)
    perm = torch.argsort(sf, stable=True)
    torch.testing.assert_close(sequence_balance_loss(probs[perm], idx[perm], 4, sequence=seq, num_sequences=3),
                               sequence_balance_loss(probs, idx, 4, sequence=sf, num_sequences=3))


def test_sequence_balance_loss_sees_imbalance_the_batch_loss_averages_away():
    """Each sequence sends all its tokens to its own expert: the batch is balanced, no sequence is."""
    E = 4
    probs = torch.full((16, E), 0.01, dtype=torch.float64)
    idx = torch.arange(4).repeat_interleave(4).unsqueeze(1)
    probs[torch.arange(16), idx[:, 0]] = 0.97
    batch = load_balancing_loss(probs, idx, E)
    per_seq = sequence_balance_loss(probs, idx, E, sequence=sequence_ids(4, 4), num_sequences=4)
    assert abs(float(batch) - 1.0) < 1e-12 and float(per_seq) > 3.8


# ------------------------------------------------------------------------------------------ experts


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_loop_outputs_and_gradients(activation, dtype):
    torch.manual_seed(0)
    experts = [make_expert(16, 32, activation).to(dtype) for _ in range(5)]
    counts = [7, 0, 3, 12, 1]                              # an expert with no rows
    x = torch.randn(sum(counts), 16, dtype=dtype, requires_grad=True)
    g = torch.randn(sum(counts), 16, dtype=dtype)
    out, grads = {}, {}
    for impl in ("loop", "grouped"):
        for e in experts:
            e.zero_grad()
        x.grad = None
        y = run_experts(experts, x, counts, impl)
        y.backward(g)
        out[impl] = y.detach().float()
        grads[impl] = [x.grad.float()] + [p.grad.float() if p.grad is not None else torch.zeros_like(p).float()
                                           for e in experts for p in e.parameters()]
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(out["grouped"], out["loop"], **tol)
    for a, b in zip(grads["grouped"], grads["loop"]):
        torch.testing.assert_close(a, b, **tol)


def test_a_layer_on_the_grouped_gemm_equals_the_layer_on_the_loop():
    torch.manual_seed(3)
    layers = {impl: MoELayer(16, 8, 8, k=4, dropless=True, router="sigmoid", shared_experts=1, experts_impl=impl)
              for impl in ("loop", "grouped")}
    layers["grouped"].load_state_dict(layers["loop"].state_dict())
    x = torch.randn(24, 16)
    out = {}
    for impl, layer in layers.items():
        xi = x.clone().requires_grad_()
        y, st = layer(xi)
        (y.square().sum() + st["aux_loss"]).backward()
        out[impl] = [y.detach(), xi.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(out["grouped"], out["loop"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_grouped_gemm_refuses_float64_and_unaligned_rows_by_name():
    e = [make_expert(6, 8) for _ in range(2)]
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        run_experts([m.double() for m in e], torch.zeros(3, 6, dtype=torch.float64), [1, 2], "grouped")
    with pytest.raises(ValueError, match="16-byte row strides"):
        run_experts([m.float() for m in e], torch.zeros(3, 6), [1, 2], "grouped")
    assert run_experts([m.float() for m in e], torch.zeros(3, 6), [1, 2], "auto").shape == (3, 6)   # the loop


def test_fine_grained_shared_layer_equals_its_definition_token_by_token():
    """y_t = shared(x_t) + Σ_j w_tj · FFN_{e_tj}(x_t), written as a loop over tokens (float64, loop path)."""
    torch.manual_seed(1)
    layer = MoELayer(8, 4, 16, k=8, dropless=True, router="sigmoid", shared_experts=2).double()
    x = randn(10, 8)
    y, st = layer(x)
    r = st["routing"]
    for t in range(10):
        want = layer.shared(x[t]) + sum(r["weight"][t, j] * layer.experts[int(r["expert_index"][t, j])](x[t])
                                        for j in range(8))
        torch.testing.assert_close(y[t], want)
    assert layer.shared[0].out_features == 8                 # 2 shared experts of expert_ffn 4: one FFN of 8


def test_layer_counts_loads_in_training_and_steps_its_bias():
    torch.manual_seed(2)
    layer = MoELayer(8, 8, 4, k=1, dropless=True, balance="loss_free", bias_update_rate=0.1).double()
    layer.train()
    _, st = layer(randn(20, 8))
    torch.testing.assert_close(layer.load, st["tokens_per_expert"].double())
    load = layer.load.clone()
    layer.update_bias()
    torch.testing.assert_close(layer.expert_bias, 0.1 * torch.sign(load.mean() - load))
    assert layer.load.sum() == 0 and float(st["aux_loss"].detach()) == 0.0
    assert "expert_bias" in layer.state_dict()               # saved with the model: a resume keeps balancing


# ------------------------------------------------------------------------------------------ overlap, placement


def _event(rank, op, start, end, **meta):
    return Event(rank, op, None, 0, None, start, end, meta)


def test_hidden_fraction_is_the_part_of_each_all_to_all_under_compute():
    trace = Trace([
        _event(0, "all_to_all", 0.0, 4.0, what="dispatch"),          # computes 1-3 under it: 2 of 4 hidden
        _event(0, "compute", 1.0, 2.0, what="experts"), _event(0, "compute", 1.5, 3.0, what="experts"),
        _event(0, "all_to_all", 5.0, 6.0, what="combine"),           # nothing under it
        _event(1, "compute", 5.0, 6.0, what="experts"),              # another rank's: does not count
        _event(0, "all_to_all", 7.0, 8.0, what="counts"),            # not a dispatch/combine
    ])
    h = hidden_fraction(trace, rank=0)
    assert h["count"] == 2 and h["all_to_all_s"] == 5.0 and h["hidden_s"] == 2.0 and h["fraction"] == 0.4


def test_folding_moves_the_all_to_all_inside_the_node():
    kw = dict(tokens=4096, d_model=7168, k=8, bytes_per_element=2)
    unfolded = cross_node_bytes(RankGrid(64, tp=8, dp=8, ep=8), 8, **kw)
    folded = cross_node_bytes(RankGrid(64, tp=8, dp=8, ep=8, etp=1), 8, **kw)
    row = 8 * 4096 * 7168 * 2
    assert unfolded["remote_peers"] == 7 and unfolded["cross_node_bytes"] == row * 7 // 8
    assert unfolded["nodes_spanned"] == 8
    assert folded["remote_peers"] == 0 and folded["cross_node_bytes"] == 0 and folded["dispatch_bytes"] == row * 7 // 8
    assert expert_nodes(16, [0, 8, 16, 24], 8) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4


def test_measured_cross_node_bytes_reads_destinations_from_the_trace():
    grid = RankGrid(4, dp=4, ep=4)                          # ep group {0, 1, 2, 3}, two nodes of 2
    trace = Trace([_event(0, "all_to_all", 0, 1, what="dispatch", send_bytes=[10, 20, 30, 40]),
                   _event(3, "all_to_all", 0, 1, what="dispatch", send_bytes=[1, 2, 3, 4]),
                   _event(3, "all_to_all", 0, 1, what="combine", send_bytes=[9, 9, 9, 9])])
    assert measured_cross_node_bytes(trace, grid, 2) == {0: 70, 3: 3}


# ------------------------------------------------------------------------------------------ over training


def test_balance_over_training_series_follow_the_bias_rule_and_train_single():
    """The lecture's series (tiny sizes): every loss-free bias step is γ·sign(mean load − load) of the loads
    the series reports; the losses are train_single's; max/mean is at least 1 and at most E/k."""
    from reference.gpt import train_single
    from reference.moe.lecture import BALANCE_SETTINGS, balance_over_training
    kw = dict(num_experts=4, top_k=2, d_model=16, heads=2, layers=2, d_ff=32, seq_len=8, batch_size=4)
    settings = {name: BALANCE_SETTINGS[name] for name in ("aux", "loss_free")}
    res = balance_over_training(4, settings, **kw)
    assert set(res["runs"]) == {"aux", "loss_free"}
    gamma = BALANCE_SETTINGS["loss_free"]["bias_update_rate"]
    run = res["runs"]["loss_free"]
    previous = [[0.0] * 4 for _ in run["bias"][0]]
    moved = 0
    for loads, bias in zip(run["loads"], run["bias"]):
        for layer_load, b, b0 in zip(loads, bias, previous):
            mean = sum(layer_load) / 4
            want = [x + gamma * ((mean > v) - (mean < v)) for x, v in zip(b0, layer_load)]
            assert max(abs(p - q) for p, q in zip(b, want)) < 1e-15
            moved += any(abs(p - q) > 0 for p, q in zip(b, b0))
        previous = bias
    assert moved > 0
    want = train_single(4, batch_size=4, lr=1e-2, moe_every=1, num_experts=4, top_k=2, d_model=16, heads=2, layers=2,
                        d_ff=32, seq_len=8, **BALANCE_SETTINGS["loss_free"])
    assert max(abs(a - b) for a, b in zip(run["loss"], want)) < 1e-12          # (1 thread there: last bits)
    for r in res["runs"].values():
        assert len(r["max_over_mean"]) == 4 and all(1.0 <= x <= 4 / 2 + 1e-12 for x in r["max_over_mean"])
        assert all(sum(layer) == 2 * 4 * 8 for step in r["loads"] for layer in step)      # k · B · S
    assert all(b == [0.0] * 4 for step in res["runs"]["aux"]["bias"] for b in step)      # no bias without loss_free


def test_our_layer_equals_torchtitans_moe_when_installed():
    """The production twin (benchmarks/moe_twin.py): torchtitan 0.3.0's MoE with our weights, forward and backward
    within bfloat16's rounding (its experts run in bfloat16), the same choices — where it is installed in
    benchmarks/.peers (``make bench`` installs it; not a test dependency)."""
    import sys
    from pathlib import Path
    bench = str(Path(__file__).resolve().parents[2] / "benchmarks")
    sys.path.insert(0, bench)
    try:
        import moe_twin
        if not moe_twin.load_peer(install=False):
            pytest.skip("torchtitan is not installed in benchmarks/.peers (make bench installs it)")
        for router, k, shared in (("sigmoid", 4, 1), ("softmax", 2, 0)):
            d = moe_twin.compare(router=router, k=k, shared_experts=shared)
            assert d.pop("same_choices")
            assert max(d.values()) <= moe_twin.TOLERANCE, d
    finally:
        sys.path.remove(bench)
