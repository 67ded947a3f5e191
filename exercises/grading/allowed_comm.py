"""Exercise worlds that offer only the communication an exercise is about.

Exercise 0.1 asks for an all-reduce *built from point-to-point messages*; calling the library's
all-reduce gives the right numbers without the work.  The grader therefore runs such exercises in
ranks where the other collectives are switched off — at every door torch offers:

* the dispatcher kernels of the ``c10d`` and functional-collective operators (``dist.all_reduce``,
  ``ProcessGroup.allreduce``, ``torch.ops._c10d_functional.all_reduce``, reloaded modules, sparse
  tensors: all of them end in these kernels) are replaced by one that raises
  ``RuntimeError("... not allowed in exercise 0.1 ...")``;
* the same methods of the C++ ``Backend`` classes (which skip the dispatcher) are removed;
* the rendezvous store's data methods and the store-based collectives are removed.

Functional collectives (``torch.distributed._functional_collectives``, what DTensor, ``loss_parallel``
and ``torch.compile`` communicate through) are a family of their own: an exercise that offers the
plain all-reduce does not offer DTensor's.

Two finer rules, for families that have a *checked* kernel (the all-reduce and the broadcast): the
kernel looks, then calls the backend itself (through a method it took before removing it):

* ``limits={"all_reduce": n}``: an all-reduce of more than ``n`` elements is refused (4.3: a few
  numbers per token; an all-reduce of the whole vocabulary's logits is a gather in disguise);
* ``driver=("broadcast",)`` with ``driver_modules``: the family is refused to the learner's code
  but allowed to the given code that drives it (``DataParallel`` broadcasts the replicas' first
  parameters; ``ZeroRedundancyOptimizer`` broadcasting its shards from inside a learner's
  ``zero_step`` is refused).  Who calls is read from the Python stack: the first frame outside
  torch and the course's runtime (``reference/comm.py``, the rank program's wrappers); its code
  object must be one of the driver modules' own, taken when the guard is installed (a swapped
  ``__code__`` is not one of them).

The replacement kernels are registered through a dispatcher library object that Python cannot
reach afterwards; a checked kernel, its namespace and the backend method it calls are kept off the
garbage collector's lists, so submitted code finds no object that leads to an unchecked call.  This is a *guard
against substituting a library collective*, not a sandbox: code that opens its own sockets or files
can still move tensors between ranks (``docs/teachers.md``).
"""
from __future__ import annotations

import ctypes
import os
import sys
import types
import warnings
from collections.abc import Iterable, Mapping, Sequence

# operator names by family (torch 2.13); a name torch does not have is skipped
FAMILIES: dict[str, tuple[str, ...]] = {
    "p2p": ("c10d::send", "c10d::recv_", "c10d::recv_any_source_"),
    "all_reduce": ("c10d::allreduce_", "c10d::allreduce_coalesced_"),
    "all_gather": ("c10d::allgather_", "c10d::_allgather_base_", "c10d::allgather_coalesced_",
                   "c10d::allgather_into_tensor_coalesced_"),
    "reduce_scatter": ("c10d::reduce_scatter_", "c10d::_reduce_scatter_base_",
                       "c10d::reduce_scatter_tensor_coalesced_"),
    "all_to_all": ("c10d::alltoall_", "c10d::alltoall_base_"),
    "broadcast": ("c10d::broadcast_",),
    "rooted": ("c10d::reduce_", "c10d::gather_", "c10d::scatter_"),
    # what DTensor, loss_parallel, FSDP2's and torch.compile's collectives go through
    "functional": ("_c10d_functional::isend", "_c10d_functional::irecv", "_c10d_functional::batch_p2p_ops",
                   "_c10d_functional::all_reduce", "_c10d_functional::all_reduce_",
                   "_c10d_functional::all_reduce_coalesced", "_c10d_functional::all_reduce_coalesced_",
                   "_c10d_functional::all_gather_into_tensor", "_c10d_functional::all_gather_into_tensor_coalesced",
                   "_c10d_functional::all_gather_into_tensor_out", "_c10d_functional_autograd::all_gather_into_tensor",
                   "_c10d_functional::reduce_scatter_tensor", "_c10d_functional::reduce_scatter_tensor_coalesced",
                   "_c10d_functional::reduce_scatter_tensor_out", "_c10d_functional_autograd::reduce_scatter_tensor",
                   "_c10d_functional::all_to_all_single", "_c10d_functional_autograd::all_to_all_single",
                   "_dtensor::shard_dim_alltoall", "_c10d_functional::broadcast", "_c10d_functional::broadcast_"),
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
        "broadcast": "the broadcast", "functional": "functional collectives (DTensor's)"}
