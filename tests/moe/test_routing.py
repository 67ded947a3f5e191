"""Single-process semantics of the MoE router and layer (reference.moe.routing, reference.moe.layer).

Each pinned choice (softmax before top-k, weights renormalised before dropping, first choices take
slots before second choices, capacity = ceil(k·cf·T/E), dropped assignments output 0, Switch's
load-balancing loss, ST-MoE's z-loss) has a test with a hand-worked expectation.
"""
import math

import pytest
import torch

from reference.moe import (MoELayer, expert_capacity, gshard_random_routing, load_balancing_loss, router_z_loss,
                           top_k_gating)


def test_expert_capacity_is_ceil_k_cf_T_over_E_and_at_least_one():
    assert expert_capacity(10, 4, 1, 1.0) == 3          # ceil(2.5)
    assert expert_capacity(10, 4, 2, 1.0) == 5
    assert expert_capacity(16, 8, 2, 1.25) == 5         # ceil(5.0)
    assert expert_capacity(16, 8, 2, 1.3) == 6          # ceil(5.2)
    assert expert_capacity(1, 64, 1, 1.0) == 1
    assert expert_capacity(0, 8, 2, 1.0) == 1
    with pytest.raises(ValueError):
        expert_capacity(8, 0, 1, 1.0)
    with pytest.raises(ValueError):
        expert_capacity(8, 4, 1, 0.0)


def test_softmax_is_over_all_experts_in_float32_or_wider():
    logits = torch.randn(5, 6)
    for dtype, want in [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                        (torch.float32, torch.float32), (torch.float64, torch.float64)]:
        r = top_k_gating(logits.to(dtype), 2, None)
        assert r["probs"].dtype == want and r["weight"].dtype == want
        torch.testing.assert_close(r["probs"], torch.softmax(logits.to(dtype).to(want), -1), atol=0, rtol=0)


def test_top1_weight_is_the_raw_probability_and_router_gets_gradient():
    logits = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    r = top_k_gating(logits, 1, None)
    p = torch.softmax(logits, -1)
    assert torch.equal(r["expert_index"][:, 0], p.argmax(-1))
    torch.testing.assert_close(r["weight"][:, 0], p.max(-1).values, atol=0, rtol=0)
    r["weight"].sum().backward()
    assert logits.grad.abs().sum() > 0    # a softmax over the top-1 only would give weight 1, no gradient


def test_top2_weights_renormalised_before_dropping():
    # 4 tokens all prefer expert 0 then expert 1; capacity 1 drops most assignments.
    logits = (torch.tensor([[3.0, 2.0, 0.0]] * 4, dtype=torch.float64)
              + torch.arange(4.0, dtype=torch.float64)[:, None] * 0.01)
    r = top_k_gating(logits, 2, 1)
    p = torch.softmax(logits, -1)
    want = p[:, :2] / p[:, :2].sum(-1, keepdim=True)
    torch.testing.assert_close(r["weight"], want, atol=0, rtol=0)
    assert (~r["kept"]).any()
    # a dropped assignment keeps its weight value: the first choice of token 0 is NOT given weight 1
    assert r["kept"][0].tolist() == [True, True] and r["kept"][1].tolist() == [False, False]
    torch.testing.assert_close(r["weight"].sum(-1), torch.ones(4, dtype=torch.float64), atol=1e-15, rtol=0)


def test_first_choices_take_slots_before_any_second_choice():
    # token 0: first e0, second e1;  token 1: first e1, second e0.  Capacity 1.
    # In token order token 0's SECOND choice would reach expert 1 first; token 1's FIRST must win.
    logits = torch.tensor([[2.0, 1.0], [1.0, 2.0]])
    r = top_k_gating(logits, 2, 1)
    assert r["expert_index"].tolist() == [[0, 1], [1, 0]]
    assert r["slot"].tolist() == [[0, -1], [0, -1]]
    assert r["kept"].tolist() == [[True, False], [True, False]]


