"""Issue 27: checkpoints through torch.distributed.checkpoint — exact resume, resharding, refusals, a killed rank.

Float64, the tiny GPT (heads 4 so that tp can be 4).  A run of N steps is cut after K: the grid saves
(every rank its shards, in the single-process layout), and a resume — on the same grid, on another
grid, or on one process — continues with the losses and final parameters of the uninterrupted run:
exactly on the same grid (≤ 1e-12), and on another one like the single process (≤ 1e-10).  The
checkpoints are written once per module (8 ranks each) and copied for every resume.  Worlds are
the session's kept-alive ones (tests/conftest.py).
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint

from reference.compose import checkpoint, workers
from reference.gpt import GPTConfig, TinyGPT, corpus, encode, train_single
from tests.workers import checkpoint_workers

ROOT = Path(__file__).resolve().parents[2]
N, K = 4, 2                                      # steps in all; steps before the checkpoint
EXACT, TOL = 1e-12, 1e-10
DENSE = dict(layers=2, d_model=16, heads=4, d_ff=32, seq_len=8)
MOE = dict(DENSE, num_experts=4, moe_every=1)    # both blocks MoE: one on each pp stage
# frontier MoE on a folded grid (etp 1, ep 4 over tp 2 × dp 2): loss-free balancing's biases are training state too
FRONTIER = dict(DENSE, num_experts=8, top_k=4, moe_every=1, dense_layers=1, expert_ffn=8, shared_experts=1,
                router="sigmoid", balance="loss_free+seq_aux", bias_update_rate=0.05, z_loss_coef=1e-2)
SOURCES = {                                      # name: (sizes, config, train_worker keywords)
    "dense": ({"dp": 2, "tp": 2, "pp": 2}, DENSE, dict(zero=1, num_microbatches=2)),
    "moe": ({"dp": 2, "tp": 2, "pp": 2, "ep": 2}, MOE, dict(zero=2, schedule="gpipe")),
    "folded": ({"tp": 2, "dp": 2, "ep": 4, "etp": 1}, FRONTIER, {}),
}


def ranks(sizes: dict) -> int:
    return sizes.get("tp", 1) * sizes.get("cp", 1) * sizes.get("dp", 1) * sizes.get("pp", 1)


def model_and_adam(config: dict) -> tuple[TinyGPT, torch.optim.Adam]:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=len(encode(corpus())[1]), **config)).to(torch.float64)
    return model, torch.optim.Adam(model.parameters(), lr=3e-3)


@functools.cache
def truth(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """train_single's N losses and final parameters (MoE with pp 2, m = 1: the same objective as one process)."""
    model, _ = model_and_adam(SOURCES[name][1])
    losses = train_single(N, model=model)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_close(got_losses, got_params, want_losses, want_params, tol: float) -> None:
    assert len(got_losses) == len(want_losses), (got_losses, want_losses)
    assert max(abs(a - b) for a, b in zip(got_losses, want_losses)) <= tol, (got_losses, want_losses)
    assert set(got_params) == set(want_params)
    for n, p in want_params.items():
        assert (got_params[n] - p).abs().max().item() <= tol, n


@pytest.fixture(scope="module")
def saved(world, tmp_path_factory):
    """``saved(name)`` → (a fresh directory holding only step_00000K of SOURCES[name], the run's result): the
    uninterrupted run of N steps on the source grid, saving after step K and N, once per module."""
    made: dict[str, tuple[Path, dict]] = {}
    root = tmp_path_factory.mktemp("sources")

    def get(name: str) -> tuple[Path, dict]:
        if name not in made:
            sizes, config, kw = SOURCES[name]
            res = world(ranks(sizes)).run(workers.train_worker, sizes, N, checkpoint_dir=str(root / name),
                                          checkpoint_every=K, **kw, **config)
            made[name] = (root / name / f"step_{K:06d}", res.values[0])
        copy = tmp_path_factory.mktemp(name)
        shutil.copytree(made[name][0], copy / made[name][0].name)
        return copy, made[name][1]
    return get


def resume(world, directory: Path, sizes: dict, config: dict, **kw) -> dict:
    res = world(ranks(sizes)).run(workers.train_worker, sizes, N, checkpoint_dir=str(directory),
                                  resume=True, **kw, **config)
    out = res.values[0]
    assert all(v["losses"] == out["losses"] for v in res.values), "the loss must be the same on every rank"
    assert out["start"] == K and out["resumed"] == str(directory / f"step_{K:06d}"), out
    return out


