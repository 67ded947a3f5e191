"""Lecture 5c: the tiny GPT trained on a rank grid reproduces one process, axis by axis and composed.

Float64.  For every grid, the loss of each of 3 Adam steps (the same on every rank) equals
``reference.gpt.train_single``'s to 1e-10, and every parameter after the last step, unsharded
and compared by its single-process name, equals the single process's to 1e-10.  (MoE layers in
a pipeline of m > 1 micro-batches: one aux loss per micro-batch, so the truth is
``train_single(…, num_microbatches=m, dp=dp)``, which accumulates over the same micro-batches.)  The bytes each
rank moves per axis, read back from the trace, equal the formulas of ``reference.compose.train``
exactly (tp, cp, dp_cp, edp, pp on every rank; the EP dispatch payload).

Worlds are the session's kept-alive ones (tests/conftest.py): 2, 4 and 8 ranks, each started once.
"""
from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reference.compose import expected_bytes, measured_bytes, workers
from reference.gpt import GPTConfig, TinyGPT, corpus, encode, train_single
from reference.launch import WorldError
from reference.mesh import RankGrid
from reference.pipeline import balanced_sizes
from reference.trace import COMM_OPS

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-10
STEPS = 3
BATCH = 4
DENSE = dict(layers=2, d_model=16, heads=2, d_ff=32, seq_len=8)
MOE = dict(DENSE, num_experts=4)                 # block 1 is MoE (moe_every=2), top-2, dropless
MOE_ALL = dict(MOE, moe_every=1)                 # both blocks MoE: with pp=2, one on each stage
# frontier MoE: block 0 dense, block 1 with 8 fine experts (expert_ffn 8 < d_ff 32), top-4 of a sigmoid router,
# one shared expert, loss-free balancing with DeepSeek-V3's sequence-wise guard, and the router z-loss
FRONTIER = dict(DENSE, num_experts=8, top_k=4, moe_every=1, dense_layers=1, expert_ffn=8, shared_experts=1,
                router="sigmoid", balance="loss_free+seq_aux", bias_update_rate=0.05, z_loss_coef=1e-2)
FRONTIER_ALL = dict(FRONTIER, dense_layers=0)    # both blocks MoE (one per stage with pp=2)


@functools.cache
def truth(config: tuple, num_microbatches: int = 1, dp: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """train_single's losses and final parameters for ``config`` (a sorted tuple of items)."""
    _, alphabet = encode(corpus())
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=len(alphabet), **dict(config))).to(torch.float64)
    kw = dict(num_microbatches=num_microbatches, dp=dp) if num_microbatches > 1 else {}
    losses = train_single(STEPS, batch_size=BATCH, model=model, **kw)
    assert losses == train_single(STEPS, batch_size=BATCH, **kw, **dict(config))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def truth_microbatches(sizes: dict, config: dict, kw: dict) -> dict:
    """MoE layers in a pipeline: the truth accumulates over the same micro-batches (one aux loss each)."""
    if config.get("num_experts") and sizes.get("pp", 1) > 1:
        return dict(num_microbatches=kw.get("num_microbatches", 1), dp=sizes.get("dp", 1))
    return {}


def run_case(world, sizes: dict, config: dict, **kw):
    n = 1
    for a in ("tp", "cp", "dp", "pp"):
        n *= sizes.get(a, 1)
    return world(n).run(workers.train_worker, sizes, STEPS, batch_size=BATCH, **kw, **config)


def assert_same_training(res, config: dict, **truth_kw) -> None:
    losses, params = truth(tuple(sorted(config.items())), **truth_kw)
    got = res.values[0]["losses"]
    assert all(v["losses"] == got for v in res.values), "the loss must be the same on every rank"
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, losses)) <= TOL, (got, losses)
    full = res.values[0]["params"]
    assert set(full) == set(params)
    for name, p in params.items():
        assert full[name].shape == p.shape, name
        assert (full[name] - p).abs().max().item() <= TOL, name


def expert_rows(trace, rank: int) -> int:
    return sum(sum(e.meta["tokens_per_expert"]) for e in trace.filter(op="compute", rank=rank)
               if e.meta.get("what") == "experts")