def test_slots_follow_token_order_within_a_choice_and_dropless_keeps_all():
    logits = torch.tensor([[5.0, 1.0, 0.0], [5.0, 0.0, 1.0], [1.0, 5.0, 0.0], [5.0, 1.0, 0.0]])
    r = top_k_gating(logits, 2, 2)
    # first choices: e0 <- t0, t1, t3 (slots 0, 1, 2);  e1 <- t2 (slot 0)
    # second choices: e1 <- t0 (slot 1), t3 (slot 2);  e2 <- t1 (slot 0);  e0 <- t2 (slot 3)
    assert r["expert_index"].tolist() == [[0, 1], [0, 2], [1, 0], [0, 1]]
    assert r["slot"].tolist() == [[0, 1], [1, 0], [0, -1], [-1, -1]]
    dropless = top_k_gating(logits, 2, None)
    assert dropless["kept"].all()
    assert dropless["slot"].tolist() == [[0, 1], [1, 0], [0, 3], [2, 2]]


def test_k_must_be_between_1_and_E():
    with pytest.raises(ValueError):
        top_k_gating(torch.randn(3, 4), 5, None)
    with pytest.raises(ValueError):
        top_k_gating(torch.randn(3, 4), 0, None)


def test_load_balancing_loss_is_exactly_one_under_uniform_probabilities():
    for E, k in [(4, 1), (8, 2), (5, 3)]:
        probs = torch.full((12, E), 1.0 / E, dtype=torch.float64)
        for idx in [torch.randint(0, E, (12, 1)).repeat(1, k) if k == 1 else torch.stack(
                [torch.randperm(E)[:k] for _ in range(12)]), torch.arange(k).repeat(12, 1)]:
            assert abs(load_balancing_loss(probs, idx, E).item() - 1.0) < 1e-14


def test_load_balancing_loss_tends_to_E_under_collapse_for_top1():
    E = 8
    values = []
    for s in [2.0, 8.0, 40.0]:
        logits = torch.zeros(16, E, dtype=torch.float64)
        logits[:, 3] = s
        r = top_k_gating(logits, 1, None)
        values.append(load_balancing_loss(r["probs"], r["expert_index"], E).item())
    assert values[0] < values[1] < values[2] and abs(values[2] - E) < 1e-12


def test_load_balancing_loss_hand_value_counts_all_k_choices_before_dropping():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]], dtype=torch.float64)
    idx = torch.tensor([[0, 1], [1, 2]])
    f = torch.tensor([1, 2, 1], dtype=torch.float64) / 4        # assignments / (k·T)
    P = probs.mean(0)
    want = 3 * (f * P).sum()
    assert abs(load_balancing_loss(probs, idx, 3).item() - want.item()) < 1e-15
    # and only P carries the gradient: dL/dp_{t,i} = E · f_i / T
    probs.requires_grad_()
    load_balancing_loss(probs, idx, 3).backward()
    torch.testing.assert_close(probs.grad, (3 * f / 2).expand(2, 3), atol=1e-15, rtol=0)


def test_router_z_loss_hand_value():
    logits = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]], dtype=torch.float64)
    want = (math.log(4.0) ** 2 + (1.0 + math.log(2.0)) ** 2) / 2
    assert abs(router_z_loss(logits).item() - want) < 1e-14


def _layer(k, cf, dropless=False, E=4, seed=0):
    torch.manual_seed(seed)
    return MoELayer(6, 10, E, k=k, capacity_factor=cf, dropless=dropless).double()


@pytest.mark.parametrize("k,cf,dropless", [(1, 1.0, False), (2, 0.5, False), (2, 2.0, False), (2, 1.0, True)])
def test_layer_equals_per_token_weighted_sum_of_kept_experts(k, cf, dropless):
    layer = _layer(k, cf, dropless)
    x = torch.randn(12, 6, dtype=torch.float64)
    y, st = layer(x)
    r = st["routing"]
    want = torch.zeros_like(x)
    for t in range(12):
        for j in range(k):
            if r["kept"][t, j]:
                want[t] += r["weight"][t, j] * layer.experts[int(r["expert_index"][t, j])](x[t:t + 1])[0]
    torch.testing.assert_close(y, want, atol=1e-12, rtol=0)
    C = st["capacity"]
    assert C == (None if dropless else expert_capacity(12, 4, k, cf))
    counts = torch.bincount(r["expert_index"].flatten(), minlength=4)
    assert torch.equal(st["tokens_per_expert"], counts)
    want_kept = counts if dropless else counts.clamp(max=C)
    assert torch.equal(st["kept_per_expert"], want_kept)
    assert st["dropped"] == int(12 * k - want_kept.sum())
    torch.testing.assert_close(st["aux_loss"], load_balancing_loss(r["probs"], r["expert_index"], 4), atol=0, rtol=0)
    torch.testing.assert_close(st["z_loss"], router_z_loss(layer.router(x)), atol=0, rtol=0)


