"""Tensor parallelism (reference.tensor) against the single-process modules and against PyTorch's
DTensor tensor parallelism.

float64, tensor-parallel sizes 1, 2, 3, 4 (3 where the dimensions divide: d_ff = 24, d = 12 with
6 heads): outputs, input gradients and EVERY weight gradient equal the single-process module's
(weight gradients equal their slices) within 1e-12, with and without sequence parallelism, at
inputs ×30.  Bytes and counts of collectives are exact, from the trace.
"""

import pytest
import torch

from reference.launch import WorldError, run_world
from reference.tensor import workers
from reference.tensor.blocks import head_dropout_mask
from reference.tensor.costs import wire_bytes
from tests.workers import tensor_workers

TOL = dict(atol=1e-12, rtol=1e-12)


def cfg_for(W):
    """Dimensions that split over W (W = 3 included): 6 heads of d = 12 for 1, 2, 3; 4 heads of 8 for 4."""
    return dict(d_model=12, heads=6, d_ff=24, S=12) if W in (1, 2, 3) else dict(d_model=8, heads=4, d_ff=32, S=12)


def expected_shard(kind, name, full, r, W, d):
    """The slice of the full gradient ``full[name]`` that rank r's parameter ``name`` holds."""
    prefix, _, leaf = name.rpartition(".")
    layer = prefix.rsplit(".", 1)[-1]
    g = full[name]
    if layer in ("fc1",):
        n = g.shape[0] // W
        return g[r * n:(r + 1) * n]
    if layer == "qkv":                 # rows of MY heads in each of q, k, v
        return g.view(3, W, d // W, *g.shape[1:])[:, r].reshape(3 * d // W, *g.shape[1:])
    if layer in ("fc2", "proj") and leaf == "weight":
        n = g.shape[1] // W
        return g[:, r * n:(r + 1) * n]
    return g                           # row-parallel bias, LayerNorms: whole


def check(kind, W, res, single, d, sp):
    S = single["out"].shape[0]
    for r, v in enumerate(res.values):
        rows = slice(r * S // W, (r + 1) * S // W) if sp else slice(None)
        torch.testing.assert_close(v["out"], single["out"][rows], **TOL, msg=lambda m: f"{kind} out rank {r}: {m}")
        torch.testing.assert_close(v["dx"], single["dx"][rows], **TOL, msg=lambda m: f"{kind} dx rank {r}: {m}")
        assert set(v["grads"]) == set(single["grads"]), (sorted(v["grads"]), sorted(single["grads"]))
        for name, g in v["grads"].items():
            torch.testing.assert_close(g, expected_shard(kind, name, single["grads"], r, W, d), **TOL,
                                       msg=lambda m: f"{kind} grad {name} rank {r} (W={W}, sp={sp}): {m}")


@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_block_matches_single_process(world, W, sp):
    """The whole block (LayerNorms, attention, MLP, dropout in both regions) — all of it exact."""
    cfg = dict(cfg_for(W), scale=30.0, dropout_p=0.25, seed=W)
    res = world(W).run(workers.parallel, "block", sp, **cfg)
    check("block", W, res, workers.single("block", **cfg), cfg["d_model"], sp)


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("kind", ["mlp", "attn"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_mlp_and_attention_match_single_process(world, W, kind, sp):
    cfg = dict(cfg_for(W), scale=30.0, seed=10 + W)
    res = world(W).run(workers.parallel, kind, sp, **cfg)
    check(kind, W, res, workers.single(kind, **cfg), cfg["d_model"], sp)


@pytest.mark.parametrize("W", [2, 4])
def test_mlp_matches_dtensor_colwise_rowwise(world, W):
    """PyTorch's own tensor parallelism (parallelize_module with ColwiseParallel / RowwiseParallel)."""
    cfg = dict(cfg_for(W), scale=30.0, seed=3)
    ours = world(W).run(workers.parallel, "mlp", **cfg)
    peer = world(W).run(workers.dtensor_mlp, **cfg)
    for r in range(W):
        a, b = ours.values[r], peer.values[r]
        torch.testing.assert_close(a["out"], b["out"], **TOL)
        torch.testing.assert_close(a["dx"], b["dx"], **TOL)
        for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
            torch.testing.assert_close(a["grads"][name], b["grads"][name], **TOL, msg=lambda m: f"{name} rank {r}: {m}")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_block_matches_dtensor_plans_with_and_without_sequence_parallel(world, sp):
    """The whole block against parallelize_module: q, k, v, fc1 ColwiseParallel, proj, fc2 RowwiseParallel;
    with SP, SequenceParallel LayerNorms entered/left through Shard(0).  DTensor leaves the LayerNorm
    gradients Partial(sum) under SP: the pending sum sync_sequence_parallel_grads does."""
    W, cfg = 2, dict(cfg_for(2), scale=30.0, seed=4)
    ours = world(W).run(workers.parallel, "block", sp, **cfg)
    peer = world(W).run(workers.dtensor, "block", sp, **cfg)
    for r in range(W):
        a, b = ours.values[r], peer.values[r]
        torch.testing.assert_close(a["out"], b["out"], **TOL)
        torch.testing.assert_close(a["dx"], b["dx"], **TOL)
        assert set(a["grads"]) == set(b["grads"])
        for name, g in b["grads"].items():
            torch.testing.assert_close(a["grads"][name], g, **TOL, msg=lambda m: f"{name} rank {r}: {m}")
        assert b["partial"] == (["ln1.bias", "ln1.weight", "ln2.bias", "ln2.weight"] if sp else [])


def test_the_lecture_table_puts_every_plan_within_1e_12_of_ours(world):
    from reference.tensor.lecture import PLANS, against_dtensor
    res = against_dtensor(world=world(4))
    assert [row["case"] for row in res["rows"]] == list(PLANS)
    for row in res["rows"]:
        assert max(row["out"], row["dx"], row["grads"]) <= 1e-12, row


def test_from_linear_keeps_contiguous_shards_laid_out_as_nn_linear(world):
    cfg = cfg_for(2)
    res = world(2).run(workers.parallel, "mlp", **cfg)
    full, _, _ = workers.build("mlp", **cfg)
    for r, v in enumerate(res.values):
        p, n_out, n_in = v["params"], cfg["d_ff"] // 2, cfg["d_ff"] // 2
        assert torch.equal(p["fc1.weight"], full.fc1.weight.detach()[r * n_out:(r + 1) * n_out])
        assert torch.equal(p["fc1.bias"], full.fc1.bias.detach()[r * n_out:(r + 1) * n_out])
        assert torch.equal(p["fc2.weight"], full.fc2.weight.detach()[:, r * n_in:(r + 1) * n_in])
        assert torch.equal(p["fc2.bias"], full.fc2.bias.detach())


# ----------------------------------------------------------------------------------------------
# Collectives: counts and bytes


@pytest.mark.parametrize("W", [2, 4])
def test_two_all_reduces_forward_two_backward_per_block_with_exact_bytes(world, W):
    cfg = cfg_for(W)
    res = world(W).run(workers.parallel, "block", **cfg)
    act = cfg["S"] * 2 * cfg["d_model"] * 8          # (S, B, d) float64
    for r in range(W):
        ev = res.trace.filter(rank=r, op=("all_reduce", "all_gather", "reduce_scatter", "send", "all_to_all"))
        assert [(e.op, e.meta["operator"], e.meta["direction"], e.meta["layer"]) for e in ev] == [
            ("all_reduce", "g", "forward", "attn.proj"), ("all_reduce", "g", "forward", "mlp.fc2"),
            ("all_reduce", "f", "backward", "mlp.fc1"), ("all_reduce", "f", "backward", "attn.qkv")]
        assert all(e.nbytes == act for e in ev)


@pytest.mark.parametrize("W", [2, 4])
def test_sequence_parallelism_moves_the_same_bytes_plus_one_regather_per_column_layer(world, W):
    """All-gather + reduce-scatter for each all-reduce: the same bytes.  Saving only x's S/W rows
    costs qkv and fc1 an all-gather of their input again in the backward (what="sp_regather"):
    10·(W-1)/W·A per block instead of 8; column_parallel_linear (the gathered input saved) moves 8."""
    cfg = cfg_for(W)
    tp = world(W).run(workers.parallel, "block", False, **cfg).trace
    sp = world(W).run(workers.parallel, "block", True, sync=False, **cfg).trace
    gathered = world(W).run(workers.parallel, "block", True, sync=False, save_shard=False, **cfg).trace
    act = cfg["S"] * 2 * cfg["d_model"] * 8
    ops = sp.filter(rank=1, op=("all_reduce", "all_gather", "reduce_scatter"))
    assert [(e.op, e.meta["layer"], e.meta.get("what", "")) for e in ops] == [
        ("all_gather", "attn.qkv", ""), ("reduce_scatter", "attn.proj", ""),
        ("all_gather", "mlp.fc1", ""), ("reduce_scatter", "mlp.fc2", ""),                   # forward
        ("all_gather", "mlp.fc2", ""), ("all_gather", "mlp.fc1", "sp_regather"), ("reduce_scatter", "mlp.fc1", ""),
        ("all_gather", "attn.proj", ""), ("all_gather", "attn.qkv", "sp_regather"), ("reduce_scatter", "attn.qkv", "")]
    assert all(e.nbytes == (act // W if e.op == "all_gather" else act) for e in ops)
    wire = lambda t: sum(wire_bytes(e.op, e.nbytes, W)  # noqa: E731
                         for e in t.filter(rank=1, op=("all_reduce", "all_gather", "reduce_scatter")))
    assert wire(tp) == 8 * (W - 1) / W * act
    assert wire(gathered) == pytest.approx(wire(tp))
    assert wire(sp) == pytest.approx(10 * (W - 1) / W * act)


def test_one_rank_sends_nothing(world):
    res = world(1).run(workers.parallel, "block", True, **cfg_for(1))
    assert not res.trace.filter(op=("all_reduce", "all_gather", "reduce_scatter"))


# ----------------------------------------------------------------------------------------------
# The silent bugs: LayerNorm gradients under sequence parallelism, dropout streams


def test_sequence_parallel_layernorm_grads_must_be_summed_over_the_group(world):
    W, cfg = 2, dict(cfg_for(2), seed=5)
    single = workers.single("block", **cfg)
    unsynced = world(W).run(workers.parallel, "block", True, sync=False, **cfg).values
    for name in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attn.proj.bias", "mlp.fc2.bias"):
        parts = [v["grads"][name] for v in unsynced]
        assert not torch.allclose(parts[0], single["grads"][name]), name      # one rank's rows only
        torch.testing.assert_close(sum(parts), single["grads"][name], **TOL)   # their sum is the gradient


def test_dropout_streams_differ_inside_the_region_and_agree_outside(world):
    """Attention dropout (inside the region): each head, hence each rank, has its own stream; the
    ranks' masks together are the single-process mask.  Hidden dropout (replicated region): every
    rank applies the same mask, so the replicated outputs stay identical (checked bitwise)."""
    full = head_dropout_mask(2, 4, 6, 0.5, seed=7)
    per_rank = [head_dropout_mask(2, 2, 6, 0.5, seed=7, first_head=2 * r) for r in range(2)]
    assert not torch.equal(per_rank[0], per_rank[1])
    assert torch.equal(torch.cat(per_rank, dim=1), full)
    same_stream = torch.cat([head_dropout_mask(2, 2, 6, 0.5, seed=7)] * 2, dim=1)   # the classic mistake
    assert not torch.equal(same_stream, full)
    res = world(2).run(workers.parallel, "block", False, **dict(cfg_for(2), dropout_p=0.5, seed=1))
    assert torch.equal(res.values[0]["out"], res.values[1]["out"])


# ----------------------------------------------------------------------------------------------
# Failures: clear errors on every rank, never a hang


def test_heads_not_divisible_raise_value_error_on_every_rank_before_any_message():
    with pytest.raises(WorldError) as info:
        run_world(tensor_workers.parallel_bad, 3, "attn", heads=4, timeout=30)
    err = info.value
    assert err.kind == "exception"            # raised on the ranks, not a hang reported by the timeout
    assert sorted(err.failures) == [0, 1, 2]
    assert all(f.exc_type == "ValueError" and "heads" in f.message for f in err.failures.values()), err
    assert not err.trace.filter(op=("all_reduce", "all_gather", "reduce_scatter"))


def test_a_rank_that_skips_the_backward_is_named_not_a_hang():
    with pytest.raises(WorldError) as info:
        run_world(tensor_workers.only_rank0_backward, 2, timeout=5)
    err = info.value
    assert err.kind == "timeout" and 0 in err.ranks
    assert "all_reduce" in err.failures[0].blocked_in
