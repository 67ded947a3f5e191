"""Running a schedule on real ranks: one training step of a pipeline (rank = stage).

Every rank calls :func:`run_pipeline` with its own model chunk(s) and the same batch.  It computes
the whole schedule (a pure function, :mod:`.schedules`), checks everything, then walks its own
list of actions::

    for action in schedule[rank]:           F: forward_step   B: backward_step   W: weight half (zb)
        wait for its input message           activation from the stage before / gradient from the one after
        compute (one traced "compute" span)  and post the output message to the next / previous stage

Per micro-batch the wires are simple (stage k = virtual stage; shapes for a model of width d)::

    stage k-1 ──activation (b/m, d)──▶ stage k ──activation──▶ stage k+1
    stage k-1 ◀──gradient (b/m, d)──── stage k ◀──gradient──── stage k+1

and :func:`forward_step` / :func:`backward_step` (exercise 4.5) are one stage's part of it, through
a :class:`Link` that hides ranks and buffers.

Why it cannot deadlock on gloo (for any order :func:`.schedules.simulate` can finish): sends are
posted non-blocking (``comm.exchange``) and never waited for on the way; a rank only ever blocks on
a message it needs next. Two ranks can exchange several kinds of message (with interleaving,
activations and gradients both go 0 → 1), and gloo matches messages between a pair first-in,
first-out — so a receiver posts its receives in the order the *sender* sends them (it knows the
sender's whole schedule). It posts them all at once, the first time it waits for that sender (it
would be idle anyway): every later message then lands straight in its buffer while the receiver
computes, and posting a receive — a message of its own to the sender on gloo, ~0.1 ms on a shared
2-core machine — no longer sits between two of its actions (what lifts 1F1B past torch's speed in
the full course's ``benchmarks/pipeline.py``). The price: one buffer per message of the step, (b/m, d) each, allocated
up front — small next to the stash, whose bound is unchanged. The activation sent for micro-batch i
is known to be delivered once i's gradient is back, and is confirmed then; the other sends at the
end of the step.

Loss and gradients: the last stage's loss for micro-batch i is ``loss_fn(out_i, target_i) / m``;
their sum is the full-batch mean (micro-batches are equal), and gradients accumulate in ``.grad``
exactly as one process's full-batch ``loss.backward()`` would leave them (not m× too large).

Trace (``reference.trace``), one event per block of work and per message:

    compute  step=i  meta: what="F"|"B"|"W", stage=<virtual stage>, microbatch=i, chunk=c,
             stashed=<micro-batches (per chunk) whose activations this rank holds after it>
    send     peer=<global rank>, nbytes, step=i  meta: what="activation"|"gradient", microbatch=i,
    recv     chunk=<this rank's chunk>, stage=<this rank's virtual stage>, peer_stage=<the other end's>

A send spans from its posting (right after the F or B that made it) to its confirmation (lazy);
a recv from its posting (possibly early) to the moment its data was in hand: draw a message from
send.start to recv.end.  The shape hand-shake of :func:`infer_shapes` is traced as send/recv with
``what="shape"`` (and ``stage``, ``peer_stage``).  Nothing is recorded when nothing records.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from .. import comm, trace
from .schedules import Action, schedule, simulate, validate_actions

__all__ = ["Link", "forward_step", "backward_step", "backward_input_step", "backward_weight_step",
           "infer_shapes", "run_pipeline", "actions_from_trace", "peak_stashed_from_trace", "wall_clock_bubble"]


class Link:
    """The wires of one stage (one model chunk on this rank).

    stage: its virtual stage (chunk·p + rank); is_first / is_last: no stage before / after it.
    ``recv_activation(i)`` returns micro-batch i's input from the stage before (a fresh tensor);
    ``send_activation(t, i)`` posts this stage's output to the stage after; ``recv_gradient(i)``
    / ``send_gradient(t, i)`` the same backwards.  Sends return at once.
    """

    def __init__(self, postbox: _Postbox, chunk: int):
        self._box, self.chunk = postbox, chunk
        self.stage = chunk * postbox.p + postbox.rank
        self.is_first, self.is_last = self.stage == 0, self.stage == postbox.K - 1

    def recv_activation(self, microbatch: int) -> torch.Tensor:
        return self._box.take(("activation", microbatch, self.stage))

    def send_activation(self, tensor: torch.Tensor, microbatch: int) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"stage {self.stage}: send_activation(…, {microbatch}) got {type(tensor).__name__}, not "
                            "a tensor: send this stage's output for the micro-batch (detached).")
        self._box.post(("activation", microbatch, self.stage + 1), tensor, self)

    def recv_gradient(self, microbatch: int) -> torch.Tensor:
        return self._box.take(("gradient", microbatch, self.stage))

    def send_gradient(self, tensor: torch.Tensor, microbatch: int) -> None:
        if tensor is None:
            raise TypeError(f"stage {self.stage}: send_gradient(None, {microbatch}): the gradient of this stage's "
                            "input is None. Likely cause: the activation received in forward_step was not made a "
                            "leaf that requires grad (x = link.recv_activation(i).requires_grad_()), so backward "
                            "never computed its gradient.")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"stage {self.stage}: send_gradient(…, {microbatch}) got {type(tensor).__name__}, not "
                            "a tensor: send the gradient of this stage's input.")
        self._box.post(("gradient", microbatch, self.stage - 1), tensor, self)


# ----------------------------------------------------------------------------------------------
# One stage, one micro-batch (exercise 4.5)


def forward_step(module: nn.Module, microbatch: int, link: Link, stash: dict, *, inputs: torch.Tensor | None = None,
                 target: torch.Tensor | None = None, loss_fn: Callable | None = None,
                 num_microbatches: int = 1) -> torch.Tensor | None:
    """F of one micro-batch on one stage.

    x = ``inputs`` (first stage: this micro-batch's rows, (b/m, …)) or the activation received
    from the stage before (made a leaf that requires grad, so backward yields its gradient);
    y = module(x).  Last stage: loss = loss_fn(y, target) / num_microbatches, stash (x, loss),
    return loss.detach().  Other stages: send y (detached) to the next stage, stash (x, y),
    return None.  ``stash`` maps micro-batch → what :func:`backward_step` needs.

    Graded on: the loss and every gradient of real pipelines (GPipe, 1F1B) equal to one process's, and the messages
    your steps send, recorded by the grader's own Link.
    """
    x = inputs if link.is_first else link.recv_activation(microbatch).requires_grad_()
    y = module(x)
    if link.is_last:
        loss = loss_fn(y, target) / num_microbatches
        stash[microbatch] = (x, loss)
        return loss.detach()
    link.send_activation(y.detach(), microbatch)
    stash[microbatch] = (x, y)
    return None


def backward_step(microbatch: int, link: Link, stash: dict) -> None:
    """B of one micro-batch on one stage: take (x, y) out of the stash (freeing it), backprop the
    gradient received from the next stage (last stage: y is the loss, its own gradient is 1) —
    parameters' ``.grad`` accumulate — and send x's gradient to the stage before (if any).

    Graded on: the loss and every gradient of real pipelines (GPipe, 1F1B) equal to one process's, and the messages
    your steps send, recorded by the grader's own Link.
    """
    x, y = stash.pop(microbatch)
    dy = None if link.is_last else link.recv_gradient(microbatch)
    torch.autograd.backward(y, dy)
    if not link.is_first:
        link.send_gradient(x.grad, microbatch)


@contextmanager
def _layer_outputs(module: nn.Module):
    """Collect (layer, output) for every sub-module with parameters of its own, during a forward."""
    seen: list[tuple[nn.Module, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda m, i, out: seen.append((m, out)))
             for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def backward_input_step(microbatch: int, link: Link, stash: dict, layer_outputs: list) -> None:
    """Zero-bubble B: only the gradients of the stage input and of each layer's output (for the
    W later), keeping the graph; sends the input gradient.  The stash entry becomes W's inputs."""
    x, y = stash.pop(microbatch)
    dy = None if link.is_last else link.recv_gradient(microbatch)
    wrt = ([x] if x.requires_grad else []) + [out for _, out in layer_outputs]
    grads = list(torch.autograd.grad(y, wrt, dy, retain_graph=True, allow_unused=True)) if wrt else []
    if x.requires_grad:
        link.send_gradient(grads.pop(0), microbatch)
    stash[microbatch] = [(m, out, g) for (m, out), g in zip(layer_outputs, grads) if g is not None]


