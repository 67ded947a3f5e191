"""The grader's single-process truth for lecture 4b (and the tests'): the same model, the same
micro-batches, one process — gradient accumulation, ``loss_i / m`` each — so a pipeline's loss and
every gradient can be held equal to it in float64.
"""
from __future__ import annotations

from .workers import _setup, mse

__all__ = ["single_process_truth", "microbatch_grads"]


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
