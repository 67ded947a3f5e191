"""Rank functions of lecture 4a: what the tests, the grader and the full course's ``benchmarks/tensor_parallel.py`` run,
and the rank side of the notebook's runs (:mod:`.lecture`).

Every rank builds the same full single-process module and the same inputs from a seed
(:func:`build`), keeps its shard, runs forward and backward, and returns plain tensors; the caller
compares them with the single-process module run on the full inputs.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .. import comm, trace
from ..saved import saved_bytes
from .blocks import (MLP, Block, ParallelBlock, ParallelMLP, ParallelSelfAttention, SelfAttention,
                     sync_sequence_parallel_grads)
from .layers import ColumnParallelLinear
from .vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


def build(kind: str, *, d_model: int = 8, heads: int = 4, d_ff: int = 24, S: int = 12, B: int = 2, seed: int = 0,
          scale: float = 1.0, dropout_p: float = 0.0, dtype=torch.float64):
    """The full module of ``kind`` ("mlp", "attn" or "block") and full (S, B, d) input and output gradient."""
    torch.manual_seed(seed)
    if kind == "mlp":
        m = MLP(d_model, d_ff, dtype=dtype)
    elif kind == "attn":
        m = SelfAttention(d_model, heads, dropout_p=dropout_p, dtype=dtype)
    elif kind == "block":
        m = Block(d_model, heads, d_ff, dropout_p=dropout_p, dtype=dtype)
        with torch.no_grad():      # LayerNorms that are not the identity, so their gradients mean something
            for ln in (m.ln1, m.ln2):
                ln.weight.add_(torch.randn_like(ln.weight) * 0.3)
                ln.bias.add_(torch.randn_like(ln.bias) * 0.3)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(S, B, d_model, generator=g, dtype=torch.float64) * scale).to(dtype)
    dout = torch.randn(S, B, d_model, generator=g, dtype=torch.float64).to(dtype)
    return m, x, dout


def single(kind: str, **cfg) -> dict:
    """Ground truth: the full module, forward + backward in one process."""
    m, x, dout = build(kind, **cfg)
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(dout)
    return {"out": y.detach(), "dx": x.grad, "grads": {n: p.grad for n, p in m.named_parameters()}}


def parallel(kind: str, sequence_parallel: bool = False, sync: bool = True, save_shard: bool = True,
             recompute: str = "none", tp: int | None = None, **cfg) -> dict:
    """This rank's shard of ``kind``: output, input gradient, local parameter gradients (by name).
    ``save_shard`` False: column-parallel layers keep their gathered input under sequence parallelism;
    ``recompute``: the block's activation recomputation ("none", "selective", "full"); ``tp``: on groups
    of tp consecutive ranks (:func:`tp_group`), not the whole world."""
    m, x, dout = build(kind, **cfg)
    group = tp_group(tp) if tp else None
    W, r = comm.world_size(group), comm.rank(group)
    if kind == "mlp":
        pm = ParallelMLP.from_module(m, group, sequence_parallel=sequence_parallel)
    elif kind == "attn":
        pm = ParallelSelfAttention.from_module(m, group, sequence_parallel=sequence_parallel)
    else:
        pm = ParallelBlock(m, group, sequence_parallel=sequence_parallel, recompute=recompute)
    for layer in pm.modules():
        if isinstance(layer, ColumnParallelLinear):
            layer.save_shard = save_shard
    if sequence_parallel:
        n = x.shape[0] // W
        x, dout = x[r * n:(r + 1) * n], dout[r * n:(r + 1) * n]
    x = x.clone().requires_grad_()
    y = pm(x)
    y.backward(dout)
    if sequence_parallel and sync:
        params = pm.sequence_parallel_params() if kind == "block" else [pm.proj.bias if kind == "attn" else pm.fc2.bias]
        sync_sequence_parallel_grads(params, group)
    return {"out": y.detach(), "dx": x.grad, "grads": {n: p.grad for n, p in pm.named_parameters()},
            "params": {n: p.detach() for n, p in pm.named_parameters()}}


def dtensor(kind: str = "mlp", sequence_parallel: bool = False, tp: int | None = None, **cfg) -> dict:
    """PyTorch's own tensor parallelism (DTensor ``parallelize_module``) on the same ``kind`` ("mlp" or
    "block", no dropout) as :func:`parallel`, returned as :func:`parallel` returns it: the block's
    gradients under the names and in the layout of :class:`.blocks.ParallelBlock` (q, k, v rows of
    this rank's heads stacked as its ``attn.qkv``).  ColwiseParallel ``fc1`` (and ``q``, ``k``, ``v``:
    one Linear each, so that a contiguous shard of rows is this rank's heads), RowwiseParallel ``fc2``
    (and ``proj``); with ``sequence_parallel`` the LayerNorms are SequenceParallel along S (dim 0), each
    Linear pair is entered through an all-gather (PrepareModuleInput: Shard(0) → Replicate) and left
    through a reduce-scatter (RowwiseParallel to Shard(0)), and the block takes and returns its S/W rows."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)
    if cfg.get("dropout_p", 0.0):
        raise ValueError("the DTensor peer runs without dropout (its random streams are not the course's)")
    group = tp_group(tp) if tp else None
    W, r = comm.world_size(group), comm.rank(group)
    mesh = DeviceMesh.from_group(group or torch.distributed.group.WORLD, "cpu")
    m, x, dout = build(kind, **cfg)
    sp = sequence_parallel
    leave = dict(output_layouts=Shard(0), use_local_output=False) if sp else {}
    enter = PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),))
    if kind == "mlp":
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(**leave)}
        inside = Replicate()          # the MLP is entered through the all-gather itself
    elif kind == "block":
        m = _QKVBlock(m)
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(**leave), "mlp.fc1": ColwiseParallel(),
                "mlp.fc2": RowwiseParallel(**leave)}
        inside = Shard(0)             # the residual stream: this rank's S/W rows, as DTensors inside the block
        if sp:
            plan.update({"ln1": SequenceParallel(sequence_dim=0), "ln2": SequenceParallel(sequence_dim=0),
                         "attn": enter, "mlp": enter})
    else:
        raise ValueError(f"no DTensor peer for {kind!r}")
    if sp:                            # takes and returns this rank's S/W rows as plain tensors
        parallelize_module(m, mesh, PrepareModuleInputOutput(
            input_layouts=(Shard(0),), desired_input_layouts=(inside,), output_layouts=(Shard(0),),
            desired_output_layouts=(Shard(0),), use_local_output=True))
    parallelize_module(m, mesh, plan)
    if sp:
        n = x.shape[0] // W
        x, dout = x[r * n:(r + 1) * n], dout[r * n:(r + 1) * n]
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(dout)
    local = {n: _local(p.grad) for n, p in m.named_parameters()}
    if kind == "block":
        for leaf in ("weight", "bias"):
            local[f"attn.qkv.{leaf}"] = torch.cat([local.pop(f"attn.{c}.{leaf}") for c in "qkv"])
    return {"out": _local(y.detach()), "dx": x.grad, "grads": local,
            "partial": sorted(n for n, p in m.named_parameters()
                              if any(pl.is_partial() for pl in getattr(p.grad, "placements", ())))}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part as a plain tensor: a Partial(sum) gradient (a LayerNorm's under
    SequenceParallel: each rank's rows only) summed first, as our sync_sequence_parallel_grads does;
    an asynchronous collective's result waited for."""
    from torch.distributed.tensor import DTensor, Replicate
    if isinstance(t, DTensor):
        if any(pl.is_partial() for pl in t.placements):
            t = t.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in t.placements])
        t = t.to_local()
    return t.wait() if hasattr(t, "wait") else t