def test_tokens_dropped_by_every_expert_output_exactly_zero():
    layer = _layer(2, 0.25)
    x = torch.randn(16, 6, dtype=torch.float64)
    y, st = layer(x)
    gone = ~st["routing"]["kept"].any(-1)
    assert gone.sum() >= 2 and st["dropped"] > 0
    assert torch.equal(y[gone], torch.zeros_like(y[gone]))
    assert (y[~gone].abs().sum(-1) > 0).all()


def test_jitter_and_random_second_expert_are_off_by_default_and_only_act_when_training():
    layer = _layer(2, 1.0)
    x = torch.randn(16, 6, dtype=torch.float64)
    y1, _ = layer(x)
    y2, _ = layer(x)
    assert torch.equal(y1, y2)
    noisy = MoELayer(6, 10, 4, k=2, jitter=0.1, random_second_expert=True).double()
    noisy.load_state_dict(layer.state_dict())
    noisy.eval()
    assert torch.equal(noisy(x)[0], y1)


def test_gshard_random_routing_drops_unchosen_second_experts_and_frees_their_slots():
    logits = torch.randn(200, 4, dtype=torch.float64)
    r = top_k_gating(logits, 2, None)
    g = torch.Generator().manual_seed(0)
    rr = gshard_random_routing(r, 4, None, generator=g)
    assert rr["kept"][:, 0].all()
    frac = rr["kept"][:, 1].double().mean().item()
    assert abs(frac - (2 * r["weight"][:, 1]).mean().item()) < 0.1      # kept with probability 2·w2
    torch.testing.assert_close(rr["weight"], r["weight"], atol=0, rtol=0)  # no re-renormalisation
    for e in range(4):   # slots of each expert are 0..n-1 over the kept assignments
        s = rr["slot"][(rr["expert_index"] == e) & rr["kept"]]
        assert sorted(s.tolist()) == list(range(len(s)))


# --- lecture 5b §7: dense (GShard einsum) vs index dispatch ---------------------------------------

@pytest.mark.parametrize("tokens,experts,cf", [(64, 4, 1.0), (96, 8, 0.5), (50, 3, 2.0)])
def test_dense_einsum_dispatch_equals_index_dispatch(tokens, experts, cf):
    from reference.moe.dense_dispatch import dense_dispatch_combine, index_dispatch_combine, random_routing
    k = 2
    capacity = math.ceil(k * cf * tokens / experts)
    r = random_routing(tokens, experts, k, capacity, seed=3)
    # every kept slot is unique and inside the buffers; drops happen when cf < 1
    where = r["expert"] * capacity + r["slot"]
    assert where.unique().numel() == where.numel() and int(r["slot"].max()) < capacity
    if cf < 1:
        assert r["token"].numel() < k * tokens
    x = torch.randn(tokens, 16, dtype=torch.float64) * 30
    fn = lambda b: torch.sin(b) * 2 + b                                    # noqa: E731
    bd, yd = dense_dispatch_combine(x, r, experts, capacity, fn)
    bi, yi = index_dispatch_combine(x, r, experts, capacity, fn)
    torch.testing.assert_close(bi, bd, rtol=0, atol=1e-12)
    torch.testing.assert_close(yi, yd, rtol=0, atol=1e-10)
    # ground truth by a loop over the kept assignments
    y = torch.zeros_like(x)
    for t, e, w in zip(r["token"].tolist(), r["expert"].tolist(), r["weight"].tolist()):
        y[t] += w * fn(x[t])
    torch.testing.assert_close(yi, y, rtol=0, atol=1e-10)


def test_dense_vs_index_counts():
    from reference.moe.dense_dispatch import dense_vs_index
    r = dense_vs_index(tokens=128, num_experts=4, d_model=8, k=2, reps=1)
    assert r["capacity"] == 64 and r["max_diff"] < 1e-5
    assert r["dense_flops"] == 2 * 2 * 128 * 4 * 64 * 8
    assert r["index_elements"] == 2 * r["kept"] * 8
