"""Train the tiny GPT on a rank grid under torchrun (lecture 5c): the same code as the notebook's worlds.

    torchrun --standalone --nproc-per-node 4 scripts/train_composed.py --tp 2 --dp 2 --steps 5
    torchrun --standalone --nproc-per-node 8 scripts/train_composed.py --dp 2 --tp 2 --pp 2 --microbatches 2
    torchrun --standalone --nproc-per-node 4 scripts/train_composed.py --dp 4 --ep 2 --experts 4
    torchrun --standalone --nproc-per-node 4 scripts/train_composed.py --dp 2 --cp 2 --zero 2
    torchrun --standalone --nproc-per-node 4 scripts/train_composed.py --tp 2 --cp 2 --clip-grad-norm 0.5
    torchrun --standalone --nproc-per-node 4 scripts/train_composed.py --tp 2 --sp --dp 2 --recompute selective
    torchrun --standalone --nproc-per-node 8 scripts/train_composed.py --dp 2 --tp 2 --pp 2 --ep 2 --experts 4
    torchrun --standalone --nproc-per-node 4 scripts/train_composed.py --tp 2 --dp 2 --ep 4 --etp 1 --experts 8 \
        --top-k 4 --expert-ffn 16 --shared-experts 1 --dense-layers 1 --router sigmoid --balance loss_free
    python scripts/train_composed.py --single --steps 5          # the single-process ground truth
    python scripts/train_composed.py --single --pp 2 --dp 2 --experts 4   # its truth (aux per micro-batch)

The product tp·cp·dp·pp must equal the number of processes.  The expert grid folds the same ranks of each
stage as etp·ep·edp (``--etp``, default tp: ep carved out of dp·cp; ``--etp 1``: experts whole, ep up to
tp·cp·dp, e.g. DeepSeek-V3's EP 64 over TP 2 × DP 32).  Frontier MoE layers: ``--expert-ffn`` (fine-grained
experts), ``--shared-experts``, ``--dense-layers`` (the first k blocks dense), ``--top-k`` up to 8,
``--router sigmoid``, ``--balance aux|seq_aux|loss_free|loss_free+seq_aux`` and ``--z-loss-coef``.  gloo on
CPU, nccl when CUDA is available (``--backend`` to choose); the process group is initialised from
the environment torchrun sets (env://) with ``--timeout`` seconds, and every subgroup gets the same
timeout.  Rank 0 prints ``step <i> loss <value>`` per step (17 significant digits: the losses
equal ``reference.gpt.train_single``'s to ~1e-15) — ``--single`` prints those.  With MoE layers
and pp > 1 each micro-batch has its own aux loss: ``--single`` then accumulates over the same
micro-batches (give it the run's --pp, --dp and --microbatches).

``--clip-grad-norm C`` clips the gradients to global norm C before every step (torch's
``clip_grad_norm_`` with ``--single``, reference.compose.clip on the grid); each step's line then
ends with `` grad_norm <value>``, the norm before clipping.  ``--recompute selective|full`` runs the
attention core or each whole block again in the backward (Korthikanti et al. §5): the same losses, less
memory kept.  With MoE layers only "selective" (the router's statistics would count twice).

Checkpoints (reference.compose.checkpoint, through torch.distributed.checkpoint)::

    torchrun --standalone --nproc-per-node 2 scripts/train_composed.py --dp 2 --zero 1 --steps 2 \
        --checkpoint-dir ckpt --checkpoint-every 1                    # ckpt/step_000001, ckpt/step_000002
    torchrun --standalone --nproc-per-node 2 scripts/train_composed.py --tp 2 --steps 4 \
        --checkpoint-dir ckpt --resume                                # another grid: prints steps 2, 3
    python scripts/train_composed.py --single --steps 6 --checkpoint-dir ckpt --resume    # one process: 4, 5

``--checkpoint-dir DIR`` saves every rank's shards (parameters, Adam's moments and step counts, in the
single-process layout) as ``DIR/step_<n>`` after every ``--checkpoint-every N``-th step and after
the last; ``--resume`` continues from the newest complete one (fresh when there is none) on any
grid, or ``--single``: rank 0 prints ``resumed from DIR/step_<n>`` and the steps continue from n.
With ``torchrun --max-restarts K --resume`` a run whose rank dies restarts from its last checkpoint.
(Test hook, not a feature: ``COURSE_TEST_KILL_AFTER_STEP=r:i`` makes global rank r SIGKILL itself after
step i on torchrun's first attempt; the full course's tests/compose/test_checkpoint.py uses it.)
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # the course's ``reference`` package


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for axis in ("tp", "cp", "dp", "pp", "ep"):
        p.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} size (default 1)")
    p.add_argument("--etp", type=int, default=None, help="expert-tensor size: tp (default) or 1 (folded)")
    p.add_argument("--sp", action="store_true", help="Megatron sequence parallelism inside the tp groups")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2), help="ZeRO stage over the dp·cp ranks (default 0)")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule (pp > 1): 1f1b, gpipe or zb_h1")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches (default pp; 1 without pp)")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                   help="activation recomputation: the attention core (selective) or each block (full)")
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="C",
                   help="clip the gradients to global norm C before each step (default: no clipping)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--experts", type=int, default=0, help="MoE experts (every 2nd block); 0 = dense")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-every", type=int, default=2, help="every n-th block is MoE (default 2)")
    p.add_argument("--expert-ffn", type=int, default=None, help="each expert's width (default: --d-ff)")
    p.add_argument("--shared-experts", type=int, default=0, help="shared experts every token uses (default 0)")
    p.add_argument("--dense-layers", type=int, default=0, help="the first k blocks stay dense (default 0)")
    p.add_argument("--router", choices=("softmax", "sigmoid"), default="softmax")
    p.add_argument("--balance", choices=("aux", "seq_aux", "loss_free", "loss_free+seq_aux"), default="aux",
                   help="load balancing: Switch's loss, per sequence, a loss-free bias, or both (default aux)")
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument("--bias-update-rate", type=float, default=1e-3, help="loss-free balancing's γ")
    p.add_argument("--z-loss-coef", type=float, default=0.0, help="ST-MoE's router z-loss weight (default 0)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with CUDA, else gloo")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a blocked collective fails")
    p.add_argument("--single", action="store_true", help="run reference.gpt.train_single instead (no torchrun)")
    p.add_argument("--checkpoint-dir", metavar="DIR", default=None, help="save checkpoints in DIR/step_<n>")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="save after every N-th step (default 0: after the last step only)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir (fresh if none)")
    args = p.parse_args(argv)
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        p.error("--resume and --checkpoint-every need --checkpoint-dir")
    if args.checkpoint_every < 0:
        p.error("--checkpoint-every must be >= 0")
    return args


def _test_hook_kill(step: int, rank: int) -> None:
    """TEST HOOK, not a feature: COURSE_TEST_KILL_AFTER_STEP="r:i" → global rank r SIGKILLs itself after
    step i, on torchrun's first attempt only (TORCHELASTIC_RESTART_COUNT 0): a rank that dies mid-run."""
    spec = os.environ.get("COURSE_TEST_KILL_AFTER_STEP")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and spec == f"{rank}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _line(step: int, loss: float, norm: float | None) -> str:
    return f"step {step} loss {loss:.17g}" + ("" if norm is None else f" grad_norm {norm:.17g}")


