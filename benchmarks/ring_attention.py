"""Ring attention on 2 ranks × 1 thread against one process with 2 threads, and against a CPU peer.

    .venv/bin/python benchmarks/ring_attention.py            # S = 4096 and 8192 (a few minutes)
    .venv/bin/python benchmarks/ring_attention.py --quick    # S = 4096, fewer repeats
    .venv/bin/python benchmarks/ring_attention.py --no-peer  # skip ring-attention-pytorch

Forward + backward, batch 1, 4 heads, head dim 64, float32, best of ``--repeats``:

* ``reference.sequence.ring_attention`` on 2 ranks (gloo, 1 torch thread each); causal uses the
  zigzag layout, non-causal the contiguous one;
* ``torch.nn.functional.scaled_dot_product_attention`` in this process with 2 threads — the same
  two cores, no communication: the bar to reach (ratio 1.0);
* ``ring-attention-pytorch==0.5.20`` (``ring_flash_attn`` with ``ring_reduce_col=True``;
  ``striped_ring_attn=True`` when causal, its load-balanced mode), 2 ranks × 1 thread.  It is
  installed on first use into ``benchmarks/.peers/`` (pip --target, never committed).

Also printed: how much of the ring's communication hides behind compute, from the trace of one
traced iteration: exposed = time a rank waited for a hop that both ends had posted, outside its
compute (:func:`exposed_comm`); alone = the same hops timed without compute; hidden = 1 − exposed / alone.

The ranks import this file as the module ``ring_attention`` (its directory is on ``sys.path``).
:func:`rows` returns the printed ratios (ring ÷ SDPA and ring ÷ peer as speeds, with how the time
grows with S) for ``benchmarks/bench.py``.
"""
from __future__ import annotations

import argparse
import os
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

PEER_PACKAGES = ["ring-attention-pytorch==0.5.20", "einops", "beartype", "jaxtyping", "wadler_lindig"]


# ----------------------------------------------------------------------------------------------
# Workers (run on every rank)


def _local_inputs(S, H, D, seed, layout_dims="bhsd"):
    W, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(seed * 1000 + r)
    shape = (1, H, S // W, D) if layout_dims == "bhsd" else (1, S // W, H, D)
    return [torch.randn(*shape, generator=g) for _ in range(4)]


def ring_bench_worker(S, H, D, layout, causal, repeats, seed=0):
    """Per-iteration seconds of forward+backward of reference ring attention on this rank."""
    from reference.sequence import ring_attention
    q, k, v, dout = _local_inputs(S, H, D, seed)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = ring_attention(qg, kg, vg, causal=causal, layout=layout)
        out.backward(dout)
        times.append(time.perf_counter() - t0)
    return times


def ring_comm_only_worker(S, H, D, repeats):
    """The ring's messages for one forward+backward, without the compute: seconds per iteration."""
    from reference import comm
    W = dist.get_world_size()
    nxt, prv = comm.ring_peers()
    k = torch.randn(1, H, S // W, D)
    bufs = [torch.empty_like(k) for _ in range(4)]
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for s in range(W - 1):                                    # forward K/V hops
            comm.exchange([(k, nxt), (k, nxt)], [(bufs[0], prv), (bufs[1], prv)], step=s).wait()
        for s in range(W - 1):                                    # backward K/V and dK/dV hops
            comm.exchange([(k, nxt), (k, nxt)], [(bufs[0], prv), (bufs[1], prv)], step=s).wait()
            comm.exchange([(k, nxt), (k, nxt)], [(bufs[2], prv), (bufs[3], prv)], step=s).wait()
        times.append(time.perf_counter() - t0)
    return times


def peer_bench_worker(S, H, D, causal, repeats, seed=0):
    """Per-iteration seconds of ring-attention-pytorch's ring_flash_attn, forward+backward."""
    peers.add_to_path()
    from ring_attention_pytorch import ring_flash_attn
    q, k, v, dout = _local_inputs(S, H, D, seed, layout_dims="bshd")
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = ring_flash_attn(qg, kg, vg, causal=causal, ring_reduce_col=True, striped_ring_attn=causal)
        out.backward(dout)
        times.append(time.perf_counter() - t0)
    return times


def peer_check_worker(S, H, D, causal):
    """The peer's output on a small problem, this rank's shard (striped when causal)."""
    peers.add_to_path()
    from ring_attention_pytorch import ring_flash_attn

    from reference.sequence import shard_sequence
    W, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, S, H, D, generator=g) for _ in range(3))
    q, k, v = (shard_sequence(peer_order(t, causal), r, W, "contiguous", dim=1) for t in (q, k, v))
    return ring_flash_attn(q, k, v, causal=causal, ring_reduce_col=True, striped_ring_attn=causal,
                           bucket_size=PEER_CHECK_BUCKET)