def backward_weight_step(microbatch: int, stash: dict) -> None:
    """Zero-bubble W: each layer's weight gradient from its output gradient (kept by B), one layer
    at a time (``inputs=`` its own parameters; a weight tied across layers of a stage would count twice)."""
    for module, out, grad in stash.pop(microbatch):
        torch.autograd.backward(out, grad, inputs=list(module.parameters(recurse=False)))


# ----------------------------------------------------------------------------------------------
# Messages between stages


class _Postbox:
    """This rank's messages.  A message is keyed ``(what, microbatch, receiving virtual stage)``."""

    def __init__(self, plan: Sequence[Sequence[Action]], virtual_stages: int, shapes: dict, group):
        self.group, self.p, self.rank = group, len(plan), comm.rank(group)
        self.K, self.shapes = self.p * virtual_stages, shapes
        self.incoming: dict[int, list] = {q: [] for q in range(self.p)}   # per sender, in its send order
        for q, actions in enumerate(plan):
            for a in actions:
                k = a.chunk * self.p + q
                key = (("activation", a.microbatch, k + 1) if a.kind == "F" and k < self.K - 1 else
                       ("gradient", a.microbatch, k - 1) if a.kind == "B" and k > 0 else None)
                if key and key[2] % self.p == self.rank and q != self.rank:
                    self.incoming[q].append(key)
        self.sender = {key: q for q, keys in self.incoming.items() for key in keys}
        self.listening: set[int] = set()           # senders whose receives are all posted
        self.receiving: dict[tuple, Any] = {}     # key -> comm.Pending, for receives and sends in flight
        self.sending: dict[tuple, Any] = {}
        self.arrived: dict[tuple, torch.Tensor] = {}
        self.local: dict[tuple, torch.Tensor] = {}   # messages to itself (one rank, several chunks)

    def _peer(self, stage: int) -> int:
        return comm.global_rank(self.group, stage % self.p)

    def post(self, key: tuple, tensor: torch.Tensor, link: Link) -> None:
        what, i, to = key
        if to % self.p == self.rank:
            self.local[key] = tensor
            return
        self.sending[key] = comm.exchange([(tensor, self._peer(to))], [], group=self.group, step=i, what=what,
                                          microbatch=i, chunk=link.chunk, stage=link.stage, peer_stage=to)

    def _post_receives(self, q: int) -> None:
        """Post the receives of all of sender q's messages of the step, in its send order."""
        for k in self.incoming[q]:
            what, i, at = k
            shape, dtype = self.shapes[at][0 if what == "activation" else 1]
            other = at - 1 if what == "activation" else at + 1
            self.receiving[k] = comm.exchange([], [(torch.empty(shape, dtype=dtype), self._peer(other))],
                                              group=self.group, step=i, what=what, microbatch=i, chunk=at // self.p,
                                              stage=at, peer_stage=other)
        self.listening.add(q)

    def wait_for(self, key: tuple) -> None:
        """Block until message ``key`` is here.  The first time this rank needs a message from a
        sender, it posts the receives of all that sender's messages of the step at once (see the
        module docstring: it would be idle anyway, and later messages land while it computes)."""
        if key in self.arrived or key in self.local:
            return
        if key not in self.sender:
            raise RuntimeError(f"stage {key[2]} needs the {key[0]} of micro-batch {key[1]}, but no stage sends it")
        if self.sender[key] not in self.listening:
            self._post_receives(self.sender[key])
        self.arrived[key] = self.receiving.pop(key).wait()[0]
        if key[0] == "gradient":                    # i's gradient is back: its activation was delivered
            sent = self.sending.pop(("activation", key[1], key[2] + 1), None)
            if sent is not None:
                sent.wait()

    def take(self, key: tuple) -> torch.Tensor:
        if key in self.local:
            return self.local.pop(key)
        self.wait_for(key)
        return self.arrived.pop(key)

    def flush(self) -> None:
        """Confirm every send still in flight (each receiver posts its receive eventually)."""
        for pending in self.sending.values():
            pending.wait()
        self.sending.clear()


