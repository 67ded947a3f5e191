"""The runner process: calls learner code for the grader and answers with ``torch.save`` bytes.

Started by :class:`exercises.grading.core.Runner`.  Requests (pickled by the trusted grader):

    ("local", "pkg.mod:harness", module, args)            -> {"value": ...}
    ("ranks", W, "pkg.mod:harness", module, args, tmo)    -> {"values": [...], "trace": [...], "output": str}

A harness is a grader-owned function ``harness(module, *args)`` that imports the learner module
and calls it; in "ranks" it runs on every rank of a ``reference.launch.World`` (kept per world
size, so a second call costs milliseconds).  Errors come back as ``{"error": {...}}``.
"""
from __future__ import annotations

import importlib
import io
import os
import pickle
import sys
import traceback
from multiprocessing import connection as mpc
from typing import Any


def _resolve(path: str):
    mod, _, name = path.partition(":")
    return getattr(importlib.import_module(mod), name)


def _plain(obj: Any) -> Any:
    """Make a value loadable with weights_only=True (tensors, numbers, strings, lists, dicts)."""
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone() if not obj.is_cuda else obj.detach().cpu()
    if isinstance(obj, (bool, int, float, str, type(None))):
        return obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(o) for o in obj) if isinstance(obj, list) else tuple(_plain(o) for o in obj)
    if isinstance(obj, dict):
        return {(k if isinstance(k, (str, int)) else str(k)): _plain(v) for k, v in obj.items()}
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _plain(getattr(obj, k)) for k in obj.__dataclass_fields__}
    return f"<{type(obj).__name__} not returned>"


def main(fd: int) -> None:
    import torch
    torch.set_num_threads(1)
    from reference.launch import World, WorldError

    conn = mpc.Connection(fd)
    worlds: dict[int, World] = {}

    def reply(obj: dict) -> None:
        buf = io.BytesIO()
        torch.save(_plain(obj), buf)
        conn.send_bytes(buf.getvalue())

    while True:
        try:
            req = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        try:
            if req[0] == "local":
                _, harness, module, args = req
                value = _resolve(harness)(module, *args)
                reply({"value": value})
            elif req[0] == "ranks":
                _, w, harness, module, args, tmo = req
                world = worlds.get(w)
                if world is None or not world.alive:
                    world = worlds[w] = World(w, timeout=tmo, echo=False)
                res = world.run(_resolve(harness), module, *args, timeout=tmo)
                reply({"values": res.values, "trace": [e.to_dict() for e in res.trace], "output": res.output[-4000:]})
            else:
                reply({"error": {"kind": "exception", "type": "ValueError", "message": f"unknown request {req[0]!r}"}})
        except WorldError as e:
            err: dict[str, Any] = {"kind": e.kind, "message": str(e).splitlines()[0]}
            if e.kind == "timeout":
                err["blocked"] = {r: f.blocked_in for r, f in e.failures.items()}
                err["timeout"] = float(req[5]) if req[0] == "ranks" else 0.0
            elif e.kind == "exception":
                r = min(e.failures)
                f = e.failures[r]
                err.update(type=f.exc_type, message=f.message.split(": ", 1)[-1], rank=r, traceback=f.traceback)
            else:
                err["message"] = "; ".join(f.message for f in e.failures.values())
            reply({"error": err})
        except BaseException as e:  # learner code raised (or called sys.exit) in this process
            reply({"error": {"kind": "exception", "type": type(e).__name__, "message": str(e),
                             "traceback": traceback.format_exc()}})
    for world in worlds.values():
        world.close()
    os._exit(0)
