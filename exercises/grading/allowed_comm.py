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
# operators with a checked kernel: operator -> (family, the Backend method it calls)
CHECKED_OPS = {"c10d::allreduce_": ("all_reduce", "allreduce"), "c10d::broadcast_": ("broadcast", "broadcast"),
               "c10d::send": ("p2p", "send"), "c10d::recv_": ("p2p", "recv")}
CHECKED = sorted({fam for fam, _ in CHECKED_OPS.values()})

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
               driver: Sequence[str] = (), driver_modules: Sequence[str] = (), ring: bool = False,
               counted: Sequence[str] = (), referee_fd: int | None = None) -> None:
    """Switch off every communication family not in ``allowed`` in this process (a rank).

    ``limits`` caps the elements of one call of a checked family; ``driver`` lists families the
    code of ``driver_modules`` may use although the learner's may not (see the module docstring).
    ``ring``: point-to-point messages go round the world's ring only — a send to rank r+1, a
    receive from rank r−1 (mod W), on the world group — and every send waits for the grader's
    verdict on its size (``referee_fd``: :mod:`exercises.grading.referee`).  ``counted``: families
    whose every call is reported to the referee (3.2: when each bucket's all-reduce was posted).
    Idempotent (the first call decides); call it before the learner's module is imported.
    ``barrier`` always stays.
    """
    import torch
    import torch.distributed  # noqa: F401  (registers the operators)
    allowed, limits, driver = set(allowed), dict(limits or {}), set(driver) - set(allowed)
    counted = set(counted)
    if _installed:
        return
    _installed.update(allowed or {"-"})
    bad = [f for f in list(limits) + list(driver) + list(counted) if f not in CHECKED]
    if bad:
        raise ValueError(f"no checked kernel for {bad}; limits, counts and driver exemptions exist for {CHECKED}")
    if ring and "p2p" not in allowed:
        raise ValueError("ring=True rules point-to-point messages: allow 'p2p'")
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
    checked_families = {fam for fam in CHECKED if fam in limits or fam in driver or fam in counted
                        or (fam == "p2p" and ring)}
    driver_code = _code_of(driver_modules)
    checked = {op: _checked_kernel(op, fam, _take(C.Backend, method), limits.get(fam), fam in driver, driver_code,
                                   fam in counted, ring, referee_fd, exercise, refusal)
               for op, (fam, method) in CHECKED_OPS.items() if fam in checked_families}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fam, ops in FAMILIES.items():
            if fam in allowed and fam not in checked_families:
                continue
            for op in ops:
                if not torch._C._jit_get_schemas_for_operator(op):     # not in this torch
                    continue
                kernel = checked.get(op) or deny_kernel(op)
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
                if fam in allowed and fam not in checked_families:
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
    f = GETFRAME(3)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(TORCH_DIR) or name in SKIP_FILES):
            return f.f_code in DRIVER_CODE
        f = f.f_back
    return False


def _read(n):
    data = b""
    while len(data) < n:
        chunk = READ(REFEREE_FD, n - len(data))
        if not chunk:
            raise OSError("the referee is gone")
        data += chunk
    return data


def _tell(op, peer, n, nbytes, wait):
    # one frame to the grader's referee; a send waits for its verdict on the size
    if REFEREE_FD is None:
        return
    message = None
    with LOCK:
        try:
            WRITE(REFEREE_FD, PACK(op, peer, n, nbytes))
            if wait and _read(1) != OK:
                message = _read(UNPACK_LEN(_read(2))[0]).decode()
        except OSError:
            message = REFEREE_GONE
    if message is not None:
        raise RuntimeError(message)


def _elements(tensors):
    n = nbytes = 0
    for t in tensors:
        k = NUMEL(t)
        n += k
        nbytes += k * ELEMENT_SIZE(t)
    return n, nbytes


def kernel(tensors, process_group, *rest):
    tensors = list(tensors)
    pg = UNBOX(process_group)
    n, nbytes = _elements(tensors)
    if FAMILY == "p2p":
        peer, tag = rest[0], rest[1]
        if RING:
            if pg is not WORLD:
                raise RuntimeError(NOT_WORLD)
            if peer != (NEXT if SEND else PREV):
                backwards = peer == (PREV if SEND else NEXT)
                raise RuntimeError(WRONG_PEER.format(peer=peer, why=BACKWARDS if backwards else ""))
            if SEND:
                _tell(OP_SEND, peer, n, nbytes, True)
        backend = GET_BACKEND(pg, DEVICE(tensors[0]))
        run = CAST(BACKEND_METHOD, PY_OBJECT).value
        return BOXED(run(backend, tensors, peer, tag))
    if DRIVER_ONLY and not _is_driver():
        raise RuntimeError(REFUSED)
    if LIMIT is not None and n > LIMIT:
        raise RuntimeError(OVER_LIMIT.format(n=n))
    backend = GET_BACKEND(pg, DEVICE(tensors[0]))
    if FAMILY == "all_reduce":
        reduce_op, _sparse, _async, timeout = list(rest) + [None, None, True, -1][len(rest):]
        opts = ALLREDUCE_OPTIONS()
        opts.reduceOp = REDUCE_OP(RED_OP_TYPE(reduce_op.op()))
    else:
        root_rank, root_tensor, _async, timeout = list(rest) + [0, 0, True, -1][len(rest):]
        opts = BROADCAST_OPTIONS()
        opts.rootRank, opts.rootTensor = root_rank, root_tensor
    if timeout is not None and timeout > 0:
        opts.timeout = TIMEDELTA(milliseconds=timeout)
    if COUNT:
        _tell(OP_POST, -1, n, nbytes, False)
    run = CAST(BACKEND_METHOD, PY_OBJECT).value
    return tensors, BOXED(run(backend, tensors, opts))
