"""Expert parallelism (reference.moe.parallel, reference.moe.grad_sync) against the single-process MoELayer.

Every case runs forward AND backward of ExpertParallelMoE on W ranks (1, 2, 4) with 8 experts
and compares, in float64 at 1e-10, with the single-process layer applied to each rank's tokens:
outputs, input gradients, router gradients averaged over ranks, every expert's gradients, the
group-wide aux loss and the z-loss.  The objective mixes all three: the mean over ranks of
<g_r, y_r> + c_aux·aux + c_z·z_r.  The EP × DP section runs whole training steps.
"""
import pytest
import torch

from reference.launch import World
from reference.moe import workers
from tests.workers import moe_workers

ATOL = RTOL = 1e-10

CASES = {
    # name: (config, whether assignments must be dropped)
    "top1_cf1_drops": (dict(num_experts=8, k=1, capacity_factor=1.0), True),
    "top1_cf4_keeps_all": (dict(num_experts=8, k=1, capacity_factor=4.0), False),
    "top2_cf0.5_drops": (dict(num_experts=8, k=2, capacity_factor=0.5), True),
    "top2_cf4_keeps_all": (dict(num_experts=8, k=2, capacity_factor=4.0), False),
    "top2_cf1.25_large_logits": (dict(num_experts=8, k=2, capacity_factor=1.25, scale=20.0), True),
    # every token wants experts 0 and 1 (rank 0's): the other ranks' experts get no row, forward or backward
    "top2_cf1_skewed_idle_ranks": (dict(num_experts=8, k=2, capacity_factor=1.0, hot_experts=[0, 1]), True),
    "dropless_top2_skewed_uneven_T": (dict(num_experts=8, k=2, dropless=True, hot_experts=[0, 1], uneven=3), False),
    "dropless_top1_skewed": (dict(num_experts=8, k=1, dropless=True, hot_experts=[5]), False),
    "dropless_top2_balanced": (dict(num_experts=8, k=2, dropless=True), False),
    # frontier MoE (lecture 5b, part 2): fine-grained top-8 of 16 with a sigmoid router and 2 shared experts;
    # loss-free bias (changes the choices, not the weights); sequence-wise balance loss; the all-to-all in two
    # overlapped halves; each token's experts on at most 1 node of 2 ranks; large sigmoid logits; padded + shared
    "frontier_sigmoid_top8_E16_shared2": (dict(num_experts=16, k=8, dropless=True, router="sigmoid",
                                               shared_experts=2, d_ff=4), False),
    "frontier_loss_free_bias": (dict(num_experts=8, k=2, dropless=True, balance="loss_free", bias_scale=0.3), False),
    "frontier_seq_aux": (dict(num_experts=8, k=2, dropless=True, balance="seq_aux", seqs_per_rank=2), False),
    "frontier_overlap_skewed_uneven_T": (dict(num_experts=8, k=2, dropless=True, overlap=True, hot_experts=[0, 1],
                                              uneven=3, shared_experts=1), False),
    "frontier_node_limited_k4_M1": (dict(num_experts=8, k=4, dropless=True, max_nodes=1, devices_per_node=2), False),
    "frontier_sigmoid_large_logits": (dict(num_experts=8, k=2, dropless=True, router="sigmoid", scale=20.0), False),
    "frontier_padded_sigmoid_shared": (dict(num_experts=8, k=2, capacity_factor=1.0, router="sigmoid",
                                            shared_experts=1), True),
}


def close(a, b, what):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def results(world):
    """Run every case once per world size (each run costs milliseconds once ranks are up)."""
    cache = {}

    def get(W, name):
        if (W, name) not in cache:
            cache[W, name] = world(W).run(workers.ep_vs_single, CASES[name][0])
        return cache[W, name]

    return get


@pytest.mark.parametrize("W,name", [(W, n) for n in CASES if not n.endswith("_E6") for W in (1, 2, 4)
                                    if W == 4 or not n.startswith("frontier")])