def assert_bytes(res, sizes: dict, config: dict, *, sequence_parallel: bool = False, zero: int = 0) -> dict:
    """Measured wire bytes per axis == the formulas, on every rank; returns rank 0's."""
    grid = RankGrid(len(res.values), **sizes)
    cfg = GPTConfig(vocab=len(encode(corpus())[1]), **config)
    first = None
    for r, v in enumerate(res.values):
        want = expected_bytes(cfg, grid, v["coords"], BATCH, sequence_parallel=sequence_parallel,
                              expert_rows=expert_rows(res.trace, r), steps=STEPS, zero=zero)
        got = measured_bytes(res.trace, r, grid)
        for axis, size in grid.sizes.items():       # an axis in use moves bytes, one not in use none
            if axis in ("tp", "cp", "pp", "dp_cp") and size > 1:
                assert want.get(axis, 0) > 0 and got.get(axis, 0) > 0, (axis, want, got)
            if axis in ("tp", "cp", "pp") and size == 1:
                assert axis not in want and axis not in got, (axis, got)
        assert {a: got.get(a) for a in want} == want, f"rank {r}: measured {got}, formula {want}"
        assert set(got) - set(want) <= {"ep", "aux", "report", "unshard", "other"}, got
        first = first or got
    return first


# ----------------------------------------------------------------------------------------------
# Loss curves and final parameters equal one process; bytes per axis equal the formulas

CASES = [
    # 1D, 2 ranks
    ("dp", {"dp": 2}, DENSE, {}),
    ("tp", {"tp": 2}, DENSE, {}),
    ("tp+sp", {"tp": 2}, DENSE, {"sequence_parallel": True}),
    ("cp", {"cp": 2}, DENSE, {}),
    ("ep", {"dp": 2, "ep": 2}, MOE, {}),
    ("pp zb_h1", {"pp": 2}, DENSE, {"num_microbatches": 4, "schedule": "zb_h1"}),
    # 2D, 4 ranks
    ("dp×tp", {"dp": 2, "tp": 2}, DENSE, {}),
    ("cp×tp+sp", {"cp": 2, "tp": 2}, DENSE, {"sequence_parallel": True}),
    ("dp×ep", {"dp": 4, "ep": 2}, MOE, {}),
    ("tp×pp+sp gpipe", {"tp": 2, "pp": 2}, DENSE, {"sequence_parallel": True, "num_microbatches": 2,
                                                   "schedule": "gpipe"}),
    # 3D, 8 ranks
    ("dp×tp×cp", {"dp": 2, "tp": 2, "cp": 2}, DENSE, {}),
    ("dp×tp×ep", {"dp": 4, "tp": 2, "ep": 2}, MOE, {}),
    ("dp×tp×pp 1f1b", {"dp": 2, "tp": 2, "pp": 2}, DENSE, {"num_microbatches": 2}),
    # MoE in a pipeline: each stage back-propagates its own aux loss (AuxLossAutoScaler)
    ("pp×ep gpipe", {"pp": 2, "dp": 2, "ep": 2}, MOE_ALL, {"schedule": "gpipe"}),          # 4 ranks, m = 1
    ("pp×ep zb_h1", {"pp": 2, "dp": 2, "ep": 2}, MOE_ALL, {"num_microbatches": 2, "schedule": "zb_h1"}),
    # 4D, 8 ranks
    ("dp×tp×pp×ep 1f1b", {"dp": 2, "tp": 2, "pp": 2, "ep": 2}, MOE_ALL, {"num_microbatches": 2}),
    ("dp×tp×cp×ep", {"dp": 2, "tp": 2, "cp": 2, "ep": 2}, MOE, {}),
    # the expert grid folded (etp = 1): ep > dp·cp, the ep group takes the tp ranks too; frontier MoE layers
    ("folded tp×dp ep4", {"tp": 2, "dp": 2, "ep": 4, "etp": 1}, FRONTIER, {}),
    ("unfolded tp×dp ep2 frontier", {"tp": 2, "dp": 2, "ep": 2}, FRONTIER, {}),
    ("folded cp×tp ep4", {"cp": 2, "tp": 2, "ep": 4, "etp": 1}, FRONTIER, {}),
    ("folded pp×tp×dp ep4 1f1b", {"pp": 2, "tp": 2, "dp": 2, "ep": 4, "etp": 1}, FRONTIER_ALL, {"num_microbatches": 2}),
    # ZeRO over dp_cp (lecture 3's ZeroOptimizer on each rank's dense shard; experts after their edp sync)
    ("zero1 dp×tp", {"dp": 2, "tp": 2}, DENSE, {"zero": 1}),
    ("zero2 dp×cp×tp+sp", {"dp": 2, "cp": 2, "tp": 2}, DENSE, {"zero": 2, "sequence_parallel": True}),
    ("zero2 dp×ep", {"dp": 4, "ep": 2}, MOE, {"zero": 2}),
]


