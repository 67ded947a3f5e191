"""Run under torchrun: the reference functions work unchanged on the default group (gloo).

    torchrun --nproc-per-node 2 tests/workers/torchrun_check.py OUT_DIR
Each rank checks its results against torch.distributed's own collectives and writes OK or an error.
"""
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main(out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    r, w = dist.get_rank(), dist.get_world_size()
    from reference import collectives, trace
    assert not trace.is_recording()
    g = torch.Generator().manual_seed(r)
    x = torch.randn(11, 3, dtype=torch.float64, generator=g)
    want = x.clone()
    dist.all_reduce(want)
    got = collectives.ring_all_reduce(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # The same code on an explicit subgroup (all ranks).
    group = dist.new_group(list(range(w)), timeout=timedelta(seconds=60))
    torch.testing.assert_close(collectives.ring_all_reduce(x, group=group), want, rtol=1e-12, atol=1e-12)
    try:
        from reference import sequence
    except ImportError:
        sequence = None
    if sequence is not None and hasattr(sequence, "ring_attention"):
        B, H, S, D = 1, 2, 8 * w, 8
        gq = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64, generator=gq) for _ in range(3))
        full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        shard = lambda t: sequence.shard_sequence(t, r, w, "zigzag")  # noqa: E731
        out = sequence.ring_attention(shard(q), shard(k), shard(v), causal=True, layout="zigzag")
        torch.testing.assert_close(out, shard(full), rtol=1e-9, atol=1e-9)
    with open(os.path.join(out_dir, f"rank{r}.txt"), "w") as f:
        f.write(f"OK {w}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