def dtensor_mlp(**cfg) -> dict:
    """PyTorch's own tensor parallelism on the same MLP: ColwiseParallel fc1, RowwiseParallel fc2."""
    return dtensor("mlp", **cfg)


class _QKVBlock(torch.nn.Module):
    """:class:`.blocks.Block` (no dropout) with its fused ``qkv`` as three Linears ``q``, ``k``, ``v``:
    what DTensor's ColwiseParallel shards by heads.  The same weights, copied."""

    def __init__(self, block: Block):
        super().__init__()
        import copy
        attn, d = block.attn, block.attn.proj.in_features
        self.ln1, self.ln2, self.mlp = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2), copy.deepcopy(block.mlp)
        self.attn = _QKVAttention(d, attn.heads, dtype=attn.qkv.weight.dtype)
        with torch.no_grad():
            for i, c in enumerate((self.attn.q, self.attn.k, self.attn.v)):
                c.weight.copy_(attn.qkv.weight[i * d:(i + 1) * d])
                c.bias.copy_(attn.qkv.bias[i * d:(i + 1) * d])
            self.attn.proj.load_state_dict(attn.proj.state_dict())

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def vocab(V: int = 12, d: int = 4, tokens: int = 10, seed: int = 0, scale: float = 30.0, ignore: tuple = (3,),
          dtype=torch.float64) -> dict:
    """Vocabulary-parallel embedding and cross-entropy on this rank's vocabulary shard.

    Targets include the first and last id of every shard; ``ignore`` lists tokens given -100.
    """
    torch.manual_seed(seed)
    emb = torch.nn.Embedding(V, d, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V, (tokens,), generator=g)
    logits = (torch.randn(tokens, V, generator=g, dtype=torch.float64) * scale).to(dtype)
    target = vocab_targets(V, tokens, comm.world_size(), seed, ignore)
    dloss = torch.randn(tokens, generator=g, dtype=torch.float64).to(dtype)
    demb = torch.randn(tokens, d, generator=g, dtype=torch.float64).to(dtype)
    W, r = comm.world_size(), comm.rank()
    n = V // W
    pe = VocabParallelEmbedding.from_module(emb)
    e = pe(ids)
    e.backward(demb)
    z = logits[:, r * n:(r + 1) * n].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(z, target)
    loss.backward(dloss)
    return {"emb": e.detach(), "emb_grad": pe.weight.grad, "loss": loss.detach(), "dlogits": z.grad,
            "ids": ids, "logits": logits, "target": target, "dloss": dloss, "demb": demb}


