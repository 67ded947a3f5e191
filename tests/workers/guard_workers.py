"""Rank functions for tests/grading/test_hostile.py: knock on every door to a library collective in a
world where the grader switched them off (exercises.grading.allowed_comm)."""
from __future__ import annotations

import gc
import importlib

import torch
import torch.distributed as dist

from reference import comm


def ring_doors(r: int, w: int) -> dict[str, str]:
    """The ring's checked kernels as a learner could try them: the wrong neighbour, another group."""
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001
            out[name] = str(e).splitlines()[0][:200]
    attempt("ring: backwards send", lambda: dist.isend(torch.ones(2), (r - 1) % w).wait())
    attempt("ring: recv from the next", lambda: dist.irecv(torch.empty(2), (r + 1) % w).wait())
    sub = dist.new_group([0, 1])                      # a group can still be made; messages on it cannot
    attempt("ring: subgroup", lambda: dist.isend(torch.ones(2), 1 - r, group=sub).wait() if r < 2 else None)
    return out


def doors(allowed: tuple[str, ...]) -> dict[str, str]:
    """Install the guard, then try each way to a collective; report what happened to each.
    Point-to-point messages (and, where allowed, the all-to-all) must still work."""
    from exercises.grading.allowed_comm import allow_only
    allow_only(allowed, "9.9", ring="p2p" in allowed)          # point-to-point: round the ring only
    r, w = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    t = torch.ones(3)
    out: dict[str, str] = {}
    if "p2p" in allowed:
        x, y = torch.full((2,), float(r)), torch.zeros(2)
        comm.exchange([(x, (r + 1) % w)], [(y, (r - 1) % w)]).wait()
        out["p2p"] = "ok" if y.tolist() == [float((r - 1) % w)] * 2 else f"wrong {y.tolist()}"
        out.update(ring_doors(r, w))
    if "all_to_all" in allowed:
        a, b = torch.full((w,), float(r)), torch.zeros(w)
        dist.all_to_all_single(b, a)
        out["a2a"] = "ok" if b.tolist() == [float(i) for i in range(w)] else f"wrong {b.tolist()}"

    def lib_destroy():
        for o in gc.get_objects():
            if isinstance(o, torch.library.Library):
                o._destroy()
        dist.all_reduce(t)

    tries = {
        "dist.all_reduce": lambda: dist.all_reduce(t),
        "sparse all_reduce": lambda: dist.all_reduce(t.to_sparse()),
        "dist.all_gather": lambda: dist.all_gather([torch.zeros(3) for _ in range(w)], t),
        "all_gather_object": lambda: dist.all_gather_object([None] * w, 1),
        "broadcast": lambda: dist.broadcast(t, 0),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.zeros(1), torch.ones(w)),
        "ProcessGroup.allreduce": lambda: pg.allreduce([t]).wait(),
        "functional all_reduce": lambda: torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(t, "sum", pg.group_name)),
        "Backend.allreduce": lambda: pg._get_backend(torch.device("cpu")).allreduce([t]).wait(),
        "store.set": lambda: dist.distributed_c10d._get_default_store().set("x", "1"),
        "Library._destroy": lib_destroy,
        "comm.all_reduce": lambda: comm.all_reduce(t),
    }
    if "all_to_all" not in allowed:
        tries["all_to_all"] = lambda: dist.all_to_all_single(torch.zeros(w), torch.ones(w))
    if "p2p" not in allowed:
        tries["send"] = lambda: dist.send(t, (r + 1) % w)
    # last: a reload replaces the module's state (the world is gone afterwards)
    tries["reloaded c10d"] = lambda: importlib.reload(
        importlib.import_module("torch.distributed.distributed_c10d")).all_reduce(t)
    for name, f in tries.items():
        try:
            f()
            out[name] = "RAN"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out