# (frontier cases: on 4 ranks here, 3 and 8 below, 1 in test_frontier.py, 2 through the composed runs)
def test_expert_parallel_outputs_and_gradients_equal_single_process(results, W, name):
    res = results(W, name)
    vals = res.values
    for v in vals:
        t, r = v["truth"], v["rank"]
        close(v["y"], t["y"], f"rank {r} output")
        close(v["x_grad"], t["x_grad"], f"rank {r} input gradient")
        close(v["z"], t["z"], f"rank {r} z-loss")
        for i, grads in enumerate(v["expert_grads"]):
            for a, b in zip(grads, t["expert_grads"][v["first_expert"] + i]):
                close(a, b, f"expert {v['first_expert'] + i} gradient on rank {r}")
        close(v["router_grad"], t["router_grad"], f"rank {r} router gradient averaged over ranks")
        assert len(v["shared_grads"]) == len(t["shared_grads"])
        for a, b in zip(v["shared_grads"], t["shared_grads"]):
            close(a, b, f"rank {r} shared expert gradient averaged over ranks")
    # the case tests what its name says: drops happen, or none do
    dropped = sum(v["dropped"] for v in vals)
    assert (dropped > 0) == CASES[name][1], f"dropped={dropped}"


ODD = {  # an odd world size: 3 ranks, 6 experts (2 per rank)
    "top2_cf0.5_drops_E6": (dict(num_experts=6, k=2, capacity_factor=0.5), True),
    "dropless_top1_skewed_uneven_T_E6": (dict(num_experts=6, k=1, dropless=True, hot_experts=[2], uneven=2), False),
    # frontier, odd: sigmoid top-3 of 6, a shared expert, a loss-free bias, overlapped halves of 1, 3 and 5 tokens
    "frontier_sigmoid_top3_overlap_tiny_T_E6": (dict(num_experts=6, k=3, dropless=True, router="sigmoid",
                                                     shared_experts=1, balance="loss_free", bias_scale=0.3,
                                                     overlap=True, tokens=1, uneven=2), False),
}
CASES.update(ODD)


@pytest.mark.parametrize("name", list(ODD))
def test_expert_parallel_on_three_ranks_equals_single_process(results, name):
    test_expert_parallel_outputs_and_gradients_equal_single_process(results, 3, name)
    test_aux_loss_is_the_whole_batch_value_on_every_rank(results, 3, name)


@pytest.mark.parametrize("W,name", [(W, n) for n in CASES if n not in ODD for W in (2, 4)
                                    if W == 4 or not n.startswith("frontier")])