_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32)


def _output_shape(module: nn.Module, shape: tuple, dtype: torch.dtype) -> tuple[tuple, torch.dtype]:
    """Shape and dtype of ``module``'s output for an input of ``shape``: a dry run on zeros, without
    autograd and in eval mode (no dropout draws, no BatchNorm statistics updated)."""
    training = module.training
    try:
        with torch.no_grad():
            y = module.eval()(torch.zeros(shape, dtype=dtype))
    finally:
        module.train(training)
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"a pipeline stage must return one tensor, got {type(y).__name__}")
    return tuple(y.shape), y.dtype


def infer_shapes(chunks: Sequence[nn.Module], microbatch_shape: tuple, dtype: torch.dtype, *,
                 group=None) -> dict[int, tuple[tuple, tuple]]:
    """``{virtual stage k: ((input shape, dtype), (output shape, dtype))}`` of this rank's chunks.

    A rank knows only its own layers, so each stage runs its chunk once on zeros of its input
    shape and sends its output shape on to the next (one small message per boundary, traced with
    ``what="shape"``; torch.distributed.pipelining does the same at its first step).  The result
    holds for every step with the same micro-batch shape: pass it to :func:`run_pipeline`'s ``shapes=``."""
    p, r = comm.world_size(group), comm.rank(group)
    K, out = p * len(chunks), {}
    shape, dt = tuple(microbatch_shape), dtype
    for c, module in enumerate(chunks):
        k = c * p + r
        if k > 0 and p > 1:
            msg = comm.recv(torch.zeros(10, dtype=torch.int64), comm.global_rank(group, (k - 1) % p), group=group,
                            what="shape", stage=k, peer_stage=k - 1)
            shape, dt = tuple(msg[1:1 + msg[0]].tolist()), _DTYPES[int(msg[9])]
        y_shape, y_dt = _output_shape(module, shape, dt)
        out[k] = ((shape, dt), (y_shape, y_dt))
        shape, dt = y_shape, y_dt
        if k < K - 1 and p > 1:
            if len(y_shape) > 8 or y_dt not in _DTYPES:
                raise ValueError(f"stage {k} outputs shape {y_shape} of {y_dt}: at most 8 dimensions of {_DTYPES}")
            msg = torch.tensor([len(y_shape), *y_shape] + [0] * (8 - len(y_shape)) + [_DTYPES.index(y_dt)])
            comm.send(msg, comm.global_rank(group, (k + 1) % p), group=group, what="shape", stage=k, peer_stage=k + 1)
    return out