# families whose main operator has a checked kernel: (operator, Backend method it calls)
CHECKED = {"all_reduce": ("c10d::allreduce_", "allreduce"), "broadcast": ("c10d::broadcast_", "broadcast")}

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


def allow_only(allowed: Iterable[str], exercise: str, *, limits: Mapping[str, int] | None = None,
               driver: Sequence[str] = (), driver_modules: Sequence[str] = ()) -> None:
    """Switch off every communication family not in ``allowed`` in this process (a rank).

    ``limits`` caps the elements of one call of a checked family; ``driver`` lists families the
    code of ``driver_modules`` may use although the learner's may not (see the module docstring).
    Idempotent (the first call decides); call it before the learner's module is imported.
    ``barrier`` always stays.
    """
    import torch
    import torch.distributed  # noqa: F401  (registers the operators)
    allowed, limits, driver = set(allowed), dict(limits or {}), set(driver) - set(allowed)
    if _installed:
        return
    _installed.update(allowed or {"-"})
    bad = [f for f in list(limits) + list(driver) if f not in CHECKED]
    if bad:
        raise ValueError(f"no checked kernel for {bad}; limits and driver exemptions exist for {sorted(CHECKED)}")
    said = " and ".join(WHAT.get(a, a) for a in sorted(allowed)) or "no communication"

    def refusal(op: str, why: str = "") -> str:
        short = op.split("::")[1].rstrip("_")
        return (f"{short} is not allowed in exercise {exercise}: this exercise is to build the algorithm from "
                f"{said} yourself, so the other collectives are switched off while it is graded{why}.")

    def deny_kernel(op: str):
        message = refusal(op)

        def kernel(*args, **kwargs):
            raise RuntimeError(message)
        return kernel

    C = torch._C._distributed_c10d
    checked = {fam: _checked_kernel(fam, op, _take(C.Backend, method), limits.get(fam), fam in driver,
                                    _code_of(driver_modules), refusal)
               for fam, (op, method) in CHECKED.items() if fam in limits or fam in driver}
    schemas = {s.name for s in torch._C._jit_get_all_schemas()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fam, ops in FAMILIES.items():
            if fam in allowed and fam not in checked:
                continue
            for op in ops:
                if op not in schemas:
                    continue
                kernel = checked[fam] if fam in checked and op == CHECKED[fam][0] else deny_kernel(op)
                ns, name = op.split("::")
                frag = torch._C._dispatch_library("IMPL", ns, "")
                for key in _keys(op):
                    try:
                        frag.impl(name, key, kernel)
                    except Exception:
                        pass
                _keep(frag)

    classes = [getattr(C, n) for n in dir(C) if isinstance(getattr(C, n), type)]
    for cls in classes:
        if issubclass(cls, C.Backend):
            for fam in BACKEND_METHODS:
                if fam in allowed and fam not in checked:
                    continue
                for m in BACKEND_METHODS[fam]:
                    if m in cls.__dict__:
                        delattr(cls, m)
    # a restricted world offers no rendezvous store to move data through either
    for cls in classes:
        if issubclass(cls, C.Store):
            for m in STORE_METHODS:
                if m in cls.__dict__:
                    delattr(cls, m)
    if hasattr(C, "_StoreCollectives"):
        for m in [a for a in C._StoreCollectives.__dict__ if not a.startswith("_")]:
            delattr(C._StoreCollectives, m)


# ----------------------------------------------------------------------------------------------
# Checked kernels: look at the call, then run it on the backend directly


_CHECKED_SRC = """
def _is_driver():
    f = sys._getframe(3)
    while f is not None:
        name = os.path.abspath(f.f_code.co_filename)
        if not (name.startswith(TORCH_DIR) or name in SKIP_FILES):
            return f.f_code in DRIVER_CODE
        f = f.f_back
    return False


def kernel(tensors, process_group, *rest):
    if DRIVER_ONLY and not _is_driver():
        raise RuntimeError(REFUSED)
    n = sum(t.numel() for t in tensors)
    if LIMIT is not None and n > LIMIT:
        raise RuntimeError(OVER_LIMIT.format(n=n))
    backend = C.ProcessGroup.unbox(process_group)._get_backend(tensors[0].device)
    if FAMILY == "all_reduce":
        reduce_op, _sparse, _async, timeout = list(rest) + [None, None, True, -1][len(rest):]
        opts = C.AllreduceOptions()
        opts.reduceOp = C.ReduceOp(C.ReduceOp.RedOpType(reduce_op.op()))
    else:
        root_rank, root_tensor, _async, timeout = list(rest) + [0, 0, True, -1][len(rest):]
        opts = C.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root_rank, root_tensor
    if timeout is not None and timeout > 0:
        opts.timeout = datetime.timedelta(milliseconds=timeout)
    run = ctypes.cast(BACKEND_METHOD, ctypes.py_object).value
    return list(tensors), run(backend, list(tensors), opts).boxed()
"""


def _checked_kernel(family: str, op: str, backend_method: int, limit: int | None, driver_only: bool,
                    driver_code: frozenset, refusal):
    """The kernel of ``op``: refuse a call over ``limit`` elements, or (``driver_only``) one whose
    caller is not the given driver; otherwise run it on the tensors' backend.

    Made from source into a namespace of its own that only the dispatcher can reach: the function,
    its helper and their globals are off the garbage collector's lists and never freed, and the
    backend method it calls is held by address (``backend_method``), so no Python object a
    submission can find leads to the unchecked call."""
    import datetime

    import torch

    from reference import comm, launch, rank_program, trace
    runtime = {os.path.abspath(m.__file__) for m in (comm, launch, rank_program, trace)}
    g = {"__builtins__": __builtins__, "C": torch._C._distributed_c10d, "ctypes": ctypes, "datetime": datetime,
         "os": os, "sys": sys, "TORCH_DIR": os.path.dirname(os.path.abspath(torch.__file__)),
         "SKIP_FILES": frozenset(runtime | {os.path.abspath(__file__)}),
         "DRIVER_CODE": driver_code, "DRIVER_ONLY": driver_only, "LIMIT": limit, "FAMILY": family,
         "BACKEND_METHOD": backend_method, "REFUSED": refusal(op),
         "OVER_LIMIT": refusal(op, f"; an all-reduce here carries at most {limit} elements (yours: {{n}}): a few "
                                   "numbers per token, never the vocabulary's logits — gathering them through an "
                                   "all-reduce is a gather all the same")}
    exec(compile(_CHECKED_SRC, f"<grader: {op} checked in this exercise>", "exec"), g)
    for obj in (g["kernel"], g["_is_driver"], g):
        _keep(obj)
        _untrack(obj)
    return g["kernel"]


def _take(cls, name: str) -> int:
    """The address of ``cls.name`` (the C++ method itself), kept alive and off the garbage
    collector's lists; the caller then removes it from the class."""
    fn = cls.__dict__[name].__func__
    _keep(fn)
    _untrack(fn)
    return id(fn)


def _code_of(modules: Sequence[str]) -> frozenset:
    """Every code object defined in ``modules`` (functions, methods, nested functions)."""
    import importlib
    codes: set = set()

    def add(code) -> None:
        if code in codes:
            return
        codes.add(code)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                add(c)

    def visit(obj, owner: str, seen: set) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if isinstance(obj, property):
            for f in (obj.fget, obj.fset, obj.fdel):
                if f is not None:
                    visit(f, owner, seen)
            return
        if isinstance(obj, types.FunctionType) and obj.__module__ == owner:
            add(obj.__code__)
        elif isinstance(obj, type) and obj.__module__ == owner:
            for v in vars(obj).values():
                visit(v, owner, seen)

    for name in modules:
        mod = importlib.import_module(name)
        seen: set = set()
        for v in list(vars(mod).values()):
            visit(v, mod.__name__, seen)
    return frozenset(codes)


def _untrack(obj) -> None:
    """Take ``obj`` off the garbage collector's lists (``gc.get_objects``/``get_referrers`` no longer
    see it).  Only for objects that are never freed (:func:`_keep`): some types untrack themselves
    unconditionally when freed."""
    ctypes.pythonapi.PyObject_GC_UnTrack.argtypes = [ctypes.py_object]
    ctypes.pythonapi.PyObject_GC_UnTrack(obj)


def _keep(obj) -> None:
    """Keep ``obj`` alive for good with no Python reference to it (a dispatcher library fragment:
    so nothing can find it and deregister the kernels)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
