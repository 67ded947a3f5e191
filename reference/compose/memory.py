"""Lecture 5c, part 4 — what one rank really holds, measured, next to what the planner predicts.

:func:`measure_worker` (a rank function for ``run_world``) builds the tiny GPT's piece on the grid
exactly as :func:`.workers.train_worker` does, takes ONE training step and returns what the rank
held, in bytes::

    params       Σ numel · element size of this rank's parameters (its shards)
    grads        Σ of their ``.grad`` after the step (every parameter has one)
    optimizer    Adam's exp_avg + exp_avg_sq (2 × params: no fp32 master copy in float64)
    activations  the PEAK over the step of the floating-point tensors autograd SAVED for the
                 backward (``torch.autograd.graph.saved_tensors_hooks``), each distinct storage
                 counted once (q, k, v are views of one qkv output: one storage), parameters and
                 buffers left out.  With one stage the peak is one micro-batch's forward; with a
                 pipeline, the micro-batches 1F1B keeps in flight.

The same run's trace gives the bytes per axis (:func:`.train.measured_bytes`).  :func:`planner_inputs`
describes the run to :mod:`reference.planner` (:func:`reference.planner.tiny_gpt`), and
:func:`planner_vs_measured` puts both side by side for one grid — the notebook prints it.

Not counted (reported separately where measured, so the gaps are visible):

* ``other_saved``: integer and boolean tensors saved for the backward — token ids and targets, the
  embedding's and the loss's index/ownership masks, the MoE routing indices and masks;
* Adam's step counters (one float64 per parameter tensor: ``optimizer_steps``);
* buffers (positions, the padded-vocabulary mask), temporary tensors that live only inside one op
  (the forward's intermediates autograd does not keep, the backward's gradients of activations),
  the pipeline executor's references to stage outputs and received gradients, communication
  buffers (ring attention's K/V blocks in flight), the allocator's caching and fragmentation.
* Saved tensors the planner does not model for the tiny GPT: the vocabulary-parallel embedding's
  ownership mask turned float (one number per token and micro-batch in flight, first stage:
  −0.3 to −0.8 % on dense grids).  MoE layers (dp×ep: −6.6 % on the mean over ranks): a second
  k·T·d copy in the combine (``index_add`` keeps its source, the gate-weighted rows, besides the
  unweighted rows the gate's gradient needs), the z-loss's router logits and log-sum-exp (T·E + T,
  computed but not in the loss: kept until the next forward), the top-k renormalisation sum (T)
  and the aux loss's partial sums (E + 1); and the planner assumes balanced experts (k·T rows per
  rank) while an untrained router is not (−14 % to +1 % per rank; the ep group's mean is exact).
"""
from __future__ import annotations

from ..gpt import GPTConfig, corpus, encode, get_batch
from ..saved import SavedTensorMeter
from .train import measured_bytes, train_step
from .workers import Adam, build

__all__ = ["SavedTensorMeter", "measure_worker", "planner_inputs", "planner_vs_measured", "state_bytes"]


def state_bytes(model, optimizer: Adam) -> dict[str, int]:
    """Parameters, gradients and Adam's moments of this rank, in bytes, from the tensors themselves."""
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)      # noqa: E731
    params = list(model.parameters())
    return dict(params=size(params), grads=size(p.grad for p in params),
                optimizer=size(optimizer.exp_avg) + size(optimizer.exp_avg_sq),
                optimizer_steps=size(optimizer.steps))


