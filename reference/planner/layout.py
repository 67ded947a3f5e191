"""Pipeline layout: which layers each model chunk holds, which chunks each device runs, and how many
micro-batches' activations a device keeps alive under each schedule.

The model is cut into p·v chunks (virtual stages) in model order; device k runs chunks k, k+p, …,
k+(v−1)·p (Megatron's interleaving, as ``reference.pipeline.schedules``).  p = 2, v = 2, 10 layers,
``stage_layout=(0, 5, 5, 0)`` — an embedding-only first chunk and a loss-only last chunk::

    chunk (virtual stage)   0            1           2           3
    layers                  embedding    0–4         5–9         final norm, head, loss
    device                  0            1           0           1

Without ``stage_layout`` the layers are dealt as evenly as possible, larger chunks first
(``reference.pipeline.balanced_sizes``), the embedding on chunk 0 and the head on the last.

Activations in flight (1F1B, Narayanan et al. arXiv:2104.04473 §2.2; Korthikanti et al.
arXiv:2205.05198 §4.2.3): device k of a plain 1F1B pipeline holds min(m, p−k) micro-batches of its
layers (GPipe: m).  Interleaved, device k runs 2(p−k−1) + (v−1)·p warm-up chunk-forwards and one more
in the steady state (Megatron's schedule) — each chunk-forward holding a chunk's L/(p·v) layers — so
the first device holds

    (p·v + p − 1) · L/(p·v) = L · (1 + (p−1)/(p·v))          Korthikanti §4.2.3.

The bubble, as a number of per-micro-batch device times T (forward + backward of all its chunks):
GPipe and 1F1B (p−1)·T, interleaved (p−1)·T/v, ZB-H1 (p−1)·T/3 (Qi et al. arXiv:2401.10241: W fills
the bubble; B and W each a third of the work when F = B = W).
"""
from __future__ import annotations

from .model import Composition, Model

__all__ = ["SCHEDULES", "schedule_name", "chunk_layers", "device_chunks", "chunks_in_flight", "forward_order",
           "chunks_held", "layers_in_flight", "bubble_units", "check_layout"]

SCHEDULES = ("gpipe", "1f1b", "zb_h1")


def schedule_name(comp: Composition) -> str:
    """The schedule in use: "interleaved" when virtual_stages > 1, else ``comp.schedule``."""
    return "interleaved" if comp.virtual_stages > 1 else comp.schedule


def check_layout(model: Model, comp: Composition) -> None:
    """ValueError naming the problem: an unknown schedule, a layout of the wrong length or sum, an empty
    chunk in the middle, or more chunks than layers without a layout."""
    p, v = comp.pp, comp.virtual_stages
    if comp.schedule not in SCHEDULES:
        raise ValueError(f"schedule={comp.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if v > 1 and comp.schedule != "1f1b":
        raise ValueError(f"virtual_stages={v} is interleaved 1F1B; schedule={comp.schedule!r} runs one chunk")
    if comp.stage_layout is None:
        if p * v > model.layers:
            raise ValueError(f"pp={p} × virtual_stages={v} is more than layers={model.layers}")
        return
    lay = tuple(comp.stage_layout)
    if len(lay) != p * v:
        raise ValueError(f"stage_layout has {len(lay)} entries; pp={p} × virtual_stages={v} needs {p * v}")
    if any((not isinstance(n, int)) or n < 0 for n in lay):
        raise ValueError(f"stage_layout={lay}: entries must be non-negative integers")
    if sum(lay) != model.layers:
        raise ValueError(f"stage_layout={lay} sums to {sum(lay)} layers, the model has layers={model.layers}")
    if any(n == 0 for n in lay[1:-1]):
        raise ValueError(f"stage_layout={lay}: only the first (embedding-only) and last (loss-only) chunks "
                         "may hold no layers")


def chunk_layers(model: Model, comp: Composition) -> list[tuple[int, int]]:
    """(layers, MoE layers) of every chunk, in model order (p·v entries)."""
    n_chunks = comp.pp * comp.virtual_stages
    if comp.stage_layout is not None:
        sizes = list(comp.stage_layout)
    else:
        q, extra = divmod(model.layers, n_chunks)
        sizes = [q + (1 if i < extra else 0) for i in range(n_chunks)]
    out, start = [], 0
    for n in sizes:
        moe = sum(model.is_moe(i) for i in range(start, start + n)) if model.num_experts > 1 else 0
        out.append((n, moe))
        start += n
    return out


def device_chunks(comp: Composition, device: int) -> list[int]:
    """The chunks (virtual stages) device ``device`` runs: device, device + p, …"""
    return [c * comp.pp + device for c in range(comp.virtual_stages)]


def chunks_in_flight(comp: Composition, device: int, m: int) -> int:
    """Chunk-forwards whose activations device ``device`` holds at its peak (see the module docstring)."""
    p, v = comp.pp, comp.virtual_stages
    if p == 1:
        return 1
    if v > 1:
        return min(m * v, 2 * (p - device - 1) + (v - 1) * p + 1)
    return m if comp.schedule == "gpipe" else min(m, p - device)


def forward_order(comp: Composition, device: int, m: int) -> list[int]:
    """The chunks of device ``device``'s chunk-forwards in the order Megatron's interleaved 1F1B runs them:
    micro-batches in groups of p, each group through the device's chunks in turn (``microbatch_group_size_per_
    vp_stage`` = pp, Megatron-Core's default); a plain pipeline runs its one chunk m times."""
    p, v = comp.pp, comp.virtual_stages
    mine = device_chunks(comp, device)
    order = []
    for start in range(0, m, p):
        group = min(p, m - start)
        for chunk in mine:
            order += [chunk] * group
    return order if v > 1 else [mine[0]] * m


def chunks_held(comp: Composition, device: int, m: int) -> dict[int, int]:
    """{chunk: its chunk-forwards} among those whose activations device ``device`` holds at its peak: the first
    :func:`chunks_in_flight` of :func:`forward_order` (counted without building the order)."""
    want = chunks_in_flight(comp, device, m)
    mine = device_chunks(comp, device)
    if comp.virtual_stages == 1:
        return {mine[0]: want}
    held: dict[int, int] = {}
    for start in range(0, m, comp.pp):
        group = min(comp.pp, m - start)
        for chunk in mine:
            take = min(group, want)
            held[chunk] = held.get(chunk, 0) + take
            want -= take
            if not want:
                return held
    return held


def layers_in_flight(model: Model, comp: Composition, device: int, m: int, chunks: list | None = None
                     ) -> tuple[int, int]:
    """(layers, MoE layers) whose activations device ``device`` holds at its peak: the layers of the
    :func:`chunks_held` — an embedding-only or loss-only chunk among them holds no layer (Llama 3's and
    Megatron-Core's layouts).  ``chunks``: :func:`chunk_layers` if already at hand."""
    chunks = chunks or chunk_layers(model, comp)
    held = chunks_held(comp, device, m)
    return (sum(n * chunks[c][0] for c, n in held.items()), sum(n * chunks[c][1] for c, n in held.items()))


def bubble_units(comp: Composition) -> float:
    """The bubble in per-micro-batch device times: (p−1), (p−1)/v interleaved, (p−1)/3 ZB-H1."""
    p = comp.pp
    name = schedule_name(comp)
    return (p - 1) / {"gpipe": 1, "1f1b": 1, "interleaved": comp.virtual_stages, "zb_h1": 3}[name]