PEER_CHECK_BUCKET = 64


def peer_order(x, causal, inverse=False):
    """The token order the peer's striped mode expects before contiguous sharding (its
    ``'b (i j) d -> b (j i) d'`` with i = bucket size); identity when not causal."""
    if not causal:
        return x
    B, S, H, D = x.shape
    i, j = PEER_CHECK_BUCKET, S // PEER_CHECK_BUCKET
    if inverse:
        return x.reshape(B, j, i, H, D).transpose(1, 2).reshape(B, S, H, D)
    return x.reshape(B, i, j, H, D).transpose(1, 2).reshape(B, S, H, D)


# ----------------------------------------------------------------------------------------------
# Measurements (in this process)


def sdpa_seconds(S, H, D, causal, repeats, threads=2):
    import torch.nn.functional as F
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(1, H, S, D, generator=g) for _ in range(4))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal).backward(dout)
            times.append(time.perf_counter() - t0)
        return min(times)
    finally:
        torch.set_num_threads(old)


def best_over_ranks(values):
    """Each iteration takes as long as its slowest rank; return the best iteration."""
    return min(max(ts) for ts in zip(*values))


def exposed_comm(trace, rank):
    """Seconds rank ``rank`` waited for ring data that was really in transit while not computing.

    A hop's transit starts when both ends have posted it (the sender's ``send`` start, the
    receiver's ``recv`` start) and ends when the receiver's wait returned.  Time a rank waits
    because its peer is still busy computing (load imbalance, a noisy machine) is not counted:
    that is not communication.  Compute spans of the rank are subtracted.
    """
    posted = {(e.rank, e.peer, e.step, e.meta.get("phase"), e.meta.get("what")): e.start
              for e in trace.filter(op="send")}
    hops = []
    for e in trace.filter(op="recv", rank=rank):
        sent = posted.get((e.peer, rank, e.step, e.meta.get("phase"), e.meta.get("what")), e.start)
        hops.append((max(e.start, sent), e.end))
    comp = sorted((e.start, e.end) for e in trace.filter(op="compute", rank=rank))
    merged = []
    for a, b in sorted(hops):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    exposed = 0.0
    for a, b in merged:
        if b <= a:
            continue
        covered = sum(max(0.0, min(b, d) - max(a, c)) for c, d in comp)
        exposed += (b - a) - covered
    return exposed


def ensure_peer(install: bool) -> bool:
    return peers.ensure("ring_attention_pytorch", PEER_PACKAGES, install=install)


