"""Lecture 5c: global-norm gradient clipping on a rank grid is one process's ``clip_grad_norm_``.

Float64, the tiny model, 3 Adam steps.  For every grid (world sizes 1, 2, 4, 8; tp, cp, pp, ep,
sequence parallelism, ZeRO-1 and ZeRO-2): the norm before clipping of each step (the same on every
rank), the losses and the final parameters equal ``train_single(…, clip_grad_norm=c)``'s — which
calls ``torch.nn.utils.clip_grad_norm_`` — to 1e-10; with c small enough that every step clips
(norm > c), with c so large that none does (then also equal to the unclipped run), and with the
head × 30 at initialisation (norms of ~20).  The classic bug — a tp-replicated LayerNorm gradient
counted on every tp rank, or each rank's own squares never all-reduced — gives another norm, so
these tests catch it.  The script's ``--clip-grad-norm`` prints the same, under torchrun and alone.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reference.compose import workers
from reference.gpt import GPTConfig, TinyGPT, corpus, encode, train_single
from tests.workers import clip_workers

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-10
STEPS = 3
BATCH = 4
DENSE = dict(layers=2, d_model=16, heads=2, d_ff=32, seq_len=8)
MOE = dict(DENSE, num_experts=4)                 # block 1 is MoE, top-2, dropless
MOE_ALL = dict(MOE, moe_every=1)                 # both blocks MoE: with pp=2, one on each stage
ACTIVE, INACTIVE = 0.05, 1e9                     # step norms are ~0.9 at lr 3e-3, ~10–40 at lr 1


@functools.cache
def truth(config: tuple, max_norm: float | None, head_scale: float = 1.0, num_microbatches: int = 1, dp: int = 1):
    """train_single's (losses, final parameters, norms before clipping) with torch's clip_grad_norm_."""
    _, alphabet = encode(corpus())
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=len(alphabet), **dict(config))).to(torch.float64)
    with torch.no_grad():
        model.head.weight.mul_(head_scale)
    kw = dict(num_microbatches=num_microbatches, dp=dp) if num_microbatches > 1 else {}
    norms: list[float] = []
    losses = train_single(STEPS, batch_size=BATCH, model=model, clip_grad_norm=max_norm, grad_norms=norms, **kw)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def world_of(sizes: dict) -> int:
    n = 1
    for a in ("tp", "cp", "dp", "pp"):
        n *= sizes.get(a, 1)
    return n


def truth_kw(sizes: dict, config: dict, kw: dict) -> dict:
    """MoE layers in a pipeline: the truth accumulates over the same micro-batches (one aux loss each)."""
    if config.get("num_experts") and sizes.get("pp", 1) > 1:
        return dict(num_microbatches=kw.get("num_microbatches", 1), dp=sizes.get("dp", 1))
    return {}


def run_and_compare(world, sizes: dict, config: dict, kw: dict, max_norm: float, head_scale: float = 1.0):
    w = world(world_of(sizes))
    if head_scale == 1:
        res = w.run(workers.train_worker, sizes, STEPS, batch_size=BATCH, clip_grad_norm=max_norm, **kw, **config)
    else:
        res = w.run(clip_workers.train_scaled_head, sizes, STEPS, head_scale, batch_size=BATCH,
                    clip_grad_norm=max_norm, **kw, **config)
    losses, params, norms = truth(tuple(sorted(config.items())), max_norm, head_scale, **truth_kw(sizes, config, kw))
    got = res.values[0]
    assert all(v["losses"] == got["losses"] and v["grad_norms"] == got["grad_norms"] for v in res.values), \
        "the loss and the norm must be the same on every rank"
    assert len(got["grad_norms"]) == STEPS
    assert max(abs(a - b) for a, b in zip(got["grad_norms"], norms)) <= TOL, (got["grad_norms"], norms)
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) <= TOL, (got["losses"], losses)
    assert set(got["params"]) == set(params)
    for name, p in params.items():
        assert (got["params"][name] - p).abs().max().item() <= TOL, name
    for r in range(len(res.values)):             # one all-reduce of one float64 per step, over the world
        ev = res.trace.filter(op="all_reduce", rank=r, what="grad_norm")
        assert len(ev) == STEPS and all(e.nbytes == 8 for e in ev), (r, ev)
    return norms


CASES = [
    ("1 rank", {}, DENSE, {}),
    ("tp", {"tp": 2}, DENSE, {}),
    ("tp+sp", {"tp": 2}, DENSE, {"sequence_parallel": True}),
    ("dp×ep", {"dp": 2, "ep": 2}, MOE, {}),
    ("tp×cp", {"tp": 2, "cp": 2}, DENSE, {}),
    ("dp×tp×ep", {"dp": 2, "tp": 2, "ep": 2}, MOE, {}),           # an expert's fc2 bias: replicated over tp
    ("pp×dp×ep", {"pp": 2, "dp": 2, "ep": 2}, MOE_ALL, {"num_microbatches": 2}),
    ("dp×tp×pp", {"dp": 2, "tp": 2, "pp": 2}, DENSE, {"num_microbatches": 2}),
    ("zero1 dp×tp", {"dp": 2, "tp": 2}, DENSE, {"zero": 1}),
    ("zero2 dp×ep", {"dp": 2, "ep": 2}, MOE, {"zero": 2}),
    ("zero2 dp×cp×tp+sp", {"dp": 2, "cp": 2, "tp": 2}, DENSE, {"zero": 2, "sequence_parallel": True}),
    # folded (etp = 1): whole experts counted on edp 0 whatever their tp coordinate; routers summed over tp first
    ("folded tp×dp ep4 etp1", {"tp": 2, "dp": 2, "ep": 4, "etp": 1}, dict(MOE, shared_experts=1), {}),
]


@pytest.mark.parametrize("name,sizes,config,kw", CASES, ids=[c[0] for c in CASES])
def test_clipping_on_the_grid_equals_torch_clip_grad_norm_on_one_process(world, name, sizes, config, kw):
    norms = run_and_compare(world, sizes, config, kw, ACTIVE)
    assert all(n > ACTIVE for n in norms), norms                  # the coefficient is < 1 on every step
    unclipped, _, _ = truth(tuple(sorted(config.items())), None, **truth_kw(sizes, config, kw))
    assert max(abs(a - b) for a, b in zip(truth(tuple(sorted(config.items())), ACTIVE, **truth_kw(
        sizes, config, kw))[0], unclipped)) > 100 * TOL                   # and the comparison can see clipping


@pytest.mark.parametrize("name,sizes,config,kw", [CASES[5], CASES[7], CASES[10]],
                         ids=[CASES[i][0] for i in (5, 7, 10)])
def test_a_max_norm_never_reached_changes_nothing(world, name, sizes, config, kw):
    norms = run_and_compare(world, sizes, config, kw, INACTIVE)
    assert all(n < INACTIVE for n in norms)
    losses, params, _ = truth(tuple(sorted(config.items())), INACTIVE, **truth_kw(sizes, config, kw))
    unclipped, unclipped_params, _ = truth(tuple(sorted(config.items())), None, **truth_kw(sizes, config, kw))
    assert losses == unclipped and all(torch.equal(params[n], unclipped_params[n]) for n in params)


@pytest.mark.parametrize("name,sizes,config,kw", [CASES[5], CASES[7], CASES[10]],
                         ids=[CASES[i][0] for i in (5, 7, 10)])
def test_large_gradients_clip_the_same(world, name, sizes, config, kw):
    """The head × 30 at initialisation: logits of ~30, norms of ~20, a coefficient of ~2e-3 — the same.
    (Not a large lr: Adam's step lr·g/(|g| + 1e-8) turns rounding noise on the gradients that are 0 in
    exact arithmetic, such as the key bias's, into differences of lr·1e-9, clipped or not.)"""
    norms = run_and_compare(world, sizes, config, kw, ACTIVE, head_scale=30.0)
    assert min(norms) > 10, norms


def test_without_clipping_no_message_is_added(world):
    res = world(2).run(workers.train_worker, {"tp": 2}, 1, batch_size=BATCH, params="none", **DENSE)
    assert not res.trace.filter(what="grad_norm") and "grad_norms" not in res.values[0]


# ----------------------------------------------------------------------------------------------
# The classic bug, shown to be caught


@pytest.mark.parametrize("sizes,kw", [({"dp": 2, "tp": 2, "pp": 2}, {"num_microbatches": 2}),
                                      ({"tp": 2}, {"sequence_parallel": True})], ids=["dp×tp×pp", "tp+sp"])
def test_counting_tp_copies_tp_times_or_the_local_shard_only_gives_another_norm(world, sizes, kw):
    res = world(world_of(sizes)).run(clip_workers.step0_norms, sizes, batch_size=BATCH, **kw, **DENSE)
    want = truth(tuple(sorted(DENSE.items())), ACTIVE)[2][0]              # torch's norm of step 0's gradient
    vals = res.values
    assert all(abs(v["norm"] - want) <= TOL for v in vals), ([v["norm"] for v in vals], want)
    wrong = vals[0]["tp_counted_tp_times"]
    assert all(v["tp_counted_tp_times"] == wrong for v in vals) and abs(wrong - want) > 1e-3, (wrong, want)
    local = [v["local_only"] for v in vals]
    assert all(abs(n - want) > 1e-3 for n in local) and len(set(local)) > 1, (local, want)
    # each tp-replicated parameter is counted on exactly one rank; a tp-cut one on tp ranks (one per shard)
    tp = sizes.get("tp", 1)
    owners: dict[str, int] = {}
    for v in vals:
        for name in v["owned_here"]:
            owners[name] = owners.get(name, 0) + 1
    replicated = set().union(*(v["replicated_on_tp"] for v in vals))
    assert {"blocks.0.ln1.weight", "blocks.1.attn.proj.bias", "ln_f.bias"} <= replicated
    assert all(owners[n] == (1 if n in replicated else tp) for n in owners), owners
    assert set(owners) == set(truth(tuple(sorted(DENSE.items())), ACTIVE)[1])   # every parameter, somewhere


# ----------------------------------------------------------------------------------------------
# scripts/train_composed.py --clip-grad-norm: torchrun and --single


def _lines(out: str) -> list[list[str]]:
    return [ln.split() for ln in out.splitlines() if ln.startswith("step ")]


ARGS = ["--steps", str(STEPS), "--layers", "2", "--d-model", "16", "--heads", "2", "--d-ff", "32", "--seq-len", "8",
        "--experts", "4", "--clip-grad-norm", str(ACTIVE)]


def _check(lines: list[list[str]]) -> None:
    losses, _, norms = truth(tuple(sorted(MOE.items())), ACTIVE)
    assert [int(ln[1]) for ln in lines] == list(range(STEPS)) and all(ln[4] == "grad_norm" for ln in lines), lines
    assert max(abs(float(ln[3]) - b) for ln, b in zip(lines, losses)) <= TOL, (lines, losses)
    assert max(abs(float(ln[5]) - b) for ln, b in zip(lines, norms)) <= TOL, (lines, norms)


def test_torchrun_script_clips_as_one_process(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "scripts" / "train_composed.py"), "--cp", "2", "--ep", "2", "--timeout", "30", *ARGS]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check(_lines(proc.stdout))


def test_single_script_clips_with_torch(capsys):
    spec = importlib.util.spec_from_file_location("train_composed", ROOT / "scripts" / "train_composed.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--single", *ARGS])
    _check(_lines(capsys.readouterr().out))