@pytest.mark.parametrize("name,sizes,config,kw", CASES, ids=[c[0] for c in CASES])
def test_composed_training_equals_one_process(world, name, sizes, config, kw):
    res = run_case(world, sizes, config, **kw)
    assert_same_training(res, config, **truth_microbatches(sizes, config, kw))
    assert_bytes(res, sizes, config, sequence_parallel=kw.get("sequence_parallel", False), zero=kw.get("zero", 0))
    if kw.get("zero"):      # ZeRO's own collectives ran, once per step on every rank, and no plain dense all-reduce
        reduce = "all_reduce" if kw["zero"] == 1 else "reduce_scatter"
        for r in range(len(res.values)):
            assert len(res.trace.filter(op=reduce, rank=r, what="grads")) == STEPS
            assert len(res.trace.filter(op="all_gather", rank=r, what="params")) == STEPS
            assert not res.trace.filter(rank=r, what="dense_grads")
    if config.get("num_experts"):
        # EP: every MoE layer's dispatch hands k·T/m token rows of d numbers to the all-to-all per
        # micro-batch, and the gradient comes back the same way, whatever the routing.
        grid, cfg = RankGrid(len(res.values), **sizes), GPTConfig(vocab=len(encode(corpus())[1]), **config)
        m, k = kw.get("num_microbatches", 1), cfg.top_k
        T = BATCH // grid.dp * cfg.seq_len // grid.cp // (grid.tp if grid.etp != grid.tp else 1)   # folded: 1/tp
        for r, v in enumerate(res.values):
            sizes_pp, stage = balanced_sizes(cfg.layers, grid.pp), v["coords"]["pp"]
            moe_here = sum(cfg.is_moe(i) for i in range(sum(sizes_pp[:stage]), sum(sizes_pp[:stage + 1])))
            for what in ("dispatch", "combine.backward"):
                ev = res.trace.filter(op="all_to_all", rank=r, what=what)
                assert len(ev) == STEPS * m * moe_here, (r, what, len(ev))
                assert all(e.nbytes == k * T // m * cfg.d_model * 8 for e in ev), (r, what)
            if moe_here:
                assert (measured_bytes(res.trace, r, grid).get("ep", 0) > 0) == (grid.ep > 1), r


# ----------------------------------------------------------------------------------------------
# Sizes that do not fit: ValueError on every rank, before any message


BAD = [
    ({"sizes": {"tp": 2}, "heads": 1}, "ValueError", "heads"),                     # tp does not divide heads
    ({"sizes": {"tp": 2, "dp": 2}}, "ValueError", "world_size"),                    # 4 ≠ 2 ranks
    ({"sizes": {"cp": 2}, "seq_len": 6}, "ValueError", "zigzag"),                   # 6 is not a multiple of 2·cp
    ({"sizes": {"dp": 2}, "batch_size": 3}, "ValueError", "batch"),
    ({"sizes": {"dp": 2, "ep": 2}, "num_experts": 3}, "ValueError", "num_experts"),
    ({"sizes": {"ep": 2, "dp": 2}}, "ValueError", "MoE"),                           # ep without experts
    ({"sizes": {"tp": 2}, "num_experts": 4, "sequence_parallel": True}, "NotImplementedError", "MoE"),
    ({"sizes": {"pp": 2}, "num_experts": 4, "num_microbatches": 3}, "ValueError", "micro-batches"),
    ({"sizes": {"dp": 2}, "zero": 3}, "ValueError", "ZeRO stage"),                    # stage 3 is FSDP (lecture 3)
    ({"sizes": {"tp": 2, "ep": 4, "etp": 1}, "num_experts": 4}, "ValueError", "etp·ep = 1·4"),   # 4 ∤ tp·cp·dp = 2
    ({"sizes": {"tp": 2, "ep": 2, "etp": 1}, "num_experts": 4, "batch_size": 1, "seq_len": 7}, "ValueError",
     "1/tp"),                                                                        # 7 tokens do not split over tp 2
    ({"sizes": {"tp": 2, "ep": 1}, "num_experts": 4, "expert_ffn": 3}, "ValueError", "expert_ffn=3"),
]


def test_bad_sizes_raise_on_every_rank_before_any_message(world):
    cases = [dict(DENSE, **case) for case, _, _ in BAD]
    res = world(2).run(workers.size_errors, cases)
    assert res.values[0] == res.values[1]
    for (kind, message), (_, want, word) in zip(res.values[0], BAD):
        assert kind == want and word in message, (kind, message)
    assert not [e for e in res.trace if e.op in COMM_OPS]


def test_a_bad_grid_fails_the_world_with_value_errors_only(world):
    """The worker itself (not a wrapper): run_world's WorldError names every rank, each a ValueError."""
    with pytest.raises(WorldError) as info:
        world(2).run(workers.train_worker, {"tp": 2}, STEPS, **dict(DENSE, heads=1))
    err = info.value
    assert err.kind == "exception" and err.ranks == [0, 1]
    assert all(f.exc_type == "ValueError" and "heads" in f.message for f in err.failures.values()), err
    assert not [e for e in err.trace if e.op in COMM_OPS]


def test_the_ranks_adam_is_torch_adam_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    ours = [torch.randn(5, 3, generator=g, dtype=torch.float64) for _ in range(3)]
    theirs = [t.clone() for t in ours]
    a, b = workers.Adam(ours, lr=3e-3), torch.optim.Adam(theirs, lr=3e-3)
    for step in range(4):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64) * 10.0 ** -(3 * step)
            q.grad = p.grad.clone()
        ours[1].grad = theirs[1].grad = None if step == 2 else ours[1].grad   # a step without a gradient
        a.step()
        b.step()
        a.zero_grad()
        b.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    assert all(p.grad is None for p in ours)