"""


def _checked_kernel(op: str, family: str, backend_method: int, limit: int | None, driver_only: bool,
                    driver_code: frozenset, count: bool, ring: bool, referee_fd: int | None, exercise: str,
                    refusal):
    """The kernel of ``op``: refuse a call over ``limit`` elements, or (``driver_only``) one whose
    caller is not the given driver; for point-to-point messages under ``ring``, one to another
    rank than the ring's neighbour or on another group than the world's, and a send whose size the
    referee refuses; report a ``count``-ed call to the referee; otherwise run it on the backend.

    Made from source into a namespace of its own that only the dispatcher can reach: the function,
    its helpers and their globals are off the garbage collector's lists and never freed; what they
    call — builtins, tensor sizes, the backend lookup, the backend method itself (held by address,
    ``backend_method``) — was taken into that namespace here, so no Python object a submission can
    find or rebind leads to an unchecked call."""
    import _thread
    import builtins
    import ctypes
    import datetime
    import struct

    import torch
    import torch.distributed as dist

    from reference import comm, launch, rank_program, trace

    from . import referee
    C = torch._C._distributed_c10d
    runtime = set()
    for m in (comm, launch, rank_program, trace, sys.modules[__name__]):
        runtime |= {m.__file__, os.path.abspath(m.__file__)}
    world = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    me, size = (world.rank(), world.size()) if world is not None else (0, 1)
    short = op.split("::")[1].rstrip("_")
    g = {"__builtins__": dict(vars(builtins)),          # a copy: rebinding a builtin later changes nothing here
         "GETFRAME": sys._getframe, "TORCH_DIR": os.path.dirname(torch.__file__),
         "SKIP_FILES": frozenset(runtime), "DRIVER_CODE": driver_code, "DRIVER_ONLY": driver_only, "LIMIT": limit,
         "FAMILY": family, "COUNT": count, "RING": ring, "SEND": op == "c10d::send", "WORLD": world,
         "NEXT": (me + 1) % size, "PREV": (me - 1) % size,
         "BACKEND_METHOD": backend_method, "CAST": ctypes.cast, "PY_OBJECT": ctypes.py_object,
         "UNBOX": C.ProcessGroup.unbox, "GET_BACKEND": C.ProcessGroup._get_backend, "BOXED": C.Work.boxed,
         "DEVICE": torch._C.TensorBase.device.__get__, "NUMEL": torch._C.TensorBase.numel,
         "ELEMENT_SIZE": torch._C.TensorBase.element_size, "ALLREDUCE_OPTIONS": C.AllreduceOptions,
         "BROADCAST_OPTIONS": C.BroadcastOptions, "REDUCE_OP": C.ReduceOp, "RED_OP_TYPE": C.ReduceOp.RedOpType,
         "TIMEDELTA": datetime.timedelta, "LOCK": _thread.allocate_lock(),
         "REFEREE_FD": referee_fd, "READ": os.read, "WRITE": os.write, "PACK": referee.FRAME.pack,
         "UNPACK_LEN": struct.Struct("<H").unpack, "OK": referee.OK, "OP_SEND": referee.SEND,
         "OP_POST": referee.POST,
         "REFUSED": refusal(op),
         "REFEREE_GONE": f"{short} refused in exercise {exercise}: the grader's check of this message is gone "
                         "(the grading run was stopped).",
         "NOT_WORLD": f"{short} is allowed in exercise {exercise} only on the world's ring (group=None): a "
                      "message on another process group is refused while it is graded.",
         "WRONG_PEER": (f"{short} {'to' if op == 'c10d::send' else 'from'} rank {{peer}} is refused in exercise "
                        f"{exercise}: on this ring rank {me} sends only to rank {(me + 1) % size} (r+1) and "
                        f"receives only from rank {(me - 1) % size} (r−1) — comm.ring_peers() gives (next, "
                        "prev).{why} The exercise is the ring itself, so its messages are enforced while it is "
                        "graded."),
         "BACKWARDS": (" Sending to r−1 (or receiving from r+1) runs the ring the other way round: everything on "
                       "this ring travels from r to r+1."),
         "OVER_LIMIT": refusal(op, f"; an all-reduce here carries at most {limit} elements (yours: {{n}}): a few "
                                   "numbers per token, never the vocabulary's logits — gathering them through an "
                                   "all-reduce is a gather all the same")}
    exec(compile(_CHECKED_SRC, f"<grader: {op} checked in this exercise>", "exec"), g)
    for obj in (g["kernel"], g["_is_driver"], g["_tell"], g["_read"], g["_elements"], g["__builtins__"], g):
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
