"""Cutting a single-process model into pipeline stages.

A pipeline stage is a contiguous run of layers.  :func:`split_model` cuts an ``nn.Sequential``
(or a list of layers) into ``p·v`` pieces in model order — the virtual stages — and
:func:`chunks_of_rank` deals them out: rank r gets pieces r, r+p, r+2p, … (chunk c = virtual
stage c·p + r; see :mod:`.schedules`)::

    nn.Sequential(L0, L1, L2, L3, L4, L5, L6)        7 layers, p = 2, v = 2 → 4 pieces
    sizes            2    2    2    1               balanced: the first (7 mod 4) pieces get one more
    pieces         [L0 L1] [L2 L3] [L4 L5] [L6]
    virtual stage     0       1       2      3
    rank (chunk)    0 (c0)  1 (c0)  0 (c1)  1 (c1)

The pieces hold the very layer objects of the model (no copies): a parameter keeps its name in
the full model (:func:`parameter_names`), which is how a pipeline's gradients are compared with
a single process's.  Activations flow between pieces as single tensors, so each piece must map a
tensor (micro-batch, …) to a tensor; the last piece's output goes to the loss.

Balancing by layer count assumes equal layers; real models balance by time or memory (the first
stage also holds the embedding, the last the output layer and loss) — pass ``sizes=`` for that.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from .schedules import virtual_stage

__all__ = ["balanced_sizes", "split_model", "chunks_of_rank", "parameter_names"]


def balanced_sizes(num_layers: int, num_pieces: int) -> list[int]:
    """``num_pieces`` contiguous sizes summing to ``num_layers``, as equal as possible (larger first)."""
    if num_pieces > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_pieces} pipeline pieces: every stage "
                         f"(every chunk, for interleaved schedules) needs at least one layer")
    q, extra = divmod(num_layers, num_pieces)
    return [q + 1 if i < extra else q for i in range(num_pieces)]


def split_model(model_or_layers: nn.Sequential | Sequence[nn.Module], num_stages: int, *, virtual_stages: int = 1,
                sizes: Sequence[int] | None = None) -> list[nn.Sequential]:
    """Cut a model into ``num_stages · virtual_stages`` contiguous pieces (nn.Sequential each), in
    model order: piece k is virtual stage k.  ``sizes[k]`` layers go to piece k (default:
    :func:`balanced_sizes`).  Raises ValueError: more pieces than layers, sizes of the wrong length
    or sum, a piece with no layer, or something that is not a list of modules.
    """
    if isinstance(model_or_layers, nn.Sequential):
        layers = list(model_or_layers)
    elif isinstance(model_or_layers, (list, tuple)) and all(isinstance(x, nn.Module) for x in model_or_layers):
        layers = list(model_or_layers)
    else:
        raise ValueError(f"split_model needs an nn.Sequential or a list of nn.Module layers, got "
                         f"{type(model_or_layers).__name__}")
    for what, x in (("num_stages", num_stages), ("virtual_stages", virtual_stages)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ValueError(f"{what} must be an integer >= 1, got {x!r}")
    pieces = num_stages * virtual_stages
    if sizes is None:
        sizes = balanced_sizes(len(layers), pieces)
    else:
        sizes = list(sizes)
        if len(sizes) != pieces:
            raise ValueError(f"sizes needs one entry per piece (num_stages·virtual_stages = {pieces}), "
                             f"got {len(sizes)}: {sizes}")
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
            raise ValueError(f"every piece needs at least one layer (positive integers), got sizes={sizes}")
        if sum(sizes) != len(layers):
            raise ValueError(f"sizes={sizes} sum to {sum(sizes)}, but the model has {len(layers)} layers")
    out, start = [], 0
    for n in sizes:
        out.append(nn.Sequential(*layers[start:start + n]))
        start += n
    return out


def chunks_of_rank(pieces: Sequence[nn.Module], rank: int, num_stages: int, placement: str = "loop") -> list[nn.Module]:
    """The pieces rank ``rank`` runs, in chunk order: ``[pieces[c·p + rank] for c in 0 … v−1]``, or with
    ``placement="v"`` (two pieces per rank, folded: :func:`.schedules.virtual_stage`) ``[pieces[rank],
    pieces[2p − 1 − rank]]``."""
    if len(pieces) % num_stages:
        raise ValueError(f"{len(pieces)} pieces cannot be dealt to {num_stages} stages evenly")
    if not 0 <= rank < num_stages:
        raise ValueError(f"rank {rank} is not a stage of a {num_stages}-stage pipeline")
    if placement == "v" and len(pieces) != 2 * num_stages:
        raise ValueError(f"the V placement needs two pieces per rank (2·{num_stages}), got {len(pieces)}")
    return [pieces[virtual_stage(c, rank, num_stages, placement)] for c in range(len(pieces) // num_stages)]


def parameter_names(model: nn.Module, modules: Iterable[nn.Module]) -> dict[str, nn.Parameter]:
    """``{name in model: parameter}`` for the parameters of ``modules`` (pieces of ``model``)."""
    names = {id(t): n for n, t in model.named_parameters()}
    out = {}
    for module in modules:
        for t in module.parameters():
            if id(t) not in names:
                raise ValueError("a piece holds a parameter that is not in the model (a copy?)")
            out[names[id(t)]] = t
    return out