def main(argv=None) -> list[dict]:
    """Measure, print, and return the ratios as rows for ``benchmarks/bench.py``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="S = 4096 only, 2 repeats")
    ap.add_argument("--seq", type=int, nargs="*", default=None, help="sequence lengths (default 4096 8192)")
    ap.add_argument("--repeats", type=int, default=None, help="timed iterations (best is kept); default 3")
    ap.add_argument("--no-peer", action="store_true", help="do not run ring-attention-pytorch")
    args = ap.parse_args(argv)
    seqs = args.seq or ([4096] if args.quick else [4096, 8192])
    repeats = args.repeats or (2 if args.quick else 3)
    H, D, W = 4, 64, 2

    from reference.launch import World
    from reference.sequence import unshard_sequence
    peer = (not args.no_peer) and ensure_peer(install=True)

    print(f"ring attention benchmark: B=1, H={H}, D={D}, fp32, forward+backward, best of {repeats} "
          f"(+1 warm-up); ring on {W} ranks x 1 thread, SDPA in one process with {W} threads")
    result, last, peer_wrong = [], {}, None
    if not args.no_peer and not peer:
        result.append(dict(pair="ring attention vs ring-attention-pytorch",
                           error=f"peer missing: could not install {PEER_PACKAGES[0]}"))
    with World(W, timeout=600, echo=True) as world:
        if peer:  # the peer is a reference point only if it computes attention: check it once
            import math
            for causal in (False, True):
                S0 = 256
                vals = world.run(peer_check_worker, S0, H, 16, causal).values
                out = peer_order(unshard_sequence(vals, "contiguous", dim=1), causal, inverse=True)
                g = torch.Generator().manual_seed(1)
                q, k, v = (torch.randn(1, S0, H, 16, generator=g).transpose(1, 2) for _ in range(3))
                ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)
                err = (out - ref).abs().max().item()
                print(f"  peer check ({'causal' if causal else 'non-causal'}): max |peer - SDPA| = {err:.1e}")
                if not err < 1e-4 or math.isnan(err):
                    print("  the peer's result is wrong here; its timings are not comparable")
                    peer_wrong = f"the peer's output is wrong (max |peer - SDPA| = {err:.1e}): not comparable"
        for S in seqs:
            for causal in (True, False):
                layout = "zigzag" if causal else "contiguous"
                world.run(ring_bench_worker, S, H, D, layout, causal, 1)               # warm-up
                ring = best_over_ranks(world.run(ring_bench_worker, S, H, D, layout, causal, repeats).values)
                traced = world.run(ring_bench_worker, S, H, D, layout, causal, 1)
                alone = best_over_ranks(world.run(ring_comm_only_worker, S, H, D, repeats).values)
                exposed = max(exposed_comm(traced.trace, r) for r in range(W))
                hidden = max(0.0, 1.0 - exposed / alone) if alone > 0 else 1.0
                sdpa_seconds(S, H, D, causal, 1)
                sdpa = sdpa_seconds(S, H, D, causal, repeats)
                peer_s = None
                if peer:
                    world.run(peer_bench_worker, S, H, D, causal, 1)
                    peer_s = best_over_ranks(world.run(peer_bench_worker, S, H, D, causal, repeats).values)
                pr = f"{peer_s:7.3f} s  ring/peer {ring / peer_s:5.2f}" if peer_s else "   (peer skipped)"
                print(f"S={S:5d} {'causal    ' if causal else 'non-causal'} ({layout:10s}) ring {ring:7.3f} s   "
                      f"SDPA {sdpa:7.3f} s  ring/SDPA {ring / sdpa:5.2f}   peer {pr}   "
                      f"comm alone {alone * 1e3:6.1f} ms ({alone / ring:4.1%} of ring), exposed {exposed * 1e3:6.1f} "
                      f"ms, "
                      f"hidden {hidden:5.1%}",
                      flush=True)
                result.extend(_table_rows(S, causal, layout, ring, sdpa, peer_s, peer_wrong, last))
    print("\nnote: 'exposed' includes the last dK/dV hop, which no compute can hide, and on 2 ranks x 2 cores "
          "gloo's transport threads have no idle core to run on during compute")
    print("aims: ring/SDPA <= 1.2 causal, <= 1.1 non-causal (limit 1.0); ring/peer <= 0.5 causal")
    return result


def _table_rows(S, causal, layout, ring, sdpa, peer_s, peer_wrong, last) -> list[dict]:
    """One S's rows for the table: speeds ring ÷ SDPA and ring ÷ peer (the aims printed above, as
    speeds), with how the times grew since the previous S (``last``, updated here)."""
    kind = "causal" if causal else "non-causal"
    note = None
    if kind in last:
        S0, ring0, sdpa0 = last[kind]
        note = f"how the cost grows: S ×{S / S0:g} → ring ×{ring / ring0:.1f}, SDPA ×{sdpa / sdpa0:.1f}"
    last[kind] = S, ring, sdpa
    out = [dict(pair=f"ring attention {kind} ({layout}) S={S} vs SDPA (1 process, 2 threads)", ours=ring * 1e3,
                peer=sdpa * 1e3, unit="ms/fwd+bwd", ratio=sdpa / ring, aim=1 / 1.2 if causal else 1 / 1.1, note=note)]
    if peer_s is not None:
        pair = f"ring attention {kind} S={S} vs ring-attention-pytorch"
        out.append(dict(pair=pair, error=peer_wrong) if peer_wrong else
                   dict(pair=pair, ours=ring * 1e3, peer=peer_s * 1e3, unit="ms/fwd+bwd", ratio=peer_s / ring,
                        aim=2.0 if causal else None))
    return out


def rows(quick: bool = True, peer: bool = True) -> list[dict]:
    """The table's rows (``benchmarks/bench.py``): S = 1024, 2048, 4096 when quick (how the cost
    grows, cheaply), the command line's 4096 and 8192 otherwise."""
    return main((["--quick", "--seq", "1024", "2048", "4096"] if quick else []) + ([] if peer else ["--no-peer"]))


if __name__ == "__main__":
    # Run as the module ``ring_attention`` so that the ranks can import the workers by name.
    import importlib
    importlib.import_module("ring_attention").main()
