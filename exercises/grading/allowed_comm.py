"""Exercise worlds that offer only the communication an exercise is about.

Exercise 0.1 asks for an all-reduce *built from point-to-point messages*; calling the library's
all-reduce gives the right numbers without the work.  The grader therefore runs such exercises in
ranks where the other collectives are switched off — at every door torch offers:

* the dispatcher kernels of the ``c10d`` and functional-collective operators (``dist.all_reduce``,
  ``ProcessGroup.allreduce``, ``torch.ops._c10d_functional.all_reduce``, reloaded modules, sparse
  tensors: all of them end in these kernels) are replaced by one that raises
  ``RuntimeError("... not allowed in exercise 0.1 ...")``;
* the same methods of the C++ ``Backend`` classes (which skip the dispatcher) are removed;
* the rendezvous store's data methods and the store-based collectives are removed (in a world
  limited to point-to-point messages).

The replacement kernels are registered through a dispatcher library object that Python cannot
reach afterwards, so submitted code cannot undo them.  This is a *guard against substituting a
library collective*, not a sandbox: code that opens its own sockets or files can still move
tensors between ranks.  Points for *how* the work was done (bytes, neighbours) are therefore
feedback only, never points (``docs/teachers.md``).
"""
from __future__ import annotations

import ctypes
import warnings
from typing import Iterable

# operator names by family (torch 2.13); a name torch does not have is skipped
FAMILIES: dict[str, tuple[str, ...]] = {
    "p2p": ("c10d::send", "c10d::recv_", "c10d::recv_any_source_", "_c10d_functional::isend",
            "_c10d_functional::irecv", "_c10d_functional::batch_p2p_ops"),
    "all_reduce": ("c10d::allreduce_", "c10d::allreduce_coalesced_", "_c10d_functional::all_reduce",
                   "_c10d_functional::all_reduce_", "_c10d_functional::all_reduce_coalesced",
                   "_c10d_functional::all_reduce_coalesced_"),
    "all_gather": ("c10d::allgather_", "c10d::_allgather_base_", "c10d::allgather_coalesced_",
                   "c10d::allgather_into_tensor_coalesced_", "_c10d_functional::all_gather_into_tensor",
                   "_c10d_functional::all_gather_into_tensor_coalesced", "_c10d_functional::all_gather_into_tensor_out",
                   "_c10d_functional_autograd::all_gather_into_tensor"),
    "reduce_scatter": ("c10d::reduce_scatter_", "c10d::_reduce_scatter_base_", "c10d::reduce_scatter_tensor_coalesced_",
                       "_c10d_functional::reduce_scatter_tensor", "_c10d_functional::reduce_scatter_tensor_coalesced",
                       "_c10d_functional::reduce_scatter_tensor_out",
                       "_c10d_functional_autograd::reduce_scatter_tensor"),
    "all_to_all": ("c10d::alltoall_", "c10d::alltoall_base_", "_c10d_functional::all_to_all_single",
                   "_c10d_functional_autograd::all_to_all_single", "_dtensor::shard_dim_alltoall"),
    "broadcast": ("c10d::broadcast_", "_c10d_functional::broadcast", "_c10d_functional::broadcast_"),
    "rooted": ("c10d::reduce_", "c10d::gather_", "c10d::scatter_"),
}
# Backend methods (they call the C++ backend directly, skipping the dispatcher)
BACKEND_METHODS: dict[str, tuple[str, ...]] = {
    "p2p": ("send", "recv", "recv_anysource"),
    "all_reduce": ("allreduce", "allreduce_coalesced"),
    "all_gather": ("allgather", "_allgather_base", "allgather_coalesced"),
    "reduce_scatter": ("reduce_scatter", "_reduce_scatter_base"),
    "all_to_all": ("alltoall", "alltoall_base"),
    "broadcast": ("broadcast",),
    "rooted": ("reduce", "gather", "scatter"),
}
STORE_METHODS = ("set", "get", "add", "compare_set", "append", "multi_get", "multi_set", "queue_push",
                 "queue_pop", "check", "delete_key", "list_keys", "wait", "num_keys")
WHAT = {"p2p": "point-to-point messages (send/recv, comm.exchange)", "all_to_all": "the all-to-all",
        "all_reduce": "the all-reduce", "all_gather": "the all-gather", "reduce_scatter": "the reduce-scatter",
        "broadcast": "the broadcast"}

_installed: set[str] = set()


def _keys(op: str) -> list[str]:
    import torch
    dump = torch._C._dispatch_dump(op)
    keys = []
    for line in dump.splitlines():
        key, sep, rest = line.partition(": registered at")
        if sep and key not in ("Meta", "schema", "debug", "name"):
            keys.append(key.strip())
    return keys


def allow_only(allowed: Iterable[str], exercise: str) -> None:
    """Switch off every communication family not in ``allowed`` in this process (a rank).

    Idempotent; call it before the learner's module is imported.  ``barrier`` always stays.
    """
    import torch
    import torch.distributed  # noqa: F401  (registers the operators)
    allowed = set(allowed)
    if _installed:
        return
    _installed.update(allowed or {"-"})
    said = " and ".join(WHAT.get(a, a) for a in sorted(allowed)) or "no communication"
    denied = [f for f in FAMILIES if f not in allowed]

    def deny_kernel(op: str):
        short = op.split("::")[1].rstrip("_")

        def kernel(*args, **kwargs):
            raise RuntimeError(f"{short} is not allowed in exercise {exercise}: this exercise is to build the "
                               f"algorithm from {said} yourself, so the other collectives are switched off "
                               f"while it is graded.")
        return kernel

    schemas = {s.name for s in torch._C._jit_get_all_schemas()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fam in denied:
            for op in FAMILIES[fam]:
                if op not in schemas:
                    continue
                ns, name = op.split("::")
                frag = torch._C._dispatch_library("IMPL", ns, "")
                for key in _keys(op):
                    try:
                        frag.impl(name, key, deny_kernel(op))
                    except Exception:
                        pass
                _keep(frag)

    C = torch._C._distributed_c10d
    classes = [getattr(C, n) for n in dir(C) if isinstance(getattr(C, n), type)]
    for cls in classes:
        if issubclass(cls, C.Backend):
            for fam in denied:
                for m in BACKEND_METHODS.get(fam, ()):
                    if m in cls.__dict__:
                        delattr(cls, m)
    if True:   # a restricted world offers no rendezvous store to move data through either
        for cls in classes:
            if issubclass(cls, C.Store):
                for m in STORE_METHODS:
                    if m in cls.__dict__:
                        delattr(cls, m)
        if hasattr(C, "_StoreCollectives"):
            for m in [a for a in C._StoreCollectives.__dict__ if not a.startswith("_")]:
                delattr(C._StoreCollectives, m)


def _keep(obj) -> None:
    """Keep a dispatcher library fragment alive with no Python reference to it (so nothing can
    find it and deregister the kernels).  It is not tracked by the garbage collector."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