def test_aux_loss_is_the_whole_batch_value_on_every_rank(results, W, name):
    vals = results(W, name).values
    for v in vals:
        close(v["aux"], v["truth"]["aux"], f"rank {v['rank']} aux loss")
    # not simply the local value: with skewed or random routing the local losses differ
    assert len({round(float(v["aux"]), 12) for v in vals}) == 1


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("name", ["top1_cf1_drops", "top2_cf0.5_drops"])
def test_dropped_tokens_output_exactly_zero_and_dispatch_sends_min_count_capacity(results, W, name):
    res = results(W, name)
    for v in res.values:
        gone = ~v["kept"].any(-1)
        assert torch.equal(v["y"][gone], torch.zeros_like(v["y"][gone]))
        C = v["capacity"]
        want = int(v["tokens_per_expert"].clamp(max=C).sum())
        assert v["dispatched"] == want
        assert torch.equal(v["kept_per_expert"], v["tokens_per_expert"].clamp(max=C))
        ev = res.trace.filter(op="all_to_all", rank=v["rank"], what="dispatch")
        assert len(ev) == 1
        assert sum(ev[0].meta["tokens_per_dest"]) == want
        # padded: every destination gets E_local·C rows, whatever the routing
        assert ev[0].meta["send_splits"] == [8 // W * C] * W
    assert sum(int((~v["kept"].any(-1)).sum()) for v in res.values) > 0


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("name", ["top2_cf0.5_drops", "top2_cf1_skewed_idle_ranks"])
def test_padded_experts_compute_the_filled_slots_only(results, W, name):
    """Padding is sent (fixed message size) but not computed: each rank's experts run on the
    assignments kept for them, announced by one all-gather of counts."""
    res = results(W, name)
    vals = res.values
    E_local = 8 // W
    kept = sum(v["kept_per_expert"] for v in vals)                        # (E,) over the group
    for v in vals:
        r = v["rank"]
        (ev,) = res.trace.filter(op="compute", rank=r, what="experts")
        assert ev.meta["tokens_per_expert"] == kept[r * E_local:(r + 1) * E_local].tolist()
        assert len(res.trace.filter(op="all_gather", rank=r, what="counts")) == 1
    assert sum(int(v["dispatched"]) for v in vals) < 8 * vals[0]["capacity"] * W   # some padding exists


def test_pad_puts_each_block_at_its_slots_and_unpad_is_its_adjoint():
    """The padded buffers are built by _pad (one cat, zero rows after each block) and read back by
    _unpad (views): in value, block i's rows at i·C …; in gradient, <pad(b), g> = <b, unpad(g)>."""
    from reference.moe.parallel import _pad, _unpad
    g = torch.Generator().manual_seed(0)
    counts, C, d = [2, 0, 3, 1], 3, 4
    blocks = [torch.randn(n, d, dtype=torch.float64, generator=g).requires_grad_() for n in counts]
    buf = _pad(blocks, C)
    want = torch.zeros(len(counts) * C, d, dtype=torch.float64)
    for i, b in enumerate(blocks):
        want[i * C:i * C + len(b)] = b.detach()
    assert torch.equal(buf.detach(), want)
    assert all(torch.equal(u, b.detach()) for u, b in zip(_unpad(buf.detach(), counts, C), blocks))
    grad = torch.randn(buf.shape, dtype=torch.float64, generator=g)
    buf.backward(grad)
    for b, u in zip(blocks, _unpad(grad, counts, C)):
        assert torch.equal(b.grad, u)


def test_a_routing_whose_slots_skip_a_place_is_refused_by_the_padded_path():
    from reference.moe.parallel import _by_expert
    from reference.moe.routing import top_k_gating
    routing = top_k_gating(torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), 2, 8)
    _by_expert(routing, 4, padded=True)                                   # as top_k_gating fills them: fine
    t, j = torch.nonzero(routing["kept"], as_tuple=True)
    bad = dict(routing, slot=routing["slot"].clone())
    bad["slot"][t[0], j[0]] += 1                                          # a hole (or a clash) in expert's slots
    with pytest.raises(ValueError, match="slots must be 0, 1"):
        _by_expert(bad, 4, padded=True)
    _by_expert(bad, 4)                                                    # dropless: any order will do


def test_frontier_layer_on_eight_ranks_equals_single_process(world):
    """W = 8, kept tiny: 16 fine experts (2 per rank), sigmoid top-8, a shared expert, a loss-free bias, the
    overlapped halves; 6 tokens per rank."""
    cfg = dict(num_experts=16, k=8, dropless=True, router="sigmoid", shared_experts=1, overlap=True,
               balance="loss_free", bias_scale=0.3, tokens=6, d_ff=4)
    CASES["frontier_8_ranks"] = (cfg, False)
    cache = {}
    test_expert_parallel_outputs_and_gradients_equal_single_process(
        lambda W, name: cache.setdefault(name, world(W).run(workers.ep_vs_single, CASES[name][0])), 8,
        "frontier_8_ranks")


def test_node_limited_routing_keeps_each_tokens_experts_on_one_node(results):
    """4 ranks on 2 nodes of 2, 8 experts (2 per rank): with max_nodes=1 each token's 4 experts lie on ranks
    {0, 1} or {2, 3}: its dispatch goes to one node only (without the limit, top-4 of 8 usually spans both)."""
    res = results(4, "frontier_node_limited_k4_M1")
    for v in res.values:
        node = v["expert_index"] // 4                               # experts 0-3 on node 0, 4-7 on node 1
        assert (node == node[:, :1]).all()
        assert v["unlimited_spans_nodes"] > 0                      # the same logits, no limit: some span both


