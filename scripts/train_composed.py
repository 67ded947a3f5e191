"""Train the tiny GPT on a rank grid under torchrun (lecture 5c): the same code as the notebook's worlds.

    torchrun --standalone --nproc-per-node 4 scripts/train_composed.py --tp 2 --dp 2 --steps 5
    torchrun --standalone --nproc-per-node 8 scripts/train_composed.py --dp 2 --tp 2 --pp 2 --microbatches 2
    torchrun --standalone --nproc-per-node 4 scripts/train_composed.py --dp 4 --ep 2 --experts 4
    torchrun --standalone --nproc-per-node 4 scripts/train_composed.py --dp 2 --cp 2 --zero 2
    torchrun --standalone --nproc-per-node 4 scripts/train_composed.py --tp 2 --cp 2 --clip-grad-norm 0.5
    torchrun --standalone --nproc-per-node 8 scripts/train_composed.py --dp 2 --tp 2 --pp 2 --ep 2 --experts 4
    python scripts/train_composed.py --single --steps 5          # the single-process ground truth
    python scripts/train_composed.py --single --pp 2 --dp 2 --experts 4   # its truth (aux per micro-batch)

The product tp·cp·dp·pp must equal the number of processes (ep is carved out of dp·cp).  gloo on
CPU, nccl when CUDA is available (``--backend`` to choose); the process group is initialised from
the environment torchrun sets (env://) with ``--timeout`` seconds, and every subgroup gets the same
timeout.  Rank 0 prints ``step <i> loss <value>`` per step (17 significant digits: the losses
equal ``reference.gpt.train_single``'s to ~1e-15) — ``--single`` prints those.  With MoE layers
and pp > 1 each micro-batch has its own aux loss: ``--single`` then accumulates over the same
micro-batches (give it the run's --pp, --dp and --microbatches).

``--clip-grad-norm C`` clips the gradients to global norm C before every step (torch's
``clip_grad_norm_`` with ``--single``, reference.compose.clip on the grid); each step's line then
ends with `` grad_norm <value>``, the norm before clipping.
"""
from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # the course's ``reference`` package


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for axis in ("tp", "cp", "dp", "pp", "ep"):
        p.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} size (default 1)")
    p.add_argument("--sp", action="store_true", help="Megatron sequence parallelism inside the tp groups")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2), help="ZeRO stage over the dp·cp ranks (default 0)")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule (pp > 1): 1f1b, gpipe or zb_h1")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches (default pp; 1 without pp)")
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
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with CUDA, else gloo")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a blocked collective fails")
    p.add_argument("--single", action="store_true", help="run reference.gpt.train_single instead (no torchrun)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    import torch
    config = dict(layers=args.layers, d_model=args.d_model, heads=args.heads, d_ff=args.d_ff,
                  seq_len=args.seq_len, num_experts=args.experts, top_k=args.top_k)
    m = args.microbatches or args.pp
    clip = args.clip_grad_norm

    def line(step: int, loss: float, norm: float | None) -> str:
        return f"step {step} loss {loss:.17g}" + ("" if norm is None else f" grad_norm {norm:.17g}")

    if args.single:
        from reference.gpt import train_single
        same_microbatches = dict(num_microbatches=m, dp=args.dp) if args.experts and args.pp > 1 else {}
        norms: list[float] = []
        losses = train_single(args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                              clip_grad_norm=clip, grad_norms=norms, **same_microbatches, **config)
        for step, loss in enumerate(losses):
            print(line(step, loss, norms[step] if clip is not None else None), flush=True)
        return

    import torch.distributed as dist

    from reference import comm
    from reference.compose import workers
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    os.environ[comm.PG_TIMEOUT_ENV] = str(args.timeout)          # subgroups: the same timeout
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=args.timeout))
    device = None
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    try:
        sizes = {a: getattr(args, a) for a in ("tp", "cp", "dp", "pp", "ep")}
        model, data = workers.build(sizes, batch_size=args.batch_size, seed=args.seed, sequence_parallel=args.sp,
                                    num_microbatches=m, zero=args.zero, device=device, **config)
        if dist.get_rank() == 0:
            print(f"{model.grid!r} on {backend}: {dist.get_world_size()} processes", flush=True)
        report = ((lambda step, loss: print(line(step, loss, model.grad_norm), flush=True))
                  if dist.get_rank() == 0 else None)
        workers.fit(model, data, args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                    schedule=args.schedule, num_microbatches=m, zero=args.zero, clip_grad_norm=clip,
                    on_step=report)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