# ----------------------------------------------------------------------------------------------
# Exact resume on the same grid


@pytest.mark.parametrize("name", ["dense", "moe"], ids=["dp2×tp2×pp2 zero1", "dp2×tp2×pp2×ep2 zero2"])
def test_a_resumed_run_is_the_uninterrupted_run(world, saved, name):
    sizes, config, kw = SOURCES[name]
    directory, whole = saved(name)
    assert [s.path.name for s in whole["saved"]] == [f"step_{K:06d}", f"step_{N:06d}"], whole["saved"]
    out = resume(world, directory, sizes, config, **kw)
    assert_close(out["losses"], out["params"], whole["losses"][K:], whole["params"], EXACT)
    assert_close(whole["losses"], whole["params"], *truth(name), TOL)
    assert [s.path.name for s in out["saved"]] == [f"step_{N:06d}"]     # after the last step (checkpoint_every 0)


# ----------------------------------------------------------------------------------------------
# Resharding: save on one grid, resume on another (or one process)

RESHARD = [
    ("dense", {"dp": 4, "tp": 2}, dict(zero=2)),                            # pp 2 → 1, ZeRO over dp 2 → dp 4
    ("dense", {"tp": 4, "pp": 2}, dict(num_microbatches=2)),                 # tp 2 → 4 (qkv, padded vocab), no ZeRO
    ("dense", {"dp": 2, "cp": 2}, dict(zero=1)),                             # tp 2 → 1, ZeRO over dp·cp 4
    ("moe", {"dp": 4, "ep": 4}, dict(zero=1)),                               # experts ep 2 → 4, tp 2 → 1
    ("folded", {"tp": 2, "dp": 2, "ep": 2}, {}),                             # ep 4 → 2, etp 1 → 2 (experts cut)
    ("folded", {"dp": 2, "pp": 2, "ep": 2, "etp": 1}, dict(zero=1, schedule="gpipe")),   # ep 4 → 2, tp 2 → 1, pp 2
]


@pytest.mark.parametrize("name,sizes,kw", RESHARD, ids=["dense→dp4×tp2 zero2", "dense→tp4×pp2", "dense→dp2×cp2 zero1",
                                                      "moe→dp4×ep4 zero1", "folded ep4 etp1→tp2×dp2 ep2 etp2",
                                                      "folded→dp2×pp2 ep2 zero1"])
def test_a_checkpoint_resumes_on_another_grid(world, saved, name, sizes, kw):
    directory, _ = saved(name)
    out = resume(world, directory, sizes, SOURCES[name][1], **kw)
    losses, params = truth(name)
    assert_close(out["losses"], out["params"], losses[K:], params, TOL)


@pytest.mark.parametrize("name", ["moe", "folded"])
def test_a_moe_grid_checkpoint_resumes_on_one_process(saved, name):
    directory, _ = saved(name)
    model, adam = model_and_adam(SOURCES[name][1])
    ckpt = checkpoint.Checkpoints(directory, checkpoint.single_state(model, adam), checkpoint.run_meta(model.cfg))
    start = ckpt.resume()
    assert start == K
    if name == "folded":                         # the loss-free biases came back (stepped K times: not zero)
        assert model.blocks[1].mlp.moe.expert_bias.abs().sum() > 0
    losses = train_single(N, model=model, optimizer=adam, start_step=start)
    want_losses, want_params = truth(name)
    assert_close(losses, dict(model.named_parameters()), want_losses[K:], want_params, TOL)


def test_a_one_process_checkpoint_resumes_on_a_grid(world, tmp_path):
    model, adam = model_and_adam(DENSE)
    ckpt = checkpoint.Checkpoints(tmp_path, checkpoint.single_state(model, adam), checkpoint.run_meta(model.cfg),
                                  every=K)
    train_single(K, model=model, optimizer=adam, on_step=lambda step, loss: ckpt.after_step(step + 1, N))
    out = resume(world, tmp_path, {"tp": 2, "dp": 2}, DENSE, zero=2)
    assert_close(out["losses"], out["params"], truth("dense")[0][K:], truth("dense")[1], TOL)


# ----------------------------------------------------------------------------------------------
# Refusals: on every rank, naming the tensor or the file, in seconds (no hang)