def test_overlapped_halves_trace_two_dispatches_and_combines_per_rank(results):
    res = results(4, "frontier_overlap_skewed_uneven_T")
    for r in range(4):
        halves = sorted(e.meta["half"] for e in res.trace.filter(op="all_to_all", rank=r, what="dispatch"))
        assert halves == [0, 1]
        assert len(res.trace.filter(op="all_to_all", rank=r, what="combine")) == 2
        assert len(res.trace.filter(op="compute", rank=r, what="experts")) == 2
        # the backward's adjoints: one per posted all-to-all
        assert len(res.trace.filter(op="all_to_all", rank=r, what="dispatch.backward")) == 2


def test_skewed_dropless_routing_leaves_rank_pairs_that_send_nothing(results):
    res = results(4, "dropless_top2_skewed_uneven_T")
    for r in range(4):
        counts = res.trace.filter(op="all_to_all", rank=r, what="dispatch")[0].meta["tokens_per_dest"]
        assert counts[0] == 2 * (16 + 3 * r) and counts[1:] == [0, 0, 0]   # experts 0, 1 live on rank 0
        back = res.trace.filter(op="all_to_all", rank=r, what="combine")[0].meta["send_splits"]
        assert back == ([2 * (16 + 3 * s) for s in range(4)] if r == 0 else [0, 0, 0, 0])


def test_trace_has_route_events_and_forward_backward_all_to_alls(results):
    res = results(2, "top2_cf0.5_drops")
    for r in range(2):
        route = res.trace.filter(op="route", rank=r, where="expert_parallel")
        assert len(route) == 1
        m = route[0].meta
        v = res.values[r]
        assert m["kept"] == v["kept"].tolist() and m["k"] == 2 and m["num_experts"] == 8
        assert len(m["expert_index"]) == 16 and len(m["weight"][0]) == 2 and len(m["slot"]) == 16
        whats = [e.meta["what"] for e in res.trace.filter(op="all_to_all", rank=r)]
        assert sorted(whats) == ["combine", "combine.backward", "dispatch", "dispatch.backward"]


@pytest.mark.parametrize("W", [1, 2, 4])
def test_all_to_all_backward_is_its_adjoint(world, W):
    splits = {1: [[3]], 2: [[2, 0], [1, 4]], 4: [[1, 0, 2, 3], [0, 0, 0, 5], [2, 2, 0, 1], [3, 0, 1, 0]]}[W]
    res = world(W).run(moe_workers.all_to_all_adjoint, splits, 3)
    vals = res.values
    lhs = sum(v["Ax_dot_g"] for v in vals)
    rhs = sum(v["x_dot_ATg"] for v in vals)
    assert abs(lhs - rhs) < 1e-10 * max(1.0, abs(lhs))
    # and A itself: rank t receives, from each s in order, the rows s addressed to t
    for t in range(W):
        want = []
        for s in range(W):
            start = sum(splits[s][:t])
            want.append(vals[s]["x"][start:start + splits[s][t]])
        close(vals[t]["Ax"], torch.cat(want), f"rank {t} received rows")


def test_bad_input_on_one_rank_raises_value_error_on_every_rank(world):
    kinds = ["wrong_width", "unequal_tokens", "uneven_experts"]
    res = world(2).run(moe_workers.ep_bad_input, kinds, timeout=20)
    for r, raised in enumerate(res.values):
        assert raised == ["ValueError"] * 3, f"rank {r}: {dict(zip(kinds, raised))}"
    assert not res.trace.filter(op="all_to_all")     # nothing was dispatched


# ------------------------------------------------------------------------------------------------
# EP × DP: one training step.  EP groups of consecutive ranks, expert-data-parallel groups
# {q, q+EP, ...}, dp = the world.  Truth: the single-process layer's gradients of
# mean task loss + α·aux + β·z-loss over the whole batch (float64, 1e-10).

