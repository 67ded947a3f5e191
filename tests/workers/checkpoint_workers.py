"""Rank functions only the checkpoint tests use (tests/compose/test_checkpoint.py): refusals reported
back instead of raised (the kept-alive world survives them), and DTensor's chunks beside ours."""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from reference.compose import checkpoint, workers


def resume_errors(cases: list[dict], steps: int) -> list[tuple[str, str, float]]:
    """For each case {"dir": …, "sizes": …, **train_worker keywords}: resume it; (exception type, message,
    seconds) of the refusal, ("", "", seconds) if it resumed and trained.  Every rank runs every case."""
    out = []
    for case in cases:
        case = dict(case)
        directory, sizes = case.pop("dir"), case.pop("sizes")
        t0 = time.perf_counter()
        try:
            workers.train_worker(sizes, steps, checkpoint_dir=directory, resume=True, params="none", **case)
            out.append(("", "", time.perf_counter() - t0))
        except checkpoint.CheckpointError as e:
            out.append((type(e).__name__, str(e), time.perf_counter() - t0))
    return out


def dtensor_and_our_chunks() -> dict[str, tuple[list, list, bool]]:
    """On a world of W ranks (one tp group): for a column, a row and a padded-vocabulary cut, the chunks
    (offsets, sizes) DTensor hands DCP (``__create_write_items__`` of ``distribute_tensor(full, mesh,
    [Shard(d)])``), the chunks .checkpoint places for parallel_gpt's shard of that kind, and whether our
    views hold the same numbers as DTensor's local tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    W, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (W,))
    out = {}
    for kind, shape, dim in (("column", (32, 16), 0), ("row", (16, 32), 1), ("vocab", (27, 16), 0)):
        full = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
        dt = distribute_tensor(full, mesh, [Shard(dim)])
        theirs = [(tuple(w.tensor_data.chunk.offsets), tuple(w.tensor_data.chunk.sizes))
                  for w in dt.__create_write_items__(kind, dt) if w.tensor_data.chunk.sizes.numel()]
        if kind == "vocab":                        # parallel_gpt pads to a multiple of W with zero rows
            n = -(-shape[0] // W)
            padded = torch.cat([full, full.new_zeros(n * W - shape[0], shape[1])])
            local = padded[r * n:(r + 1) * n].clone()
        else:
            local = full.chunk(W, dim)[r].contiguous()
        pieces = checkpoint._pieces(kind, r, tuple(local.shape), shape, local.view(-1))
        ours = [(o, tuple(v.shape)) for o, v in pieces]
        same = len(pieces) == (1 if dt.to_local().numel() else 0) and all(
            torch.equal(v, dt.to_local()) for _, v in pieces)
        out[kind] = (theirs, ours, same)
    return out


def load_error(path: str, sizes: dict, config: dict) -> tuple[str, str]:
    """:func:`reference.compose.checkpoint.load` of ``path`` with its checksums not verified (what DCP
    alone does with a damaged file): (exception type, message) on this rank, ("", "") if it loaded."""
    from reference.compose import checkpoint_files
    model, _ = workers.build(sizes, **config)
    opt = workers.make_optimizer(model)
    state = checkpoint.grid_state(model, opt)
    meta = checkpoint.run_meta(model.cfg)
    verify = checkpoint_files._verify
    checkpoint_files._verify = lambda path, group: []          # as if the checksums were not there to catch it
    try:
        checkpoint.load(path, state, meta, checkpoint.expected_keys(model.cfg))
        return "", ""
    except checkpoint.CheckpointError as e:
        return type(e).__name__, str(e)
    finally:
        checkpoint_files._verify = verify