def measure_worker(sizes: dict, *, batch_size: int = 4, seed: int = 0, lr: float = 3e-3,
                   sequence_parallel: bool = False, schedule: str = "1f1b", num_microbatches: int = 1,
                   detail: bool = False, **config) -> dict:
    """One training step of the tiny GPT on the grid ``sizes`` (every rank runs it), measured.

    Returns {"coords", "loss", "params", "grads", "optimizer", "optimizer_steps", "activations"
    (peak floating-point bytes saved for the backward), "other_saved" (peak integer/boolean bytes),
    "saves" (number of saved tensors)}, and with ``detail`` the list of first saves
    (shape, dtype, bytes).  The run's trace holds the step's communication (``measured_bytes``).
    """
    model, data = build(sizes, batch_size=batch_size, seed=seed, sequence_parallel=sequence_parallel,
                        num_microbatches=num_microbatches, **config)
    opt = Adam(model.parameters(), lr=lr)
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in get_batch(data, 0, batch_size, model.cfg.seq_len, seed))
    with SavedTensorMeter(list(model.parameters()) + list(model.buffers()), detail=detail) as meter:
        loss = train_step(model, opt, x, y, schedule=schedule, num_microbatches=num_microbatches)
    out = dict(coords=model.coords, loss=loss, activations=meter.peak, other_saved=meter.peak_other,
               saves=meter.saves, kept_after_step=meter.live, **state_bytes(model, opt))
    if detail:
        out["detail"] = meter.detail
    return out


# ----------------------------------------------------------------------------------------------
# The planner's view of the same run


def planner_inputs(sizes: dict, *, batch_size: int = 4, sequence_parallel: bool = False, num_microbatches: int = 1,
                   **config):
    """(planner Model, Composition, Cluster) describing a :func:`measure_worker` run."""
    from .. import planner
    cfg = GPTConfig(vocab=len(encode(corpus())[1]), **config)
    g = {a: sizes.get(a, 1) for a in ("dp", "tp", "pp", "cp", "ep")}
    model = planner.tiny_gpt(cfg, batch_size=batch_size, micro_batch=batch_size // g["dp"] // num_microbatches)
    comp = planner.Composition(**g, flash=True, sequence_parallel=sequence_parallel,
                               micro_batches=num_microbatches)
    n = g["dp"] * g["tp"] * g["pp"] * g["cp"]
    return model, comp, planner.cpu_cluster(n)


_AXIS = {"dp": "dp_cp", "edp": "edp", "tp": "tp", "cp": "cp", "pp": "pp"}


def planner_vs_measured(res, sizes: dict, *, rank: int = 0, batch_size: int = 4, sequence_parallel: bool = False,
                        num_microbatches: int = 1, **config) -> dict[str, dict[str, tuple[float, float]]]:
    """{"bytes": {axis: (planner, measured)}, "memory": {kind: (planner, measured)}} for ``rank`` of a
    :func:`measure_worker` run ``res`` (a WorldResult) — the planner describing that rank's stage.

    Bytes are the wire bytes of one step (ring algorithms; the planner's axis "dp" is the trace's
    "dp_cp").  "ep" compares the routing-independent payload the rank hands to the dispatch and
    the combine's backward all-to-alls (k·T·d numbers each per MoE layer and micro-batch).
    Memory: params, grads, optimizer exact; "activations" is the planner's activations + its
    output-layer entry ("logits") against the measured peak of saved floating-point tensors.
    """
    from .. import planner
    from ..mesh import RankGrid
    model, comp, cluster = planner_inputs(sizes, batch_size=batch_size, sequence_parallel=sequence_parallel,
                                          num_microbatches=num_microbatches, **config)
    v = res.values[rank]
    pl = planner.plan(model, cluster, comp, stage=v["coords"]["pp"])
    grid = RankGrid(len(res.values), **sizes)
    got = measured_bytes(res.trace, rank, grid)
    out_bytes = {}
    for axis, value in pl.comm_bytes.items():
        if axis == "ep":
            payload = sum(e.nbytes for e in res.trace.filter(op="all_to_all", rank=rank)
                          if e.meta.get("what") in ("dispatch", "combine.backward"))
            out_bytes["ep payload"] = (pl.ep_payload, payload)
        else:
            out_bytes[axis] = (value, got.get(_AXIS[axis], 0))
    mem = {k: (pl.memory[k], v[k]) for k in ("params", "grads", "optimizer")}
    mem["activations"] = (pl.memory["activations"] + pl.memory.get("logits", 0.0), v["activations"])
    return {"bytes": out_bytes, "memory": mem}