STEP = dict(num_experts=8, k=2, capacity_factor=1.0, tokens=8, d_model=4, d_ff=6, scale=3.0, c_aux=0.5, c_z=0.05)


def run_step(world, N, cfg):
    """Run one step on N ranks; the 8-rank world is started for its one call and closed at once."""
    if N <= 4:
        return world(N).run(workers.ep_dp_grad_sync, cfg)
    with World(N, timeout=90, echo=False) as w:
        return w.run(workers.ep_dp_grad_sync, cfg)


def assert_step_matches(vals, what=""):
    for r, v in enumerate(vals):
        close(v["y"], v["truth_y"], f"{what}rank {r} output")
        close(v["router_grad"], v["truth_router"], f"{what}rank {r} router gradient")
        for i, (got, want) in enumerate(zip(v["expert_grads"], v["truth_experts"])):
            for a, b in zip(got, want):
                close(a, b, f"{what}rank {r} local expert {i} gradient")


@pytest.mark.parametrize("ep,dp", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_ep_dp_step_gives_single_process_gradients_of_mean_task_plus_aux_plus_z(world, ep, dp):
    res = run_step(world, ep * dp, dict(STEP, ep_size=ep, aux="global"))
    assert_step_matches(res.values, f"EP={ep} DP={dp}: ")
    for v in res.values:   # the balance loss is the whole batch's, on every rank
        assert abs(v["aux"] - v["truth_aux"]) < 1e-12


@pytest.mark.parametrize("kind", ["ep", "local"])
def test_ep_dp_step_with_per_ep_group_or_per_routing_group_balance_loss(world, kind):
    res = world(4).run(workers.ep_dp_grad_sync, dict(STEP, ep_size=2, aux=kind))
    assert_step_matches(res.values, f"aux over {kind}: ")


@pytest.mark.parametrize("ep,dp", [(2, 2), (4, 1)])
def test_back_propagating_the_bare_balance_loss_weakens_it_to_alpha_over_group_size(world, ep, dp):
    """The bug the layer avoids: with only the balance loss (no task, no z), the router gradient of a
    step that back-propagates load_balancing_loss as it is comes out exactly 1/N of the truth."""
    cfg = dict(STEP, ep_size=ep, aux="global", c_task=0.0, c_z=0.0)
    vals = world(ep * dp).run(workers.ep_dp_grad_sync, dict(cfg, naive_aux=True)).values
    N = ep * dp
    for r, v in enumerate(vals):
        assert v["truth_router"].abs().max() > 1e-3           # the aux gradient is not negligible
        close(v["router_grad"], v["truth_router"] / N, f"rank {r}: naive router gradient = truth / N")
    assert_step_matches(world(ep * dp).run(workers.ep_dp_grad_sync, cfg).values, "aux only: ")


@pytest.mark.parametrize("cfg", [dict(num_experts=8, k=2, capacity_factor=1.0),
                                 dict(num_experts=4, k=1, dropless=True)])
def test_ep_dp_gradients_equal_single_process_mean_of_rank_losses(world, cfg):
    res = world(4).run(workers.ep_dp_grad_sync, cfg, "dp")
    assert_step_matches(res.values)


def test_dividing_expert_gradients_by_the_expert_dp_size_is_off_by_the_ep_size(world):
    res = world(4).run(workers.ep_dp_grad_sync, dict(num_experts=8, k=2, capacity_factor=1.0), "expert_dp")
    for r, v in enumerate(res.values):
        close(v["router_grad"], v["truth_router"], f"rank {r} router gradient")   # dense grads unaffected
        for got, want in zip(v["expert_grads"], v["truth_experts"]):
            for a, b in zip(got, want):
                with pytest.raises(AssertionError):
                    close(a, b, "buggy expert gradient")
                close(a, 2 * b, "buggy expert gradient = EP size × truth")
