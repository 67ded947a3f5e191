"""No given helper answers an exercise: a lint over what the graded functions lean on.

For every graded function (every function an exercise asks for, found from the registry, so new
exercises are covered as they are registered) the lint collects the given functions of the course
that could stand in for it:

* **what it calls** — every function or method of ``reference`` its body names, and what those
  name, transitively (through ungraded functions; a graded one is stripped in the release);
* **its neighbours** — every other function and method of its own module (a sibling written for
  another purpose often computes the same thing: ``gshard_random_routing`` next to ``top_k_gating``);
* **its siblings elsewhere** — functions of other modules that lean on two or more of the same
  helpers (``sync_the_rest`` does what ``sync_gradients`` does with the same three helpers), with
  their modules' neighbours.

Each candidate must then be one of: a graded function (stripped in the release, delegated while
grading), a *mirror* switched off in that exercise's runner (``exercise(..., mirrors=...)``), or on
the short allow-list below with a one-line reason.  The course's runtime (messages, traces, the
launcher) is what exercises are built from; it is not walked.
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest

from exercises.grading import core

# The runtime every exercise is built from: not walked, not candidates (what may be sent is enforced
# below Python by exercises/grading/allowed_comm.py; the trace records, it computes no answer).
RUNTIME = ("reference.comm", "reference.trace", "reference.launch", "reference.rank_program", "reference.saved",
           "reference.notebook", "reference.widgets")

# Given functions near an exercise that do NOT answer it, each with the reason (checked in review).
ALLOWED: dict[str, str] = {
    "reference.collectives:chunk_bounds": "where each chunk starts and stops: given with 0.1 and 0.2, no sum",
    "reference.data.ddp:DataParallel": "the driver of 3.2: its hooks call the learner's grad_ready/finish_buckets",
    "reference.data.ddp:Bucket": "a record of a bucket's parameters and its flat buffer; it computes nothing",
    "reference.data.zero:ZeroOptimizer": "the driver of 3.3: its step calls the learner's zero_step",
    "reference.data.zero:shard_size": "S = ceil(psi / N), given with 3.3: the size of a shard, not the step",
    "reference.data.fsdp:FullyShardedDataParallel": "the driver of 3.4: calls the learner's gather and reduce-scatter",
    "reference.data.fsdp:_Unit": "one FSDP unit of the 3.4 driver: its gather/reduce are the learner's 3.4 functions",
    "reference.pipeline.schedules:schedule": "the executor's lookup of every stage's order: calls the graded one",
    "reference.pipeline.schedules:_check": "rejects impossible (p, m, v) before any message; produces no order",
    "reference.pipeline.schedules:validate_actions": "checks that an order has one F and one B per micro-batch",
    "reference.pipeline.schedules:Action": "one step of a stage's order (a named tuple): the exercise's vocabulary",
    "reference.pipeline.schedules:virtual_stage": "the virtual stage a rank's chunk runs (loop or V): no order",
    "reference.pipeline.schedules:rank_of_stage": "the rank holding a virtual stage (the inverse): no order",
    "reference.pipeline.executor:Link": "a stage's wires to its neighbours, given with 4.5; recorded by the grader",
    "reference.pipeline.executor:_Postbox": "the messages behind Link; it moves tensors, computes no step",
    "reference.pipeline.executor:run_pipeline": "the driver of 4.4/4.5: runs the order by calling the graded steps",
    "reference.pipeline.executor:infer_shapes": "the driver's message shapes (one dry forward): no gradient",
    "reference.pipeline.executor:_check_inputs": "the driver's input checks (ValueError before any message)",
    "reference.pipeline.executor:_compute": "the driver's trace span around a step: records, computes nothing",
    "reference.sequence.blockwise:attention_block": "given with 5a.3/5a.5: one block's attention and lse, no ring",
    "reference.sequence.blockwise:attention_block_explicit": "the same block kernel written out (given, no ring)",
    "reference.sequence.blockwise:attention_block_backward": "given with 5a.5: one block's share of (dq, dk, dv)",
    "reference.sequence.blockwise:attention_block_backward_explicit": "the same block backward written out (given)",
    "reference.sequence.blockwise:_empty_block": "zeros and an lse of -inf: a block that saw no key",
    "reference.sequence.blockwise:block_kernels": "picks the fused or the explicit block kernel: no attention itself",
    "reference.sequence.blockwise:_measured": "the given kernels' trace decorator: records a block's pairs, no ring",
    "reference.sequence.blockwise:causal_pairs": "counts a block's unmasked pairs for the trace: no attention",
    "reference.sequence.ring:block_plan": "given with 5a.3/5a.5 (named in both): which rows of a block are computed",
    "reference.sequence.ring:Piece": "one kernel call of block_plan: slices and a flag, computes nothing",
    "reference.sequence.ring:tile_kind": "block_plan's per-chunk rule for the trace's tiles",
    "reference.sequence.ring:check_attention_inputs": "input checks raised before any message (ValueError)",
    "reference.sequence.ring:_check_backward_inputs": "the backward's input checks (ValueError before any message)",
    "reference.sequence.ring:_acc_dtype": "float32 or wider: the dtype the ring accumulates in",
    "reference.sequence.ring:ring_attention": "the autograd driver: its forward and backward are the graded functions",
    "reference.sequence.ring:_RingAttention": "ring_attention's autograd.Function: calls the graded forward/backward",
    "reference.sequence.layouts:check_layout@5a.3,5a.5": "rejects an unknown layout name (ValueError)",
    "reference.sequence.layouts:chunk_ids@5a.3,5a.5": "the chunks a rank holds, given to the ring exercises",
    "reference.moe.routing:expert_capacity": "C = ceil(k·cf·T/E), given with 5b.1 and 5b.3: a size, no routing",
    "reference.moe.routing:router_dtype": "float32 or the logits' dtype if wider, given with 5b.1",
    "reference.tensor.blocks:sync_sequence_parallel_grads": "lecture 4a's tp sum, a building block 5c.2's hints name",
}


# ----------------------------------------------------------------------------------------------
# The call graph of the reference, read from its source


def _reference_modules() -> list[types.ModuleType]:
    ref = importlib.import_module("reference")
    out = [ref]
    for info in pkgutil.walk_packages(ref.__path__, "reference."):
        if info.name.startswith(RUNTIME) or info.name.endswith(".lecture"):
            continue
        try:
            out.append(importlib.import_module(info.name))
        except Exception:          # a module under construction is not a helper yet
            continue
    return out


def _name(obj) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


def _given(obj) -> bool:
    mod = getattr(obj, "__module__", "") or ""
    return mod.startswith("reference.") and not mod.startswith(RUNTIME) and not mod.endswith(".lecture")


CONSTRUCTION = ("__new__", "__init__", "__post_init__", "__call__")


def _functions_of(obj, whole_class: bool = True) -> list:
    """The functions ``obj`` stands for: itself, or a class's own methods (``whole_class=False``:
    those that run when it is made or called)."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        return [f for f in (obj.fget, obj.fset) if f is not None]
    if isinstance(obj, types.FunctionType):
        return [inspect.unwrap(obj)]
    if isinstance(obj, type):
        out = []
        for k, v in vars(obj).items():
            if not isinstance(v, type) and (whole_class or k in CONSTRUCTION):
                out += [f for f in _functions_of(v) if isinstance(f, types.FunctionType)]
        return out
    return []