# ----------------------------------------------------------------------------------------------
# The same code under torchrun


def test_torchrun_script_prints_the_single_process_losses(tmp_path):
    """Context parallelism with a frontier MoE layer (fine experts, a shared one, sigmoid router, loss-free
    balancing with the sequence-wise guard, z-loss): every MoE flag reaches the model."""
    config = dict(DENSE, num_experts=4, expert_ffn=16, shared_experts=1, router="sigmoid",
                  balance="loss_free+seq_aux", bias_update_rate=0.05, z_loss_coef=0.01)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "scripts" / "train_composed.py"), "--cp", "2", "--ep", "2", "--steps", str(STEPS),
           "--layers", "2", "--d-model", "16", "--heads", "2", "--d-ff", "32", "--seq-len", "8", "--experts", "4",
           "--expert-ffn", "16", "--shared-experts", "1", "--router", "sigmoid", "--balance", "loss_free+seq_aux",
           "--bias-update-rate", "0.05", "--z-loss-coef", "0.01", "--etp", "1",
           "--timeout", "30", "--recompute", "selective"]      # recomputing the attention core changes no loss
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln.split() for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert [int(ln[1]) for ln in lines] == list(range(STEPS)), proc.stdout
    losses, _ = truth(tuple(sorted(config.items())))
    assert max(abs(float(ln[3]) - b) for ln, b in zip(lines, losses)) <= TOL, (lines, losses)
    assert "RankGrid(2, tp=1, cp=2, dp=1, pp=1, ep=2)" in proc.stdout


def test_two_torchrun_agents_with_a_c10d_rendezvous_train_one_grid_as_one_process(tmp_path):
    """The README's several-machines command, on this machine: two torchrun agents (two "nodes" of 2 ranks)
    meet at a c10d rendezvous and train dp2 × tp2 across them; the losses are the single process's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    script = [str(ROOT / "scripts" / "train_composed.py"), "--dp", "2", "--tp", "2", "--steps", str(STEPS),
              "--layers", "2", "--d-model", "16", "--heads", "2", "--d-ff", "32", "--seq-len", "8", "--timeout", "30"]
    agents = []
    try:
        for node in range(2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-id", f"course-{port}", "--max-restarts", "0", *script]
            agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                           cwd=tmp_path, start_new_session=True))
        outs = [a.communicate(timeout=120) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    for node, (a, (out, err)) in enumerate(zip(agents, outs)):
        assert a.returncode == 0, f"agent {node}:\n{out[-3000:]}\n{err[-3000:]}"
    lines = [ln.split() for out, _ in outs for ln in out.splitlines() if ln.startswith("step ")]
    assert [int(ln[1]) for ln in lines] == list(range(STEPS)), outs      # printed once, by global rank 0
    losses, _ = truth(tuple(sorted(DENSE.items())))
    assert max(abs(float(ln[3]) - b) for ln, b in zip(lines, losses)) <= TOL, (lines, losses)
    assert any("RankGrid(4, tp=2, cp=1, dp=2, pp=1" in out for out, _ in outs), outs
