"""The grader's truths for lecture 4b (and the tests'): the same model, the same micro-batches, one
process — gradient accumulation, ``loss_i / m`` each — so a pipeline's loss and every gradient can be
held equal to it in float64; and an order of the learner's run on real ranks by the reference's own
stages (exercise 4.4 is graded on its order alone, whatever the learner's 4.5 says).
"""
from __future__ import annotations

from .workers import _setup, mse, pipeline_worker

__all__ = ["single_process_truth", "microbatch_grads", "run_order"]


def single_process_truth(num_microbatches: int = 4, *, num_stages: int = 1, virtual_stages: int = 1,
                         layers: int | None = None, width: int = 8, batch: int | None = None, seed: int = 0,
                         dtype: str = "float64") -> dict:
    """The same step in one process: gradient accumulation over the same m micro-batches
    (loss_i / m, backward each).  Returns {"loss", "grads" {name: grad}, "full_batch_loss",
    "full_batch_grads"} — the latter from one backward of the mean loss over the whole batch.
    ``num_stages``/``virtual_stages`` only choose the default model size, as in :func:`pipeline_worker`."""
    model, _, (x, y) = _setup(num_stages, layers, width, batch, num_microbatches, virtual_stages, None, seed, dtype)
    loss = 0.0
    for xi, yi in zip(x.tensor_split(num_microbatches), y.tensor_split(num_microbatches)):
        li = mse(model(xi), yi) / num_microbatches
        li.backward()
        loss += float(li.detach())
    grads = {n: t.grad.clone() for n, t in model.named_parameters()}
    model.zero_grad()
    full = mse(model(x), y)
    full.backward()
    return {"loss": loss, "grads": grads, "full_batch_loss": float(full.detach()),
            "full_batch_grads": {n: t.grad.clone() for n, t in model.named_parameters()}}


def microbatch_grads(num_microbatches: int = 4, *, num_stages: int = 1, virtual_stages: int = 1,
                     layers: int | None = None, width: int = 8, seed: int = 0) -> list[dict]:
    """Each micro-batch's share of the gradient (its loss / m, alone), by parameter name: what a
    pipeline that forgets to accumulate would leave (the grader's feedback compares with these)."""
    model, _, (x, y) = _setup(num_stages, layers, width, None, num_microbatches, virtual_stages, None, seed,
                              "float64")
    out = []
    for xi, yi in zip(x.tensor_split(num_microbatches), y.tensor_split(num_microbatches)):
        model.zero_grad()
        (mse(model(xi), yi) / num_microbatches).backward()
        out.append({n: t.grad.clone() for n, t in model.named_parameters()})
    return out


def run_order(actions: list, num_microbatches: int, *, seed: int = 0, timeout: float = 20.0) -> dict:
    """``actions`` (one list of ``(kind, micro-batch)`` per stage) run on ``len(actions)`` real ranks by
    the reference executor and its own forward and backward steps (no simulation first: a bad order
    deadlocks for real).  Returns {"loss", "grads" {name: grad}} of the step, or {"error": what the
    world reported} (a deadlock names the blocked ranks and what each waited for)."""
    from ..launch import WorldError, run_world
    plan = [[(str(k), int(i)) for k, i in stage] for stage in actions]
    try:
        res = run_world(pipeline_worker, len(plan), "1f1b", num_microbatches, actions=plan, check=False, seed=seed,
                        timeout=timeout)
    except WorldError as e:
        return {"error": str(e).splitlines()[0] + "\n" + "\n".join(str(e).splitlines()[1:6])}
    grads: dict = {}
    for v in res.values:
        grads.update(v["grads"])
    losses = [v["loss"] for v in res.values if v["loss"] is not None]
    return {"loss": losses[0] if losses else None, "grads": grads}