def _owner_class(fn):
    """The class a method belongs to (by its qualified name), or None."""
    parts = fn.__qualname__.split(".")
    if len(parts) < 2 or "<locals>" in parts:
        return None
    obj = importlib.import_module(fn.__module__)
    for p in parts[:-1]:
        obj = getattr(obj, p, None)
        if obj is None:
            return None
    return obj if isinstance(obj, type) else None


def references(fn) -> set:
    """The given functions ``fn``'s body names (called or handed on): names resolved in its module,
    attribute chains on modules and classes, ``self.x`` inside a method, a class as what makes it."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return set()
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) \
        else tree.body                      # the body only: annotations and decorators are not calls
    scope = dict(vars(importlib.import_module(fn.__module__)))
    owner = _owner_class(fn)
    found = set()

    def resolve(node):
        if isinstance(node, ast.Name):
            return scope.get(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") and owner is not None:
                return inspect.getattr_static(owner, node.attr, None)
            base = resolve(node.value)
            if isinstance(base, (types.ModuleType, type)):
                return inspect.getattr_static(base, node.attr, None)
        return None

    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, (ast.Name, ast.Attribute)):
            for f in _functions_of(resolve(node), whole_class=False):
                if _given(f) and f is not fn:
                    found.add(f)
    return found


# ----------------------------------------------------------------------------------------------
# Candidates per exercise


@functools.cache
def call_graph() -> tuple[dict, dict]:
    """({"module:qualname": function} of every given function, {name: the given functions it names})."""
    every = {}
    for mod in _reference_modules():
        for v in list(vars(mod).values()):
            for f in _functions_of(v):
                if _given(f) and f.__module__ == mod.__name__:
                    every[_name(f)] = f
    return every, {name: references(f) for name, f in every.items()}


def candidates(registry) -> dict[str, dict[str, str]]:
    """{exercise id: {"module:qualname": how it was reached}} of the given functions near each exercise."""
    graded = {inspect.unwrap(fn) for _, _, fn in core.graded_functions(registry)}
    every, calls = call_graph()
    out: dict[str, dict[str, str]] = {}
    for ex, _, fn in core.graded_functions(registry):
        fn = inspect.unwrap(fn)
        near = out.setdefault(ex.id, {})
        # what it calls, transitively through ungraded given functions
        frontier, seen = [fn], {fn}
        while frontier:
            f = frontier.pop()
            for g in calls.get(_name(f), references(f)):
                if g in seen or g in graded:
                    continue
                seen.add(g)
                near.setdefault(_name(g), f"called by {f.__qualname__}")
                frontier.append(g)
        helpers = {g for g in seen if g is not fn}
        # its neighbours, and siblings elsewhere that lean on two of the same helpers (or graded functions)
        leaned_on = {g for g in calls.get(_name(fn), set()) if g is not fn}
        sibling_modules = {fn.__module__}
        for name, g in every.items():
            if g in graded or g is fn or g in helpers:
                continue
            if len(calls[name] & leaned_on) >= 2:
                near.setdefault(name, f"leans on the same helpers as {fn.__qualname__}")
                sibling_modules.add(g.__module__)
        for name, g in every.items():
            if g.__module__ in sibling_modules and g not in graded and g is not fn:
                near.setdefault(name, f"a neighbour in {g.__module__}")
    return out


def unclosed(registry, unmirrored: frozenset = frozenset()) -> list[str]:
    """Candidates that are neither graded, nor a mirror of their exercise, nor allowed (the exercises
    in ``unmirrored`` counted without their mirrors: the lint is not vacuous)."""
    from exercises.grading.shortcuts import expand
    graded = {_name(inspect.unwrap(fn)) for _, _, fn in core.graded_functions(registry)}
    every, calls = call_graph()
    callers: dict[str, set[str]] = {}
    for name, called in calls.items():
        for g in called:
            callers.setdefault(_name(g), set()).add(name)

    def part_of_allowed(name: str, ex_id: str, seen: frozenset = frozenset()) -> bool:
        """A private helper (``_x``) that only allowed functions call (or private helpers of theirs):
        vouched for with them."""
        last = name.partition(":")[2].rsplit(".", 1)[-1]
        mine = callers.get(name, set()) - {name}
        return (last.startswith("_") and not last.startswith("__") and bool(mine) and name not in seen
                and all(allowed(c, ex_id) or part_of_allowed(c, ex_id, seen | {name}) for c in mine))

    bad = []
    for ex_id, near in candidates(registry).items():
        mirrors = set() if ex_id in unmirrored else {t for m in registry[ex_id].mirrors for t in expand(m)}
        for name, how in sorted(near.items()):
            if name in graded or name in mirrors or allowed(name, ex_id) or _generated(name) \
                    or part_of_allowed(name, ex_id):
                continue
            bad.append(f"{ex_id}: {name} ({how})")
    return bad


def allowed(name: str, ex_id: str) -> bool:
    """``name`` (or its class) is on the allow-list for every exercise, or for ``ex_id``."""
    mod, _, qual = name.partition(":")
    for key in (name, f"{mod}:{qual.rsplit('.', 1)[0]}" if "." in qual else None):
        if key is None:
            continue
        if key in ALLOWED:
            return True
        for entry in ALLOWED:
            base, _, scope = entry.partition("@")
            if scope and base == key and ex_id in scope.split(","):
                return True
    return False


def _generated(name: str) -> bool:
    """A method a dataclass or named tuple writes for itself (repr, eq, hash, its plain __init__):
    it computes nothing of an exercise."""
    qual = name.partition(":")[2]
    fn = call_graph()[0].get(name)
    written = getattr(getattr(fn, "__code__", None), "co_filename", "") == "<string>"   # dataclasses exec them
    return "__create_fn__" in qual or qual.rsplit(".", 1)[-1] in ("__repr__", "__str__", "__eq__", "__hash__",
                                                                  "__setattr__", "__delattr__") \
        or (written and qual.rsplit(".", 1)[-1] == "__init__")


# ----------------------------------------------------------------------------------------------
# The tests


@pytest.fixture(scope="module")
def registry():
    return core.load_checks()


def test_every_given_function_near_a_graded_one_is_stripped_mirrored_or_allowed_with_a_reason(registry):
    bad = unclosed(registry)
    assert not bad, ("given functions that could answer an exercise: make each a mirror switched off in that "
                     "exercise (exercise(..., mirrors=...)), move it into the graded function, or allow it in "
                     "tests/grading/test_given_helpers.py with a one-line reason:\n  " + "\n  ".join(bad))


def test_the_allow_list_is_short_and_every_entry_says_why_and_still_exists(registry):
    assert len(ALLOWED) <= 40, "the allow-list is for a few harmless helpers; mirror the rest"
    for entry, why in ALLOWED.items():
        assert len(why) > 20 and "\n" not in why, entry
        name, _, scope = entry.partition("@")
        assert all(ex in registry for ex in scope.split(",") if scope), entry
        mod, _, qual = name.partition(":")
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part, None)
            assert obj is not None, f"{name} is allowed but no longer exists"


ROUND_THREE = [("5b.3", "reference.moe.parallel:_dispatch_rows"), ("5b.3", "reference.moe.parallel:_combine_rows"),
               ("5b.1", "reference.moe.routing:gshard_random_routing"),
               ("5a.2", "reference.sequence.layouts:positions"),
               ("5a.2", "reference.sequence.layouts:chunk_ids"), ("5c.1", "reference.mesh:RankGrid.coords"),
               ("5c.1", "reference.mesh:RankGrid.rank_of"), ("5c.2", "reference.compose.overlap:sync_the_rest"),
               ("5c.2", "reference.compose.overlap:OverlappedGradSync.__init__")]


def test_without_their_mirrors_the_lint_names_the_helpers_of_the_round_three_attacks(registry):
    """Not vacuous: with those exercises' mirrors taken away, each helper an attack leaned on is a finding."""
    bad = "\n".join(unclosed(registry, unmirrored=frozenset(ex for ex, _ in ROUND_THREE)))
    for ex_id, helper in ROUND_THREE:
        assert f"{ex_id}: {helper} " in bad, (ex_id, helper)


def test_without_their_mirrors_the_lint_names_lecture_6s_given_step_and_the_dataclass_init_is_not_a_finding(
        registry):
    """6.3's given step (the buggy one, a neighbour of the graded fix) is a finding once 6.3's mirrors are taken
    away; 6.2's answer type, whose __init__ a dataclass wrote, is not."""
    bad = "\n".join(unclosed(registry, unmirrored=frozenset({"6.2", "6.3"})))
    assert "6.3: reference.debug.accumulate:accumulate_gradients_given " in bad
    assert "Divergence.__init__" not in bad