# ----------------------------------------------------------------------------------------------
# The step


def _check_inputs(chunks, v, inputs, targets, loss_fn, m) -> None:
    if len(chunks) != v or not all(isinstance(c, nn.Module) for c in chunks):
        raise ValueError(f"stage_modules must be this rank's {v} model chunk(s) (virtual_stages={v})")
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor) or inputs.dim() < 1:
        raise ValueError("inputs and targets must be tensors with a batch dimension first (every rank passes them)")
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"inputs has {inputs.shape[0]} rows but targets has {targets.shape[0]}")
    if inputs.shape[0] % m:
        raise ValueError(f"the batch ({inputs.shape[0]} rows) must divide into num_microbatches={m} equal parts")
    if not callable(loss_fn):
        raise ValueError("loss_fn must be callable: loss_fn(output, target) -> mean loss of a micro-batch")


def run_pipeline(stage_modules: nn.Module | Sequence[nn.Module], schedule_name: str, inputs: torch.Tensor,
                 targets: torch.Tensor, loss_fn: Callable, *, num_microbatches: int, virtual_stages: int = 1,
                 group=None, actions: Sequence[Sequence[Action]] | None = None, check: bool = True,
                 shapes: dict | None = None, link_class: type[Link] = Link) -> torch.Tensor | None:
    """One forward + backward of the batch through the pipeline; call on every rank of ``group``.

    stage_modules:  this rank's chunk, or the list of its ``virtual_stages`` chunks (chunk c = stage c·p + rank)
    inputs (b, …), targets (b, …): the whole batch, the same on every rank (the first stage reads
                    inputs, the last reads targets; every rank checks them); b divisible by m
    loss_fn(output, target): the mean loss of one micro-batch (e.g. ``F.mse_loss``)
    actions:        an order of your own (one list per stage, like :func:`.schedules.schedule`) instead of
                    ``schedule_name``; checked with ``simulate`` unless ``check=False`` (then a bad order hangs
                    until the world's timeout, which names the blocked ranks)
    shapes:         from :func:`infer_shapes` (skips the hand-shake)
    link_class:     the class of each chunk's wires (the grader passes a :class:`Link` that records
                    what each stage sends and receives)

    Raises ValueError on every rank, before any message, for any bad argument.  Adds the gradient
    of the full-batch mean loss to every parameter's ``.grad`` (zero them first, as for
    ``loss.backward()``).  Returns the loss (a 0-dim tensor) on the rank of the last stage, None
    elsewhere.
    """
    p, rank, m, v = comm.world_size(group), comm.rank(group), num_microbatches, virtual_stages
    if actions is None:
        plan = schedule(schedule_name, p, m, virtual_stages=v)
    else:
        plan = [[Action(*a) for a in stage] for stage in actions]
        if len(plan) != p:
            raise ValueError(f"actions must hold one list per stage ({p}), got {len(plan)}")
        validate_actions(plan, m, v)
        if check:
            simulate(plan)
    chunks = [stage_modules] if isinstance(stage_modules, nn.Module) else list(stage_modules)
    _check_inputs(chunks, v, inputs, targets, loss_fn, m)
    xs, ts = inputs.tensor_split(m), targets.tensor_split(m)
    if shapes is None:
        shapes = infer_shapes(chunks, tuple(xs[0].shape), inputs.dtype, group=group)
    box = _Postbox(plan, v, shapes, group)
    links = [link_class(box, c) for c in range(v)]
    stashes: list[dict] = [{} for _ in range(v)]
    split = any(a.kind == "W" for a in plan[rank])
    layer_outputs: dict[tuple[int, int], list] = {}
    loss = None
    for a in plan[rank]:
        link, i, c = links[a.chunk], a.microbatch, a.chunk
        if a.kind == "F" and not link.is_first:                # wait outside the compute span
            box.wait_for(("activation", i, link.stage))
        elif a.kind == "B" and not link.is_last:
            box.wait_for(("gradient", i, link.stage))
        with _compute(step=i, what=a.kind, stage=link.stage, microbatch=i, chunk=c) as meta:
            if a.kind == "F":
                with _layer_outputs(chunks[c]) if split else nullcontext() as outs:
                    li = forward_step(chunks[c], i, link, stashes[c], inputs=xs[i] if link.is_first else None,
                                      target=ts[i] if link.is_last else None, loss_fn=loss_fn, num_microbatches=m)
                if split:
                    layer_outputs[(c, i)] = outs
                loss = li if loss is None else (loss if li is None else loss + li)
            elif a.kind == "B" and split:
                backward_input_step(i, link, stashes[c], layer_outputs.pop((c, i)))
            elif a.kind == "B":
                backward_step(i, link, stashes[c])
            else:
                backward_weight_step(i, stashes[c])
            meta["stashed"] = sum(len(s) for s in stashes)
    box.flush()
    return loss if rank == (p * v - 1) % p else None