def damage(directory: Path, name: str, how: str) -> None:
    f = directory / f"step_{K:06d}" / name
    data = bytearray(f.read_bytes())
    if how == "truncate":
        f.write_bytes(bytes(data[:len(data) // 2]))
    else:                                            # one flipped bit in the middle: torch.load would not notice
        data[len(data) // 2] ^= 1
        f.write_bytes(bytes(data))


def test_a_checkpoint_that_does_not_fit_or_is_damaged_is_refused_on_every_rank(world, saved):
    sizes = {"dp": 2, "tp": 2}
    cases, want = [], []
    for config, word in ((dict(DENSE, d_ff=64), "tensor model.blocks.0.mlp.fc1.weight is saved with shape (32, 16), "
                                                "this model's is (64, 16)"),
                         (dict(DENSE, layers=3), "has no tensor model.blocks.2."),
                         (MOE, "has no tensor model.blocks.0.mlp.moe.router.weight (4, 16)"),
                         (dict(DENSE, seed=1), "was saved with seed=0, this run has 1")):
        cases.append(dict(dir=str(saved("dense")[0]), sizes=sizes, **config))
        want.append(word)
    for name, how, word in (("__5_0.distcp", "truncate", "__5_0.distcp has"),      # read by one rank only
                            ("__2_0.distcp", "flip", "__2_0.distcp is damaged"),
                            (".metadata", "flip", ".metadata is damaged")):
        directory = saved("dense")[0]
        damage(directory, name, how)
        cases.append(dict(dir=str(directory), sizes=sizes, **DENSE))
        want.append(word)
    res = world(4).run(checkpoint_workers.resume_errors, cases, N, timeout=60)
    said = [[(kind, message) for kind, message, _ in v] for v in res.values]
    assert all(v == said[0] for v in said[1:]), "every rank must refuse alike"
    for (kind, message, seconds), word in zip(res.values[0], want):
        assert kind == "CheckpointError" and word in message, (word, message)
        assert "checkpoint " in message and f"step_{K:06d}" in message
        print(f"refused in {seconds:.2f} s: {word}")       # a hang is the run's timeout=60 failing, not a clock here
    directory = saved("dense")[0]                    # with the checksums not checked, DCP's read fails everywhere
    damage(directory, "__1_0.distcp", "truncate")
    res = world(4).run(checkpoint_workers.load_error, str(directory / f"step_{K:06d}"), sizes, DENSE, timeout=60)
    assert all(v == res.values[0] for v in res.values[1:])
    kind, message = res.values[0]
    assert kind == "CheckpointError" and "could not be read" in message and "rank " in message, message


# ----------------------------------------------------------------------------------------------
# Atomic saves: an unfinished save is never resumed from


def test_resume_takes_the_newest_complete_checkpoint_and_a_crashed_save_leaves_it(tmp_path, monkeypatch):
    model, adam = model_and_adam(DENSE)
    state, meta = checkpoint.single_state(model, adam), checkpoint.run_meta(model.cfg)
    good = checkpoint.save(tmp_path, state, dict(meta, step=2)).path
    for step, missing in ((5, ".metadata"), (6, checkpoint.MANIFEST)):         # complete but for one file
        shutil.copytree(good, tmp_path / f"step_{step:06d}")
        (tmp_path / f"step_{step:06d}" / missing).unlink()
    shutil.copytree(good, tmp_path / "step_000007.tmp")                         # a save that never committed

    def crash(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(torch.distributed.checkpoint.FileSystemWriter, "finish", crash)   # after the data files
    with pytest.raises(checkpoint.CheckpointError, match="save checkpoint .*step_000008: rank 0: OSError: disk full"):
        checkpoint.save(tmp_path, state, dict(meta, step=8))
    monkeypatch.undo()
    assert (tmp_path / "step_000008.tmp").is_dir() and not (tmp_path / "step_000008").exists()
    assert checkpoint.latest(tmp_path) == good
    ckpt = checkpoint.Checkpoints(tmp_path, state, meta)
    assert ckpt.resume() == 2 and ckpt.resumed == good
    again = checkpoint.save(tmp_path, state, dict(meta, step=8)).path         # the stale .tmp is cleared first
    assert checkpoint.latest(tmp_path) == again and not (tmp_path / "step_000008.tmp").exists()
    assert checkpoint.Checkpoints(tmp_path / "none", state, meta).resume() == 0     # nothing there: start fresh


# ----------------------------------------------------------------------------------------------
# DTensor describes the column, row and vocabulary cuts with the same chunks


def test_our_chunks_are_dtensors_for_the_cuts_dtensor_can_express(world):
    res = world(4).run(checkpoint_workers.dtensor_and_our_chunks)
    for r, value in enumerate(res.values):
        for kind, (theirs, ours, same) in value.items():
            assert theirs == ours and same, (r, kind, theirs, ours)
    assert res.values[3]["vocab"][1] == [((21, 0), (6, 16))]           # 27 rows over 4: 7, 7, 7, 6 (+1 padding)


# ----------------------------------------------------------------------------------------------
# Under torchrun: a killed rank, restarted from the last checkpoint


def torchrun(nproc: int, *args: str, cwd: Path, env: dict | None = None, restarts: int = 0, timeout: float = 180):
    """scripts/train_composed.py with the tiny model under torchrun (``nproc`` 0: plain python, for --single)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "--max-restarts",
                str(restarts)] if nproc else []
    cmd = [sys.executable, *launcher, str(ROOT / "scripts" / "train_composed.py"), "--layers", "2", "--d-model", "16",
           "--heads", "4", "--d-ff", "32", "--seq-len", "8", "--timeout", "30", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def step_lines(out: str) -> list[tuple[int, float]]:
    return [(int(w[1]), float(w[3])) for w in (ln.split() for ln in out.splitlines() if ln.startswith("step "))]


def test_the_readme_commands_save_on_a_grid_and_resume_on_another_and_on_one_process(tmp_path):
    """README's chain: dp 2 with ZeRO-1 saves after steps 1 and 2, tp 2 resumes and saves after step 4, one
    process resumes from that and runs steps 4 and 5: every loss is the single process's."""
    ckpt = tmp_path / "ckpt"
    runs = [torchrun(2, "--dp", "2", "--zero", "1", "--steps", "2", "--checkpoint-dir", str(ckpt),
                     "--checkpoint-every", "1", cwd=tmp_path),
            torchrun(2, "--tp", "2", "--steps", "4", "--checkpoint-dir", str(ckpt), "--resume", cwd=tmp_path),
            torchrun(0, "--single", "--steps", "6", "--checkpoint-dir", str(ckpt), "--resume", cwd=tmp_path)]
    model, _ = model_and_adam(DENSE)
    want = train_single(6, model=model)
    for proc, resumed, steps in zip(runs, (None, 2, 4), ([0, 1], [2, 3], [4, 5])):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert ("resumed from" in proc.stdout) == (resumed is not None), proc.stdout
        if resumed is not None:
            assert f"resumed from {ckpt / f'step_{resumed:06d}'}\n" in proc.stdout, proc.stdout
        lines = step_lines(proc.stdout)
        assert [s for s, _ in lines] == steps, proc.stdout
        assert max(abs(v - want[s]) for s, v in lines) <= TOL, (lines, want)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000001", "step_000002", "step_000004", "step_000006"]


def test_a_killed_rank_restarts_from_the_last_checkpoint_under_torchrun(tmp_path):
    steps = 5
    proc = torchrun(2, "--tp", "2", "--steps", str(steps), "--checkpoint-dir", str(tmp_path / "ckpt"),
                    "--checkpoint-every", "2", "--resume", cwd=tmp_path, restarts=1,
                    env={"COURSE_TEST_KILL_AFTER_STEP": "1:2"})            # rank 1 dies after step 2, attempt 0
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr, proc.stderr[-3000:]                # rank 1: SIGKILL
    first, resumed = out.split(f"resumed from {tmp_path / 'ckpt' / 'step_000002'}")
    assert [s for s, _ in step_lines(first)][:3] == [0, 1, 2], out         # attempt 0 got past step 2 ...
    again = step_lines(resumed)
    assert [s for s, _ in again] == [2, 3, 4], out                           # ... attempt 1 redid it from step 2
    model, _ = model_and_adam(DENSE)
    want = train_single(steps, model=model)
    assert max(abs(v - w) for (_, v), w in zip(step_lines(first)[:3] + again, want[:3] + want[2:])) <= TOL, out
    assert checkpoint.latest(tmp_path / "ckpt").name == f"step_{steps:06d}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (nccl); this machine has none")
def test_the_script_saves_and_resumes_on_nccl(tmp_path):
    n = min(2, torch.cuda.device_count())
    sizes = ["--tp", str(n)]
    proc = torchrun(n, *sizes, "--backend", "nccl", "--steps", str(K), "--checkpoint-dir", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = torchrun(n, "--dp", str(n), "--backend", "nccl", "--steps", str(N), "--checkpoint-dir", str(tmp_path),
                    "--resume", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = step_lines(proc.stdout)
    assert [s for s, _ in lines] == list(range(K, N)), proc.stdout
    assert max(abs(v - t) for (_, v), t in zip(lines, truth("dense")[0][K:])) <= TOL, proc.stdout
