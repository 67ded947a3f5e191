"""Benchmark for lecture 5b (not a test): expert parallelism on CPU ranks, against one process on
the same cores and against a GShard-style peer.

    .venv/bin/python benchmarks/moe.py             # both sizes, 5 interleaved repetitions (minutes)
    .venv/bin/python benchmarks/moe.py --quick     # small sizes, a few seconds per row
    .venv/bin/python benchmarks/moe.py --no-peer   # skip fairscale

1. Tokens per second, forward + backward (the input's gradient included: the layer sits inside a
   network), float32, top-2, for the padded (capacity) and the dropless path, at two sizes
   (d_model 256 / 8 experts / 4096 tokens per rank and d_model 512 / 16 experts / 2048 per rank):

   * ours: :class:`reference.moe.ExpertParallelMoE`, W = 2 ranks × 1 thread, gloo all-to-all;
   * one process looping over the experts (``MoELayer``) on the same W·T tokens in the same W
     routing groups, with W threads — the same cores, no communication: the bar (ratio 1.0) —
     and with 1 thread;
   * the peer, padded path only: fairscale 0.4.13's ``MOELayer`` + ``Top2Gate`` (GShard), the
     same 2 ranks × 1 thread, sizes, dtype and capacity, installed on first use into
     ``benchmarks/.peers/`` (pip --target --no-deps, never committed).  Its second expert is drawn
     with noise, so only its speed is compared, not its outputs.

   Repetitions are interleaved (ours, one process, peer, ours, ...) and medians compared, so that
   load drifting on a shared machine hits all alike.  Also printed: gloo's share — the same
   collectives with the same sizes (check, counts, 2 + 2 all-to-alls, the aux loss's all-reduce)
   timed alone on the ranks; the rest of a step is computation, ours or the matmuls'.
2. "Sparse, not just large": compute per token as the number of experts grows from 4 to 64 at
   fixed k.  FLOPs are counted from the routing (2 per multiply-add; dropless, so every token
   runs exactly k experts), time is measured (forward + backward, one process, 1 thread), and
   the parameter count is printed beside them.

How fairscale's capacity differs from ours (``reference.moe.expert_capacity``): its ``top2gating``
has no capacity factor — C = 2·T/E slots per expert (floor; T must divide by E), which is our
``ceil(k · cf · T / E)`` with cf = 1, so the peer row runs OUR layer at cf = 1 too.  Like ours,
first choices take slots before second choices; unlike ours its second choice is the argmax of
logits + Gumbel noise (not the second most probable expert), its two weights are renormalised
after dropping (ours before), and it computes every slot, padding included, after a dense
one-hot dispatch: ``einsum("sec,sm->ecm")`` and ``einsum("sec,ecm->sm")`` cost O(T·E·C·d) =
O(2·T²·d) per rank, quadratic in the tokens, where an index-based dispatch moves k·T rows.

Where the time went (issue 28; torch.profiler, self CPU per step on rank 0 of 2, d=256, E=8, 4096 tok/rank; the
matmuls are ~135 ms of a ~200 ms step). Round 1: the padded path transposed the received (W, E_local, C, d)
message to (E_local, W·C, d) and back (two full-buffer copies each way) and copied its zero buffers out of place;
it now runs its experts on the message as it arrives (``parallel._dispatch_rows`` / ``_combine_rows``). Round 2:
its buffers were still built as zeros + ``index_copy`` and read by ``index_select``, each a scatter or gather of
the whole (E·C, d) buffer with a zero-fill, forward and backward. They are now ``_pad`` (one ``cat`` of each
expert's contiguous rows and zero rows) and ``_unpad`` (views of the first rows of each block of C, an expert run
once per source rank): in one run the padded path's self CPU went from 1.09× the dropless path's (1,141 vs 1,043
ms over 5 steps) to 1.00× (971 vs 971), and in a prototype A/B (30 steps each, alternating) the CPU of both ranks
per step went from 451 to 435 ms. Round 3: each rank faulted in 2,500–11,000 fresh pages per step (the
all-to-alls' outputs and the padded buffers: glibc had given the last step's back); the launcher now keeps freed
memory in the ranks and in this process alike (``reference.rank_program.keep_freed_memory``), 0 faults per step,
and padded d=256 read 0.93×, 0.96× and 0.95× in three runs, against 0.87–0.95× in six runs today without it. It
speeds part 2's E = 4 up by ~4 % and E = 64 not at all (CPU µs/token 33.7/35.3 against 35.9/36.1, and 40.3/39.9
against 39.7/40.2), so part 2's ratio reads lower with it (0.84, 0.86 against 0.92, 0.87). What is left is not in
the main thread: the padded all-to-alls carry 25 % more rows (10.5 against 8.4 MB each, four per step) through
gloo's TCP loopback, whose copies run on the same two cores; in a run each took 2.5–13 ms against 1.5–2.8 ms alone
(8–10 MB, output buffer reused). Overlapping the dispatch with the experts on the rank's own tokens (a prototype:
post, compute own rows, wait, compute the rest) did not shorten the step on two cores — the transfer's copies need
the cores the compute would use. The step's wall-clock also depends on what ran just before it: a contender
measured right after the other one ran 3–12 % slower than after itself (the one-process loop most), so the
repetitions interleave them and the ratios of one run vary by ±5 %.
Part 2's E = 64 step spent ~16 ms more than E = 4 in ``top_k_gating``'s one-hot cumsum (O(k·T·E)) and the
aux loss's one-hot count: now a stable sort and a bincount (same integers).  E=4 ÷ E=64 CPU time per token,
5 alternating runs: before median 0.873 (0.822-0.899), after 0.913 (0.858-0.934).  The rest of E = 64's
extra (~25 ms) is in the matmuls: 16× the weight gradients written, 16× smaller expert batches.

The ranks import this file as the module ``moe`` (its directory is on ``sys.path``).  Figures
vary on a shared machine: quote the ratios of one run.  :func:`rows` returns the printed ratios
(ours ÷ one process with W threads, ours ÷ fairscale, the cost per token as E grows) for
``benchmarks/bench.py``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

import peers  # noqa: E402  (benchmarks/peers.py)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from reference import comm  # noqa: E402
from reference.moe import Expert, ExpertParallelMoE, MoELayer, expert_capacity  # noqa: E402

PEER_PACKAGES = ["fairscale==0.4.13"]
_STATE: dict = {}            # per process: the layer and inputs of each configuration, built once


# ----------------------------------------------------------------------------------------------
# One forward + backward of each contender (ranks for ours and the peer, the caller for the loop)


def _tokens(cfg: dict, r: int) -> torch.Tensor:
    return torch.randn(cfg["tokens"], cfg["d_model"], generator=torch.Generator().manual_seed(100 + r))


def _layer(cfg: dict) -> MoELayer:
    torch.manual_seed(cfg.get("seed", 0))
    return MoELayer(cfg["d_model"], cfg["d_ff"], cfg["num_experts"], k=2, capacity_factor=cfg["capacity_factor"],
                    dropless=cfg["dropless"], experts_impl="loop")   # the loop, as recorded (moe_frontier: grouped)


def ours_step(cfg: dict) -> tuple[float, float, int]:
    """Rank function: seconds (wall, CPU) of one forward + backward of ExpertParallelMoE on this
    rank's T tokens, and the rows this rank's experts computed (counted after the clock stops)."""
    key = ("ours", tuple(sorted(cfg.items())))
    if key not in _STATE:
        _STATE[key] = ExpertParallelMoE.from_layer(_layer(cfg)), _tokens(cfg, comm.rank()).requires_grad_()
    ep, x = _STATE[key]
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    y, st = ep(x)
    (y.square().mean() + 0.01 * st["aux_loss"]).backward()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    kept = st["kept_per_expert"].clone()
    dist.all_reduce(kept)                                   # the group's kept assignments per expert
    return seconds, cpu, int(kept[ep.first_expert:ep.first_expert + len(ep.experts)].sum())


def loop_step(cfg: dict, world_size: int, threads: int) -> float:
    """Seconds of one forward + backward of MoELayer over the W ranks' token groups, in this process."""
    key = ("loop", tuple(sorted(cfg.items())), world_size)
    if key not in _STATE:
        _STATE[key] = _layer(cfg), [_tokens(cfg, r).requires_grad_() for r in range(world_size)]
    layer, xs = _STATE[key]
    torch.set_num_threads(threads)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = [layer(x) for x in xs]
    sum(y.square().mean() + 0.01 * st["aux_loss"] for y, st in outs).backward()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    torch.set_num_threads(1)
    _STATE.setdefault(("cpu", threads), []).append(cpu)
    return seconds