@contextmanager
def _compute(**meta):
    """``trace.span("compute", …)`` while recording, else nothing (a span's status line costs ~10 %)."""
    if not trace.is_recording():
        yield meta
        return
    with trace.span("compute", **meta) as m:
        yield m


# ----------------------------------------------------------------------------------------------
# Reading a run back from its trace


def actions_from_trace(events, num_stages: int | None = None) -> list[list[Action]]:
    """Per rank, the actions its compute events ran, in time order (rank = position in the list)."""
    compute = [e for e in events if e.op == "compute" and "microbatch" in e.meta]
    ranks = sorted({e.rank for e in compute})
    n = num_stages if num_stages is not None else (max(ranks) + 1 if ranks else 0)
    out: list[list[Action]] = [[] for _ in range(n)]
    for e in sorted(compute, key=lambda e: (e.start, e.end)):
        out[e.rank].append(Action(e.meta["what"], e.meta["microbatch"], e.meta["chunk"]))
    return out


def peak_stashed_from_trace(events) -> dict[int, int]:
    """Per rank, the most micro-batches it held at once (``meta["stashed"]`` of its compute events)."""
    peaks: dict[int, int] = {}
    for e in events:
        if e.op == "compute" and "stashed" in e.meta:
            peaks[e.rank] = max(peaks.get(e.rank, 0), e.meta["stashed"])
    return peaks


def wall_clock_bubble(events) -> float:
    """Idle fraction in seconds: 1 − compute time / (ranks × (last compute end − first compute start))."""
    compute = [e for e in events if e.op == "compute" and "microbatch" in e.meta]
    if not compute:
        return 0.0
    window = max(e.end for e in compute) - min(e.start for e in compute)
    ranks = len({e.rank for e in compute})
    return 1.0 - sum(e.end - e.start for e in compute) / (ranks * window) if window > 0 else 0.0
