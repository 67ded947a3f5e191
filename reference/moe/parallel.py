"""Lecture 5b, part 3 — expert parallelism: experts live on different ranks, tokens travel.

With W ranks and E experts, rank r holds experts ``r·E/W … (r+1)·E/W - 1`` (E_local = E/W of
them) and a replica of the router.  Each rank routes its own T tokens (one routing group), sends
every kept assignment to the rank that holds its expert, the experts run, and the results come
back to the tokens' home ranks.  Two all-to-alls per layer, forward (and two more backward):
this is a new axis, not a variant of tensor or pipeline parallelism — nothing is split inside
an expert, and every rank computes at once.

Padded, fixed-capacity path (GShard arXiv:2006.16668 §3.2, Switch arXiv:2101.03961 §2.2)
-----------------------------------------------------------------------------------------
Every rank fills a buffer of C slots for every expert, zeros where no token came, so every
message has the same size (E_local·C rows per destination) whatever the routing::

    rank 0's send buffer (E=4, W=2, C=2)            rank 1 receives, per local expert,
                                                    C rows from each source rank
     e0: [t3 ][t0 ]  ─┐ to rank 0                    e2: [r0:t1][r0:·][r1:t2][r1:t5]
     e1: [t2 ][ · ]  ─┘                              e3: [r0:t4][r0:·][r1:t0][r1:·]
     e2: [t1 ][ · ]  ─┐ to rank 1                   (E_local, W·C, d): rows s·C … s·C+C-1 came
     e3: [t4 ][ · ]  ─┘                              from source rank s;  · = zero padding

:func:`dispatch` builds the (E·C, d) buffer and all-to-alls it; :func:`combine` sends the
experts' (E_local, W·C, d) outputs back the same way and forms ``y_t = Σ_j w_tj · out[e_tj, slot_tj]``
over kept assignments (dropped ones contribute 0).  Bytes per rank per all-to-all are fixed:
``(W-1)/W · E·C·d·bytes`` leave the rank — k-fold for top-k, since C ∝ k.

Dropless path (variable splits; MegaBlocks arXiv:2211.15841 takes this further)
---------------------------------------------------------------------------------
No capacity, no padding: first exchange the counts (an all-to-all of E integers), then send
exactly the assigned tokens with ``all_to_all_single`` and per-destination split sizes.  Some
pairs of ranks may send nothing.  :func:`dispatch_dropless` / :func:`combine_dropless`.

Backward of an all-to-all
-------------------------
An all-to-all is a linear map A: rank s's block for rank d becomes rank d's block from s.  Its
adjoint Aᵀ is the all-to-all with the send and receive splits swapped: the gradient of what rank d
received from s goes back to s.  ``<A x, g> = <x, Aᵀ g>`` (summed over ranks) is tested.
:func:`all_to_all` is that differentiable all-to-all (equal or variable splits).

Trace
-----
Every all-to-all is a ``comm.all_to_all_single`` event with ``meta["what"]`` in ``"counts"``
(dropless only: E_local integers per destination announcing the tokens that follow),
``"dispatch"``, ``"combine"`` (and ``"dispatch.backward"``, ``"combine.backward"`` when
gradients flow), ``meta["send_splits"]`` rows per destination (padding included) and
``meta["tokens_per_dest"]`` REAL tokens per destination.  In the padded path a rank that sends
expert outputs back in :func:`combine` does not know, without another message, how many of the
rows it returns are padding; there ``tokens_per_dest`` counts all rows and ``tokens_per_src``
says how many of this rank's own tokens come back from each rank (= what that rank received in
the dispatch).  Each forward also records the routing decision as one ``route`` event per rank
(``meta``: expert_index, weight, kept, slot as lists; num_experts, k, capacity) and the experts'
work as a ``compute`` event with ``what="experts"`` and ``tokens_per_expert``.  The routing
decision is returned in ``stats["routing"]`` as well.  In the padded path the layer also
all-gathers every rank's kept assignments per expert (an ``all_gather`` event, ``what="counts"``,
E integers per rank) so that its experts compute the filled slots only, not the padding.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from .. import comm, trace
from .assignments import _by_expert, _experts_per_rank, _kept_assignments  # noqa: F401 (their home was here)
from .experts import run_experts
from .layer import BALANCES, MoELayer, balance_loss, emit_route, route
from .placement import expert_nodes
from .routing import check_node_limit, expert_capacity, loss_free_bias_update, router_z_loss

__all__ = ["all_to_all", "dispatch", "combine", "dispatch_dropless", "combine_dropless", "ExpertParallelMoE",
           "mean_share"]


# ----------------------------------------------------------------------------------------------
# A differentiable all-to-all


def all_to_all(x: torch.Tensor, send_splits: list[int] | None = None, recv_splits: list[int] | None = None, *,
               group=None, what: str = "all_to_all", tokens_per_dest: list[int] | None = None,
               **meta) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x`` (first dimension): :func:`reference.comm.all_to_all_autograd`
    with the tokens each destination gets recorded in the trace.

    send_splits[d]: rows of ``x`` for group rank d (in order); recv_splits[s]: rows that arrive from
    rank s.  None: equal splits, ``x.shape[0] / W`` each.  Returns the received rows, in source
    order.  Backward is the all-to-all with the splits swapped (the adjoint).  ``what``,
    ``tokens_per_dest`` (default: the send splits) and ``meta`` go into the trace event.
    """
    if tokens_per_dest is None:
        W = comm.world_size(group)
        tokens_per_dest = list(send_splits) if send_splits is not None else (
            [x.shape[0] // W] * W if x.shape[0] % W == 0 else None)
    if tokens_per_dest is not None:
        meta["tokens_per_dest"] = list(tokens_per_dest)
    return comm.all_to_all_autograd(x, send_splits, recv_splits, group=group, what=what, **meta)


# ----------------------------------------------------------------------------------------------
# Padded, fixed-capacity dispatch and combine (exercise 5b.3)


def _pad(blocks: list[torch.Tensor], capacity: int) -> torch.Tensor:
    """One buffer of ``capacity`` rows per block: each block's rows, then zero rows up to C.

        blocks  [b0 (2, d), b1 (0, d), b2 (1, d)],  C = 2   ──▶   [b0 b0 · · b2 ·]  (3·C, d)

    One copy (a ``cat``).  Its backward hands each block its own rows of the gradient: views, no copy.
    """
    d = blocks[0].shape[1]
    zero = blocks[0].new_zeros(1, d)
    parts = []
    for b in blocks:
        parts.append(b)
        if b.shape[0] < capacity:
            parts.append(zero.expand(capacity - b.shape[0], d))
    return torch.cat(parts)


def _unpad(buffer: torch.Tensor, counts: list[int], capacity: int) -> list[torch.Tensor]:
    """The inverse of :func:`_pad`: the first ``counts[i]`` rows of each block of C rows, as views.
    Its backward writes the gradient rows back in place, with zeros in the padding (one ``cat``)."""
    sizes = [n for c in counts for n in (c, capacity - c)]
    return list(buffer.split(sizes)[0::2])


def dispatch(x: torch.Tensor, routing: dict, num_experts: int, capacity: int, group=None) -> torch.Tensor:
    """Send each kept assignment to the rank holding its expert; padded to ``capacity`` per expert.

    x: (T, d) this rank's tokens; routing: from :func:`top_k_gating`.  Returns (E_local, W·C, d):
    for each of this rank's experts, C slots from each source rank in rank order (zeros where no
    token was assigned).

    Graded on: the dispatched buffer on 1–4 ranks, and combine(experts(dispatch(x))) with its gradients w.r.t. x and
    the combine weights equal to one process's.
    """
    (W, E_local), d = _experts_per_rank(num_experts, group), x.shape[1]
    received = _dispatch_rows(x, routing, num_experts, capacity, group)
    return received.view(W, E_local, capacity, d).transpose(0, 1).reshape(E_local, W * capacity, d)


def _dispatch_rows(x: torch.Tensor, routing: dict, num_experts: int, capacity: int, group) -> torch.Tensor:
    """:func:`dispatch` as it arrives, before the expert-major transpose: (W·E_local·C, d), rows
    ``s·E_local·C + e·C + c`` = slot c of local expert e from source rank s."""
    W, E_local = _experts_per_rank(num_experts, group)
    t, _, counts = _by_expert(routing, num_experts, padded=True)          # expert e's rows, slot order
    buffer = _pad(list(x.index_select(0, t).split(counts.tolist())), capacity)           # (E·C, d)
    tokens_per_dest = counts.view(W, E_local).sum(1).tolist()
    return all_to_all(buffer, group=group, what="dispatch", tokens_per_dest=tokens_per_dest)


def combine(expert_out: torch.Tensor, routing: dict, num_experts: int, capacity: int, group=None) -> torch.Tensor:
    """Return the experts' outputs to the tokens' home ranks and mix them with the combine weights.

    expert_out: (E_local, W·C, d) laid out as :func:`dispatch` returns.  Returns (T, d):
    ``y_t = Σ_j w_tj · out[e_tj, slot_tj]`` over kept assignments; dropped ones contribute 0.

    Graded on: combine(experts(dispatch(x))) and its gradients w.r.t. x and the combine weights on 1–4 ranks, equal
    to one process's.
    """
    W, E_local = _experts_per_rank(num_experts, group)
    if expert_out.dim() != 3 or expert_out.shape[:2] != (E_local, W * capacity):
        raise ValueError(f"combine expects expert outputs of shape ({E_local}, {W * capacity}, d), "
                         f"got {tuple(expert_out.shape)}")
    d = expert_out.shape[2]
    send = expert_out.view(E_local, W, capacity, d).transpose(0, 1).reshape(W * E_local * capacity, d)
    return _combine_rows(send, routing, num_experts, capacity, group)


def _combine_rows(send: torch.Tensor, routing: dict, num_experts: int, capacity: int, group) -> torch.Tensor:
    """:func:`combine` from the send buffer: (W·E_local·C, d) in :func:`_dispatch_rows`' layout."""
    (W, E_local), T, d = _experts_per_rank(num_experts, group), routing["kept"].shape[0], send.shape[1]
    t, j, counts = _by_expert(routing, num_experts, padded=True)
    back = all_to_all(send, group=group, what="combine", tokens_per_dest=[E_local * capacity] * W,
                      tokens_per_src=counts.view(W, E_local).sum(1).tolist())
    w = routing["weight"][t, j].unsqueeze(-1).to(back.dtype)
    return back.new_zeros(T, d).index_add_(0, t, w * torch.cat(_unpad(back, counts.tolist(), capacity)))


# ----------------------------------------------------------------------------------------------
# Dropless: variable splits, counts first


def dispatch_dropless(x: torch.Tensor, routing: dict, num_experts: int,
                      group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-size dispatch: exchange counts, then exactly the assigned tokens.

    Returns ``(x_recv, recv_counts)``: x_recv (N, d) with rows grouped by source rank, then local
    expert, then slot; recv_counts (W, E_local) long, rows from source s for local expert e.
    """
    W, E_local = _experts_per_rank(num_experts, group)
    t, _, counts = _by_expert(routing, num_experts)
    send_splits = counts.view(W, E_local).sum(1).tolist()
    with torch.no_grad():                      # counts are integers: nothing to differentiate
        recv_counts = all_to_all(counts, [E_local] * W, [E_local] * W, group=group, what="counts",
                                 tokens_per_dest=send_splits).view(W, E_local)
    recv_splits = recv_counts.sum(1).tolist()
    x_recv = all_to_all(x.index_select(0, t), send_splits, recv_splits, group=group, what="dispatch")
    return x_recv, recv_counts


def combine_dropless(expert_out: torch.Tensor, routing: dict, num_experts: int, recv_counts: torch.Tensor,
                     group=None) -> torch.Tensor:
    """Send expert outputs (laid out as :func:`dispatch_dropless` returned) back; weighted sum (T, d)."""
    (W, _), T = _experts_per_rank(num_experts, group), routing["kept"].shape[0]
    t, j, counts = _by_expert(routing, num_experts)
    back = all_to_all(expert_out, recv_counts.sum(1).tolist(), counts.view(W, -1).sum(1).tolist(),
                      group=group, what="combine")
    w = routing["weight"][t, j].unsqueeze(-1).to(back.dtype)
    return back.new_zeros(T, expert_out.shape[1]).index_add_(0, t, w * back)


# ----------------------------------------------------------------------------------------------
# The expert-parallel layer


def _filled_slots(kept_experts: torch.Tensor, num_experts: int, group) -> torch.Tensor:
    """(W, E_local) long: slots of each of this rank's experts that each source rank filled.

    kept_experts: the expert of every kept assignment on this rank.  One all-gather of E integers
    per rank (traced ``what="counts"``): the padded messages need no counts, but the experts
    use them to skip the padding rows (:meth:`ExpertParallelMoE._run_experts_padded`).
    """
    W, E_local = _experts_per_rank(num_experts, group)
    counts = torch.bincount(kept_experts, minlength=num_experts)                     # (E,)
    if W > 1:
        counts = torch.stack(comm.all_gather(counts, group=group, what="counts"))   # (W, E)
    else:
        counts = counts.unsqueeze(0)
    r = comm.rank(group)
    return counts[:, r * E_local:(r + 1) * E_local]


def _world_if_none(group):
    return group if group is not None or not dist.is_initialized() else dist.group.WORLD


def mean_share(loss: torch.Tensor, ranks: int) -> torch.Tensor:
    """``loss``'s value, ``ranks`` × its gradient: a group-wide loss as one rank's share of a mean.

    If every rank holds the same value L of a loss whose gradient reaches only its own inputs,
    and gradients are then averaged over the ranks, the average carries ∂L/ranks.  Scaling each
    rank's gradient by ``ranks`` makes the average exactly ∂L.  (Value: L + 0, exactly.)
    """
    if ranks == 1:
        return loss
    extra = (ranks - 1) * loss
    return loss + (extra - extra.detach())


class ExpertParallelMoE(nn.Module):
    """An :class:`MoELayer` whose experts are spread over the ranks of ``group``.

    Build it on every rank from the same layer with :meth:`from_layer`.  ``forward(x)`` on rank r
    computes what ``layer(x)`` computes for these T tokens (one routing group), outputs and
    gradients, with two differences that make it a group: ``stats["aux_loss"]`` is the
    load-balancing loss of a batch larger than one routing group (see below), and each expert's
    gradient sums the contributions of every rank's tokens.  The router is a replica: average
    its gradient, and divide the experts' by the data-parallel size, with
    :func:`reference.moe.sync_moe_gradients`.

    aux_group — whose tokens one load-balancing loss is computed over (lecture 5b, "whose batch"):
    ``"ep"`` (default) the expert-parallel group's batch; a process group, e.g. the whole
    data-parallel group, for a global-batch loss (Megatron's global aux loss, arXiv:2501.11873);
    ``"local"`` this rank's routing group only (GShard/Switch: one loss per group, averaged).

    The loss keeps its strength under data parallelism.  Training code on every rank back-
    propagates ``task + α·aux + β·z`` and then AVERAGES gradients over the N ranks.  The task and
    z-losses are per-rank means, so the average is the whole batch's mean.  The aux loss is
    different: one value for the |G| ranks of ``aux_group``, and each rank's backward only reaches
    its own tokens (:func:`load_balancing_loss` keeps the gradient local).  Averaged, that would
    give the router α/|G| of the aux gradient.  So the aux loss returned here has the group's value
    and |G| times the local gradient, the gradient of this rank's share s_r of a loss that is a
    mean over ranks, aux = (1/|G|) Σ_r s_r.  One step then gives the single-process gradient of
    mean task + α·aux + β·z over the whole batch (the full course's ``tests/moe/test_parallel.py``).

    ``aux_ranks``: the factor of :func:`mean_share` when the gradients are later reduced over fewer
    ranks than ``aux_group`` holds (default |G|).

    In capacity mode every rank must pass the same T (GShard's equal-sized groups); dropless mode
    takes any T per rank.  Inputs are checked with one small all-reduce first: a bad shape or an
    uneven T on any rank raises ValueError on every rank.

    The frontier options are :class:`MoELayer`'s, copied by :meth:`from_layer` (router kind, balance and
    the loss-free ``expert_bias``, shared experts — a replica, like the router —, ``experts_impl``),
    and the layer's own: ``overlap=True`` (dropless: two halves, each half's all-to-alls in flight
    while the other half's experts run, :mod:`.overlap`) and ``max_nodes`` with ``devices_per_node``
    (each token's experts on at most M nodes of the group's ranks, :mod:`.placement`).
    """

    def __init__(self, router: nn.Linear, experts: nn.ModuleList | nn.ModuleDict, *, num_experts: int, k: int,
                 capacity_factor: float, dropless: bool, group=None, jitter: float = 0.0,
                 random_second_expert: bool = False, aux_group="ep", router_kind: str = "softmax",
                 balance: str = "aux", bias_update_rate: float = 1e-3, shared: nn.Module | None = None,
                 experts_impl: str = "loop", overlap: bool = False, max_nodes: int | None = None,
                 devices_per_node: int | None = None, aux_ranks: int | None = None):
        super().__init__()
        if balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
        if overlap and not dropless:
            raise ValueError("overlap=True splits the dropless path's all-to-alls (use dropless=True)")
        if max_nodes is not None and not devices_per_node:
            raise ValueError("max_nodes needs devices_per_node (which ranks share a node)")
        self.router, self.experts = router, experts
        self.num_experts, self.k, self.capacity_factor, self.dropless = num_experts, k, capacity_factor, dropless
        self.jitter, self.random_second_expert = jitter, random_second_expert
        self.group, self.aux_group, self.aux_ranks = group, aux_group, aux_ranks
        self.d_model = router.in_features
        self.router_kind, self.balance, self.bias_update_rate = router_kind, balance, bias_update_rate
        self.experts_impl, self.overlap, self.max_nodes = experts_impl, overlap, max_nodes
        if shared is not None:
            self.shared = shared
        self.add_shared = True          # False: the caller runs ``shared`` itself (reference.compose's folded layer)
        self.node_of_expert = None
        if max_nodes is not None:
            g = _world_if_none(group)
            ranks = list(range(comm.world_size(g))) if g is None else [comm.global_rank(g, i)
                                                                        for i in range(comm.world_size(g))]
            self.node_of_expert = torch.tensor(expert_nodes(num_experts, ranks, devices_per_node))
            check_node_limit(self.node_of_expert, max_nodes, k)
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=balance.startswith("loss_free"))
        self.register_buffer("load", torch.zeros(num_experts), persistent=False)

    @classmethod
    def from_layer(cls, layer: MoELayer, group=None, aux_group="ep", **options) -> ExpertParallelMoE:
        """Keep the router, the shared experts and the loss-free bias (copied) and experts
        ``[r·E/W, (r+1)·E/W)`` (copied) of ``layer``.  ``options``: overlap, max_nodes, devices_per_node,
        aux_ranks (the layer's own, class docstring)."""
        W, r, E = comm.world_size(group), comm.rank(group), layer.num_experts
        if E % W:
            raise ValueError(f"{E} experts cannot be split evenly over {W} ranks")
        E_local = E // W
        experts = nn.ModuleList(copy.deepcopy(layer.experts[i]) for i in range(r * E_local, (r + 1) * E_local))
        ep = cls(copy.deepcopy(layer.router), experts, num_experts=E, k=layer.k,
                 capacity_factor=layer.capacity_factor, dropless=layer.dropless, group=group,
                 jitter=layer.jitter, random_second_expert=layer.random_second_expert, aux_group=aux_group,
                 router_kind=layer.router_kind, balance=layer.balance, bias_update_rate=layer.bias_update_rate,
                 shared=copy.deepcopy(layer.shared) if layer.shared_experts else None,
                 experts_impl=layer.experts_impl, **options)
        ep.expert_bias = layer.expert_bias.detach().clone()
        ep.load = torch.zeros_like(layer.load)
        return ep

    def _aux_loss(self, probs: torch.Tensor, expert_index: torch.Tensor, sequence=None,
                  num_sequences=None) -> torch.Tensor:
        """The balance loss over ``aux_group``'s tokens, its local gradient scaled by |G| (or ``aux_ranks``)."""
        if isinstance(self.aux_group, str) and self.aux_group not in ("ep", "local"):
            raise ValueError(f'aux_group must be "ep", "local" or a process group, got {self.aux_group!r}')
        kw = dict(sequence=sequence, num_sequences=num_sequences)
        if isinstance(self.aux_group, str) and self.aux_group == "local":
            return balance_loss(self.balance, probs, expert_index, self.num_experts, **kw)
        group = _world_if_none(self.group if isinstance(self.aux_group, str) else self.aux_group)
        aux = balance_loss(self.balance, probs, expert_index, self.num_experts, group=group, **kw)
        ranks = self.aux_ranks or (comm.world_size(group) if dist.is_initialized() else 1)
        return mean_share(aux, ranks)

    def gating(self) -> dict:
        """The keyword arguments of :func:`top_k_routing` this layer routes with (as :meth:`MoELayer.gating`)."""
        return dict(router=self.router_kind, bias=self.expert_bias if self.balance.startswith("loss_free") else None,
                    node_of_expert=self.node_of_expert, max_nodes=self.max_nodes)

    def update_bias(self, group=None) -> None:
        """:meth:`MoELayer.update_bias`: the loads summed over ``group`` — every rank that routes tokens."""
        if self.balance.startswith("loss_free"):
            loss_free_bias_update(self.expert_bias, self.load, self.bias_update_rate, group=group)
        self.load.zero_()

    def local_experts(self) -> list[nn.Module]:
        """This rank's experts in order: ``experts`` is a ModuleList, or a ModuleDict keyed by global
        expert id (so that the parameter names are the single-process layer's, as reference.compose
        keeps them)."""
        return list(self.experts.values() if isinstance(self.experts, nn.ModuleDict) else self.experts)

    @property
    def first_expert(self) -> int:
        """Global index of this rank's first expert."""
        return comm.rank(self.group) * len(self.experts)

    def _check_input(self, x: torch.Tensor) -> None:
        """ValueError on EVERY rank if any rank's tokens are not (T, d_model), or (capacity mode)
        if the ranks' T differ.  One all-reduce of three numbers, before any other message: a
        rank that raised alone would leave its peers waiting in the all-to-all."""
        ok = x.dim() == 2 and x.shape[1] == self.d_model
        T = x.shape[0] if x.dim() >= 1 else 0
        t = torch.tensor([int(ok), T, -T], dtype=torch.long)
        if dist.is_initialized() and comm.world_size(self.group) > 1:
            comm.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group, what="check_input")
        if not ok:
            raise ValueError(f"ExpertParallelMoE expects tokens of shape (T, {self.d_model}), got {tuple(x.shape)}")
        if t[0] == 0:
            raise ValueError("another rank of the expert-parallel group passed tokens of the wrong shape "
                             f"(expected (T, {self.d_model}))")
        if not self.dropless and t[1] != -t[2]:
            raise ValueError(f"capacity mode needs the same number of tokens on every rank, got between "
                             f"{int(t[1])} and {int(-t[2])} (use dropless=True for uneven batches)")

    def _run_experts_padded(self, x_recv: torch.Tensor, filled: torch.Tensor, capacity: int) -> torch.Tensor:
        """Run the local experts on the FILLED slots of the received buffer only; padding rows of the output are 0.

        x_recv: (W·E_local·C, d) as the dispatch all-to-all delivers it (:func:`_dispatch_rows`:
        source-major, row ``s·E_local·C + e·C + c``); filled: (W, E_local), slots of expert e that
        source s filled (slots fill from 0, so they are the block's first rows).  The output has the
        same layout, which is the layout :func:`combine` sends back: neither side transposes the padded
        (E_local, W·C, d) view that :func:`dispatch` / :func:`combine` expose, so no full-buffer copy.
        Computing the padding too (what a dense GShard layer does) would cost E·C / kept - 1 more:
        25 % at capacity factor 1.25 with perfect balance, more when tokens are dropped.  Combine
        never reads a padding row, so its value does not matter.  Each block of C rows is one
        (source, expert) pair; an expert runs once per source, on the rows already contiguous there::

            x_recv  [s0e0 · ][s0e1 ··][s1e0   ][s1e1 · ]   ──_unpad──▶ views ──FFN_e──▶ outputs
            out     [y    · ][y    ··][y      ][y    · ]   ◀──_pad (one cat, zero rows)───────┘

        Every expert runs, even on 0 rows: the backward graph must reach the dispatch all-to-all
        on every rank, or a rank whose experts got nothing would leave its peers waiting.
        """
        experts = self.local_experts()
        blocks = _unpad(x_recv, filled.flatten().tolist(), capacity)                  # (s, e) order
        return _pad([experts[i % len(experts)](b) for i, b in enumerate(blocks)], capacity)

    def _run_experts_dropless(self, x_recv: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """Run local expert e on its rows of ``x_recv`` (grouped source-major, see dispatch_dropless).

        Rows are gathered expert by expert and put back in place by one permutation.  Every expert
        runs, even on 0 rows, so the backward graph always reaches the dispatch all-to-all: a rank
        whose experts got no tokens must still take part in the backward all-to-all, or its peers
        wait for it forever.
        """
        E_local = len(self.experts)
        local_expert = torch.arange(E_local).repeat(recv_counts.shape[0])            # per (source, expert) block
        row_expert = torch.repeat_interleave(local_expert, recv_counts.flatten())    # (N,)
        perm = torch.argsort(row_expert, stable=True)                                # rows, expert-major
        out_sorted = run_experts(self.local_experts(), x_recv.index_select(0, perm), recv_counts.sum(0).tolist(),
                                 self.experts_impl)
        return out_sorted.index_select(0, torch.argsort(perm))

    def forward(self, x: torch.Tensor, sequence: torch.Tensor | None = None,
                num_sequences: int | None = None) -> tuple[torch.Tensor, dict]:
        self._check_input(x)
        T, E, group = x.shape[0], self.num_experts, self.group
        capacity = None if self.dropless else expert_capacity(T, E, self.k, self.capacity_factor)
        logits, routing = route(x, self.router, k=self.k, capacity=capacity, num_experts=E, jitter=self.jitter,
                                random_second_expert=self.random_second_expert, training=self.training,
                                gating=self.gating())
        emit_route(routing, num_experts=E, capacity=capacity, k=self.k, where="expert_parallel")
        idx, kept = routing["expert_index"], routing["kept"]
        if self.training and torch.is_grad_enabled():
            self.load += torch.bincount(idx.flatten(), minlength=E).to(self.load.dtype)
        aux_loss = self._aux_loss(routing["probs"], idx, sequence, num_sequences)

        if self.dropless and self.overlap:
            from .overlap import overlapped_dropless
            y = overlapped_dropless(self, x, routing)
        elif self.dropless:
            x_recv, recv_counts = dispatch_dropless(x, routing, E, group)
            per_expert = recv_counts.sum(0)                                         # (E_local,)
            with trace.span("compute", what="experts", tokens_per_expert=per_expert.tolist()):
                out = self._run_experts_dropless(x_recv, recv_counts)
            y = combine_dropless(out, routing, E, recv_counts, group)
        else:
            filled = _filled_slots(idx[kept], E, group)                              # (W, E_local)
            x_recv = _dispatch_rows(x, routing, E, capacity, group)                 # (W·E_local·C, d)
            with trace.span("compute", what="experts", tokens_per_expert=filled.sum(0).tolist()):
                out = self._run_experts_padded(x_recv, filled, capacity)
            y = _combine_rows(out, routing, E, capacity, group)                     # combine, untransposed
        if getattr(self, "shared", None) is not None and self.add_shared:
            y = y + self.shared(x)

        kept_per_expert = torch.bincount(idx[kept], minlength=E)
        stats = {
            "aux_loss": aux_loss,
            "z_loss": router_z_loss(logits),
            "tokens_per_expert": torch.bincount(idx.flatten(), minlength=E),
            "kept_per_expert": kept_per_expert,
            "dropped": int((~kept).sum()),
            "dispatched": int(kept.sum()),
            "capacity": capacity,
            "routing": routing,
        }
        return y, stats