def peer_step(cfg: dict) -> float:
    """Rank function: seconds of one forward + backward of fairscale's MOELayer + Top2Gate here.

    Input (E_local, T / E_local, d): fairscale wants the first dimension divisible by the local
    experts (and T by E); it reshapes to (T, d) anyway.
    """
    key = ("peer", tuple(sorted(cfg.items())))
    if key not in _STATE:
        _add_peers_to_path()
        from fairscale.nn.moe import MOELayer, Top2Gate
        W, E = dist.get_world_size(), cfg["num_experts"]
        torch.manual_seed(cfg.get("seed", 0) + dist.get_rank())
        experts = torch.nn.ModuleList(Expert(cfg["d_model"], cfg["d_ff"]) for _ in range(E // W))
        layer = MOELayer(Top2Gate(cfg["d_model"], E), experts)
        x = _tokens(cfg, dist.get_rank()).view(E // W, -1, cfg["d_model"]).requires_grad_()
        _STATE[key] = layer, x
    layer, x = _STATE[key]
    dist.barrier()
    t0 = time.perf_counter()
    y = layer(x)
    (y.square().mean() + 0.01 * layer.l_aux).backward()
    return time.perf_counter() - t0


def gloo_step(cfg: dict, rows: int) -> float:
    """Rank function: the collectives of one forward + backward of ours with the same sizes and
    nothing else: the input check, the counts, 2 + 2 all-to-alls of ``rows`` rows (equal splits;
    E·C padded, about k·T dropless), the aux loss's all-reduce."""
    W, E, d = dist.get_world_size(), cfg["num_experts"], cfg["d_model"]
    key = ("gloo", tuple(sorted(cfg.items())), rows)
    if key not in _STATE:
        _STATE[key] = torch.randn(rows - rows % W, d), torch.zeros(E, dtype=torch.long)
    buf, counts = _STATE[key]
    out = torch.empty_like(buf)
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(torch.zeros(3, dtype=torch.long), op=dist.ReduceOp.MIN)
    if cfg["dropless"]:
        dist.all_to_all_single(torch.empty_like(counts), counts)
    else:
        dist.all_gather([torch.empty_like(counts) for _ in range(W)], counts)
    for _ in range(4):
        dist.all_to_all_single(out, buf)
    dist.all_reduce(torch.zeros(2 * E + 1))
    return time.perf_counter() - t0


def clear_state() -> None:
    """Rank function (and local): drop the cached layers and inputs."""
    _STATE.clear()


def slowest(values) -> float:
    """A step takes as long as its slowest rank."""
    return max(values)


# ----------------------------------------------------------------------------------------------
# 1. Throughput


def _install_peer(install: bool) -> bool:
    return peers.ensure("fairscale.nn.moe", PEER_PACKAGES, install=install, first=False)


def _add_peers_to_path() -> None:
    peers.add_to_path(first=False)    # last: fairscale's wheel also ships a top-level package "benchmarks"


def throughput(world, cfg: dict, reps: int, peer: bool) -> list[dict]:
    """Interleaved repetitions of every contender at one size; medians and ratios printed."""
    W, results = world.world_size, []
    n = W * cfg["tokens"]
    print(f"\n1. d_model={cfg['d_model']}, d_ff={cfg['d_ff']}, E={cfg['num_experts']}, top-2, "
          f"{W}×{cfg['tokens']} tokens, float32, forward + backward, median of {reps} interleaved repetitions")
    modes = [("capacity", dict(cfg, dropless=False, capacity_factor=1.25)),
             ("dropless", dict(cfg, dropless=True, capacity_factor=1.25))]
    if peer:
        modes.append(("cf=1 (peer's C)", dict(cfg, dropless=False, capacity_factor=1.0)))
    for name, c in modes:
        rows_per_rank = [rows for _, _, rows in world.run(ours_step, c, timeout=900).values]   # warm-up
        ours_cpu = []

        def ours(c=c):
            vals = world.run(ours_step, c, timeout=900).values
            ours_cpu.append(sum(cpu for _, cpu, _ in vals))
            return slowest(s for s, _, _ in vals)

        contenders = {"ours": ours,
                      "loop W threads": lambda c=c: loop_step(c, W, W),
                      "loop 1 thread": lambda c=c: loop_step(c, W, 1)}
        if name.startswith("cf=1"):
            contenders = {"ours": contenders["ours"], "loop W threads": contenders["loop W threads"],
                          "fairscale": lambda c=c: slowest(world.run(peer_step, c, timeout=900).values)}
        for k, f in contenders.items():                 # warm-up: build, first-touch allocations
            if k != "ours":                             # (ours warmed up above)
                f()
        times = {k: [] for k in contenders}
        for _ in range(reps):
            for k, f in contenders.items():
                times[k].append(f())
        med = {k: statistics.median(v) for k, v in times.items()}
        loop_cpu = _STATE.get(("cpu", 1), [])[1:]          # 1-thread loop, warm-up left out
        sent = 2 * c["tokens"] if c["dropless"] else c["num_experts"] * expert_capacity(
            c["tokens"], c["num_experts"], 2, c["capacity_factor"])
        gloo = statistics.median(slowest(world.run(gloo_step, c, sent).values) for _ in range(reps))
        world.run(clear_state)
        clear_state()
        ours = med["ours"]
        busiest = max(rows_per_rank) / statistics.mean(rows_per_rank)
        print(f"   {name:16s} {f'ours, {W} ranks × 1 thread':31s}: {n / ours:9.0f} tok/s   "
              f"(gloo alone: {gloo * 1e3:6.1f} ms of {ours * 1e3:7.1f} ms per step = {gloo / ours:5.1%}; "
              f"busiest rank computes {busiest - 1:5.1%} more rows than the mean)")
        if loop_cpu:
            print(f"   {name:16s} CPU time, ours summed over ranks ÷ loop on 1 thread = "
                  f"{statistics.median(ours_cpu) / statistics.median(loop_cpu):5.2f}×  (the work EP adds, "
                  f"robust to load; ≈ 1 + what the {W} ranks do beyond the loop)")
        for k, v in med.items():
            if k != "ours":
                label = {"loop W threads": f"one process, loop, {W} threads",
                         "loop 1 thread": "one process, loop, 1 thread",
                         "fairscale": f"fairscale MOELayer {W} ranks × 1"}[k]
                print(f"   {name:16s} {label:31s}: {n / v:9.0f} tok/s   ours ÷ this = {v / ours:5.2f}×")
        results.append({"mode": name, **med, "gloo": gloo})
    return results


# ----------------------------------------------------------------------------------------------
# 2. Compute per token as experts grow


def flops_per_token(d_model: int, d_ff: int, num_experts: int, k: int) -> tuple[int, int]:
    """Forward FLOPs per token: (experts, router).  An expert: two matmuls, d·d_ff MACs each."""
    return k * 2 * (2 * d_model * d_ff), 2 * d_model * num_experts


def sparse_scaling(args) -> dict:
    d, d_ff, k, T = args.d_model, args.d_ff, 2, args.scaling_tokens
    print(f"\n2. Compute per token as experts grow (top-{k}, dropless, d_model={d}, d_ff={d_ff}, "
          f"T={T} tokens, one process, 1 thread, forward + backward)")
    print("   time = CPU seconds of this one-thread process (robust to other load on the machine);"
          " wall-clock beside it")
    print(f"   {'E':>3} {'params (M)':>11} {'fwd FLOPs/token':>16} {'(experts+router)':>17} "
          f"{'CPU µs/token':>13} {'vs first':>8} {'wall µs/token':>14}")
    torch.set_num_threads(1)
    layers, best, wall, stats = {}, {}, {}, {}
    for E in args.experts:
        torch.manual_seed(0)
        layers[E] = MoELayer(d, d_ff, E, k=k, dropless=True, experts_impl="loop")
        best[E] = wall[E] = float("inf")
    x = torch.randn(T, d)
    for _ in range(args.rounds):           # rounds interleave the sizes: load drifts hit all alike
        for E, layer in layers.items():
            t0, c0 = time.perf_counter(), time.process_time()
            y, stats[E] = layer(x)
            y.square().mean().backward()
            best[E] = min(best[E], time.process_time() - c0)
            wall[E] = min(wall[E], time.perf_counter() - t0)
    rows, base = [], None
    for E, layer in layers.items():
        assigned = int(stats[E]["kept_per_expert"].sum())   # = k·T, dropless
        fe, fr = flops_per_token(d, d_ff, E, k)
        counted = (assigned * fe / k + T * fr) / T            # from the routing actually taken
        params = sum(p.numel() for p in layer.parameters()) / 1e6
        us = best[E] / T * 1e6
        base = base or us
        rows.append((E, params, counted, us))
        print(f"   {E:>3} {params:>11.2f} {counted:>16,.0f} {fe:>9,}+{fr:<7,} {us:>13.2f} {us / base:>7.2f}× "
              f"{wall[E] / T * 1e6:>14.2f}")
    E0, p0, f0, u0 = rows[0]
    E1, p1, f1, u1 = rows[-1]
    print(f"   E {E0} → {E1}: parameters ×{p1 / p0:.1f}, counted FLOPs/token ×{f1 / f0:.3f}, "
          f"measured CPU time/token ×{u1 / u0:.2f} (flat means within 15%: "
          f"{'yes' if abs(u1 / u0 - 1) <= 0.15 else 'no'})")
    return dict(pair=f"MoE CPU time/token, E={E1} vs E={E0} (params ×{p1 / p0:.1f}, d={d}, dropless)", ours=u1,
                peer=u0, unit="CPU µs/token", ratio=u0 / u1, aim=1 / 1.15,
                note="how the cost grows: 'ours' = the larger E; flat = within 15 %")


def table_rows(size: dict, res: dict, W: int) -> list[dict]:
    """The table's rows of one mode at one size (``benchmarks/bench.py``): speed ours ÷ the bar."""
    n, mode = W * size["tokens"], res["mode"]
    what = f"MoE d={size['d_model']} E={size['num_experts']} {size['tokens']} tok/rank"
    if mode.startswith("cf=1"):
        return [dict(pair=f"{what}, padded cf=1: EP {W} ranks vs fairscale MOELayer {W} ranks", ours=n / res["ours"],
                     peer=n / res["fairscale"], unit="tok/s", ratio=res["fairscale"] / res["ours"], target=None)]
    return [dict(pair=f"{what}, {'padded' if mode == 'capacity' else mode}: EP {W} ranks vs 1 process {W} threads",
                 ours=n / res["ours"], peer=n / res["loop W threads"], unit="tok/s",
                 ratio=res["loop W threads"] / res["ours"], target=0.95)]


def main(argv=None) -> list[dict]:
    """Measure, print, and return the ratios as rows for ``benchmarks/bench.py``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, a few seconds per row")
    ap.add_argument("--no-peer", action="store_true", help="do not run fairscale")
    ap.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 5, --quick 3)")
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args(argv)
    reps = args.reps or (3 if args.quick else 5)
    if args.quick:
        sizes = [dict(d_model=128, d_ff=512, num_experts=8, tokens=1024)]
        args.d_model, args.d_ff, args.scaling_tokens, args.experts, args.rounds = 128, 512, 8192, [4, 16, 64], 3
    else:
        sizes = [dict(d_model=256, d_ff=1024, num_experts=8, tokens=4096),
                 dict(d_model=512, d_ff=2048, num_experts=16, tokens=2048)]
        args.d_model, args.d_ff, args.scaling_tokens, args.experts, args.rounds = 256, 1024, 8192, [4, 8, 16, 32, 64], 4
    peer = (not args.no_peer) and _install_peer(install=True)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} "
          "(part 1 is wall-clock: other load on the machine slows it; compare the ratios)")
    from reference.launch import World
    torch.set_num_threads(1)
    out = [] if peer or args.no_peer else [dict(pair="MoE EP vs fairscale MOELayer (GShard)",
                                                error=f"peer missing: could not install {PEER_PACKAGES[0]}")]
    with World(args.ranks, timeout=900, echo=True, record=False) as world:   # no trace: time the layer only
        for size in sizes:
            for res in throughput(world, size, reps, peer):
                out.extend(table_rows(size, res, args.ranks))
    print("\n   gloo alone = the same collectives, same sizes, no computation: what is gloo's.  The rest of 'ours'"
          " is computation (the experts' matmuls dominate) and waiting for the busiest rank: routing decides how"
          " many rows each rank's experts get, while one process splits every matmul evenly over its threads")
    out.append(sparse_scaling(args))
    return out


def rows(quick: bool = True, peer: bool = True) -> list[dict]:
    """The table's rows (``benchmarks/bench.py``): what the command line prints, as data."""
    return main((["--quick"] if quick else []) + ([] if peer else ["--no-peer"]))


if __name__ == "__main__":
    # Run as the module ``moe`` so that the ranks can import the rank functions by name.
    import importlib
    importlib.import_module("moe").main()