def vocab_targets(V: int, tokens: int, W: int, seed: int = 0, ignore: tuple = ()) -> torch.Tensor:
    """Targets at every shard edge first (ids r·V/W and (r+1)·V/W - 1), then random; ``ignore`` → -100."""
    edges = [i for r in range(W) for i in (r * V // W, (r + 1) * V // W - 1)]
    g = torch.Generator().manual_seed(seed + 2)
    t = torch.randint(0, V, (tokens,), generator=g)
    t[:min(tokens, len(edges))] = torch.tensor(edges[:tokens])
    for i in ignore:
        t[i] = -100
    return t


def timed(kind: str, steps: int = 5, peer: str = "reference", **cfg) -> float:
    """Best seconds of ``steps`` forward+backward of the reference (or DTensor) parallel ``kind``."""
    import torch.distributed as dist
    fn = dtensor_mlp if peer == "dtensor" else parallel
    args = cfg if peer == "dtensor" else dict(kind=kind, **cfg)
    best = float("inf")
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        fn(**args)
        best = min(best, time.perf_counter() - t0)
    return best


class _QKVAttention(torch.nn.Module):
    """Separate q, k, v projections (what DTensor's ColwiseParallel shards by heads) + output projection.
    ``heads``: of the whole module; once ColwiseParallel has cut q, k and v, a rank attends over its
    own (its q has heads/W heads' features)."""

    def __init__(self, d_model: int, heads: int, *, dtype=None):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d_model, d_model, dtype=dtype) for _ in range(3))
        self.proj = torch.nn.Linear(d_model, d_model, dtype=dtype)
        self.heads, self.d_model = heads, d_model

    def forward(self, x):
        from .blocks import attend
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.proj(attend(q, k, v, self.heads * q.shape[-1] // self.d_model))


def bench(kind: str, peer: str, S: int, d_model: int, heads: int, iters: int = 3) -> float:
    """Best seconds of one float32 forward + backward of ``kind`` ("mlp" or "attn"), parallel over the
    world: ``peer`` "reference" (reference.tensor) or "dtensor" (parallelize_module)."""
    import torch.distributed as dist
    torch.manual_seed(0)
    W = comm.world_size()
    x = torch.randn(S, 1, d_model)
    if peer == "reference":
        full = MLP(d_model, 4 * d_model) if kind == "mlp" else SelfAttention(d_model, heads)
        m = ParallelMLP.from_module(full) if kind == "mlp" else ParallelSelfAttention.from_module(full)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (W,))
        if kind == "mlp":
            m = parallelize_module(MLP(d_model, 4 * d_model), mesh,
                                   {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        else:
            m = parallelize_module(_QKVAttention(d_model, heads), mesh,
                                   {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                                    "proj": RowwiseParallel()})
    best = float("inf")
    for _ in range(iters + 1):
        dist.barrier()
        t0 = time.perf_counter()
        xi = x.clone().requires_grad_()
        m(xi).square().mean().backward()
        best = min(best, time.perf_counter() - t0)
    return best


# ----------------------------------------------------------------------------------------------
# Rank functions of the notebook's runs (reference.tensor.lecture), on a world cut into groups of tp


def tp_group(tp: int):
    """This rank's tensor-parallel group when the world is cut into groups of ``tp`` consecutive ranks
    (every rank creates every group, in the same order, as torch.distributed requires)."""
    W, r = comm.world_size(), comm.rank()
    if W % tp:
        raise ValueError(f"a world of {W} ranks cannot be cut into groups of {tp}")
    groups = [comm.new_group(list(range(i, i + tp))) for i in range(0, W, tp)]
    return groups[r // tp]


def _rows(x, tp, group):
    n = x.shape[0] // tp
    r = comm.rank(group)
    return x[r * n:(r + 1) * n]


def mlp_worker(tp: int, sequence_parallel: bool, S: int, d_model: int, d_ff: int) -> dict:
    group = tp_group(tp)
    torch.manual_seed(0)
    mlp = MLP(d_model, d_ff, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(S, 1, d_model, generator=g, dtype=torch.float64)
    dout = torch.randn(S, 1, d_model, generator=g, dtype=torch.float64)
    xs = x.clone().requires_grad_()
    mlp(xs).backward(dout)                                   # single-process ground truth
    pm = ParallelMLP.from_module(mlp, group, sequence_parallel=sequence_parallel)
    xin, dy = (_rows(x, tp, group), _rows(dout, tp, group)) if sequence_parallel else (x, dout)
    xin = xin.clone().requires_grad_()
    y = pm(xin)
    y.backward(dy)
    if sequence_parallel:
        sync_sequence_parallel_grads([pm.fc2.bias], group)
    want_dx = _rows(xs.grad, tp, group) if sequence_parallel else xs.grad
    return {"max_error": float((xin.grad - want_dx).abs().max())}


def block_worker(tp: int, sequence_parallel: bool, S: int, B: int, d_model: int, heads: int, *,
                 dropout_p: float = 0.0, dtype=torch.float64, save_shard: bool = True, recompute: str = "none") -> dict:
    """One block's forward + backward on a group of tp ranks: parameter bytes, the bytes autograd saved
    (parameters excluded; floating-point and boolean) and the matmul FLOPs of forward + backward
    (``torch.utils.flop_counter``; recomputation included).  ``save_shard`` False: the column-parallel
    layers keep their gathered input (:func:`.layers.column_parallel_linear`) under sequence parallelism."""
    from torch.utils.flop_counter import FlopCounterMode
    group = tp_group(tp)
    torch.manual_seed(0)
    block = Block(d_model, heads, dropout_p=dropout_p, dtype=dtype)
    x = torch.randn(S, B, d_model, dtype=torch.float64).to(dtype)
    pb = ParallelBlock(block, group, sequence_parallel=sequence_parallel, recompute=recompute)
    for m in pb.modules():
        if isinstance(m, ColumnParallelLinear):
            m.save_shard = save_shard
    xin = (_rows(x, tp, group) if sequence_parallel else x).clone().requires_grad_()
    params = list(pb.parameters())
    out = {}
    with FlopCounterMode(display=False) as flops:
        act = saved_bytes(lambda: out.setdefault("y", pb(xin)), params)
        trace.emit("backward_start")        # a collective after it that does not say its direction is the backward's
        out["y"].backward(torch.ones_like(out["y"]))
    return {"param_bytes": sum(p.numel() * p.element_size() for p in params), "activation_bytes": act,
            "flops": flops.get_total_flops()}


def vocab_worker(tp: int, tokens: int, V: int, scale: float) -> dict:
    group = tp_group(tp)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(tokens, V, generator=g, dtype=torch.float64) * scale
    target = torch.randint(0, V, (tokens,), generator=g)
    n = V // tp
    r = comm.rank(group)
    loss = vocab_parallel_cross_entropy(logits[:, r * n:(r + 1) * n], target, group)
    want = F.cross_entropy(logits, target, reduction="none")
    return {"loss": loss, "want": want}