def _saved_line(saved) -> str:
    b = saved.bytes_per_rank
    return (f"saved {saved.path} ({sum(b.values())} bytes, at most {max(b.values(), default=0)} from one rank, "
            f"{saved.seconds:.3f} s)")


def run_single(args, config: dict, m: int) -> None:
    """--single: reference.gpt.train_single, with the same checkpoints (its model and torch.optim.Adam)."""
    import torch

    from reference.compose import checkpoint
    from reference.gpt import GPTConfig, TinyGPT, corpus, encode, train_single
    same_microbatches = dict(num_microbatches=m, dp=args.dp) if args.experts and args.pp > 1 else {}
    torch.manual_seed(args.seed)                      # as train_single initialises its model
    model = TinyGPT(GPTConfig(vocab=len(encode(corpus())[1]), **config)).to(torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    ckpt, start, norms = None, 0, []
    if args.checkpoint_dir:
        meta = checkpoint.run_meta(model.cfg, seed=args.seed, batch_size=args.batch_size, lr=args.lr)
        ckpt = checkpoint.Checkpoints(args.checkpoint_dir, checkpoint.single_state(model, opt), meta,
                                      every=args.checkpoint_every)
        start = ckpt.resume() if args.resume else 0
        if ckpt.resumed:
            print(f"resumed from {ckpt.resumed}", flush=True)

    def report(step: int, loss: float) -> None:
        print(_line(step, loss, norms[-1] if args.clip_grad_norm is not None else None), flush=True)
        if ckpt is not None and (saved := ckpt.after_step(step + 1, args.steps)) is not None:
            print(_saved_line(saved), flush=True)

    train_single(args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed, model=model, optimizer=opt,
                 start_step=start, clip_grad_norm=args.clip_grad_norm, grad_norms=norms, on_step=report,
                 **same_microbatches)


def run_grid(args, config: dict, m: int, device) -> None:
    """This rank's part of the grid run (the process group is up)."""
    import torch.distributed as dist

    from reference.compose import checkpoint, workers
    sizes = {a: getattr(args, a) for a in ("tp", "cp", "dp", "pp", "ep")}
    if args.etp is not None:
        sizes["etp"] = args.etp
    model, data = workers.build(sizes, batch_size=args.batch_size, seed=args.seed, sequence_parallel=args.sp,
                                num_microbatches=m, zero=args.zero, device=device, recompute=args.recompute,
                                **config)
    rank = dist.get_rank()
    if rank == 0:
        print(f"{model.grid!r} on {dist.get_backend()}: {dist.get_world_size()} processes", flush=True)
    opt, ckpt, start = workers.make_optimizer(model, args.zero, args.lr), None, 0
    if args.checkpoint_dir:
        meta = checkpoint.run_meta(model.cfg, seed=args.seed, batch_size=args.batch_size, lr=args.lr, grid=sizes,
                                   zero=args.zero)
        ckpt = checkpoint.Checkpoints(args.checkpoint_dir, checkpoint.grid_state(model, opt), meta,
                                      every=args.checkpoint_every)
        start = ckpt.resume() if args.resume else 0
        if ckpt.resumed and rank == 0:
            print(f"resumed from {ckpt.resumed}", flush=True)

    def report(step: int, loss: float) -> None:
        if rank == 0:
            print(_line(step, loss, model.grad_norm), flush=True)
        if ckpt is not None and (saved := ckpt.after_step(step + 1, args.steps)) is not None and rank == 0:
            print(_saved_line(saved), flush=True)
        _test_hook_kill(step, rank)

    workers.fit(model, data, args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                schedule=args.schedule, num_microbatches=m, zero=args.zero, clip_grad_norm=args.clip_grad_norm,
                on_step=report, optimizer=opt, start=start)


def main(argv=None) -> None:
    args = parse(argv)
    import torch
    refusals: tuple = ()
    if args.checkpoint_dir:
        from reference.compose.checkpoint import CheckpointError
        refusals = (CheckpointError,)                 # a checkpoint that does not fit, or damaged files
    config = dict(layers=args.layers, d_model=args.d_model, heads=args.heads, d_ff=args.d_ff,
                  seq_len=args.seq_len, num_experts=args.experts, top_k=args.top_k, moe_every=args.moe_every,
                  expert_ffn=args.expert_ffn, shared_experts=args.shared_experts, dense_layers=args.dense_layers,
                  router=args.router, balance=args.balance, aux_loss_coef=args.aux_loss_coef,
                  bias_update_rate=args.bias_update_rate, z_loss_coef=args.z_loss_coef)
    m = args.microbatches or args.pp
    if args.single:
        try:
            run_single(args, config, m)
        except refusals as e:
            sys.exit(f"error: {e}")
        return

    import torch.distributed as dist

    from reference import comm
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    os.environ[comm.PG_TIMEOUT_ENV] = str(args.timeout)          # subgroups: the same timeout
    timeout = timedelta(seconds=args.timeout)
    # torchrun's agent keeps one store across restarts (--max-restarts): a restarted world would read the
    # previous attempt's addresses (gloo: "Connection refused").  Prefix its keys with the attempt.
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    device = None
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    try:
        run_grid(args, config, m, device)
    except refusals as e:                             # raised on every rank alike: rank 0 says it
        if dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        comm.forget_groups()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
