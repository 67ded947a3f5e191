"""The production twin of lecture 5b's MoE layer: torchtitan's ``MoE`` (PyPI ``torchtitan`` 0.3.0) on CPU, with
the same weights as :class:`reference.moe.MoELayer` — values first, then speed (not a test; ``make bench`` row).

    .venv/bin/python benchmarks/moe_twin.py            # installs the peer into benchmarks/.peers on first use

What it takes to run on CPU (measured, torch 2.13.0, Python 3.11):

* ``pip install --no-deps --target benchmarks/.peers torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring_parser``
  (``--no-deps`` keeps the course's torch; torchtitan's other requirements — datasets, wandb, tensorboard,
  torchdata … — are never imported by its MoE);
* its token dispatcher imports ``torchtitan.distributed.minimal_async_ep``, whose kernels import ``triton``
  (the GPU compiler, a 1 GB wheel) at import time: ``ModuleNotFoundError: No module named 'triton'``.  The
  CPU path never calls them, so :func:`_gpu_kernels_stand_in` puts a stand-in for that one package in
  ``sys.modules`` before the import (with triton 3.9.0 installed the import works too: we tried);
* its experts are SwiGLU without biases and cast to bfloat16 inside ``GroupedExperts.forward`` (weights and
  tokens), so it is compared with our layer's SwiGLU experts (``activation="swiglu"``) in float32 within
  bfloat16's rounding (``TOLERANCE``, relative to the largest value), with the same top-k choices;
* expert parallelism (its ``AllToAllTokenDispatcher`` over a DeviceMesh) is not compared: one process here,
  the course's own expert-parallel layer is held equal to its one-process layer by the tests.

Megatron-Core's MoE layer was tried too (``megatron-core`` 0.16.1, the last for Python 3.11; ``--no-deps``;
gloo, 1 rank, local spec, no TransformerEngine): ``parallel_state.initialize_model_parallel`` works on CPU
(and ``tests/test_mesh.py`` holds our groups equal to its ``RankGenerator``), but its ``MoELayer`` does not
run: with the ``alltoall`` dispatcher its constructor calls ``torch.cuda.Stream()`` (token_dispatcher.py:445,
"torch.cuda.Stream requires CUDA support"); with ``allgather`` the forward moves the router's weight to
``torch.cuda.current_device()`` (router.py:90, "Torch not compiled with CUDA enabled").
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

import peers  # noqa: E402  (benchmarks/peers.py)
import torch  # noqa: E402

from reference.moe import MoELayer  # noqa: E402

PACKAGES = ["torchtitan==0.3.0", "spmd_types==0.2.3", "tyro==1.0.17", "docstring_parser==0.18.0"]


def _gpu_kernels_stand_in() -> None:
    """torchtitan's GPU-only all-to-all (``torchtitan.distributed.minimal_async_ep``, whose kernels import
    ``triton`` at import time) replaced by a module whose functions refuse to run: the CPU path never calls
    them.  (A stand-in ``triton`` would not do: torch itself then believes triton is installed.)"""
    name = "torchtitan.distributed.minimal_async_ep"
    if name in sys.modules:
        return

    def refuse(*args, **kwargs):
        raise RuntimeError("torchtitan's minimal_async_ep needs CUDA and triton (not on this CPU run)")

    mod = types.ModuleType(name)
    for fn in ("combine_op", "dispatch_op", "init_buffer", "maybe_update_minimal_async_ep_config"):
        setattr(mod, fn, refuse)
    mod.MinimalAsyncEPDispatchMetadata = type("MinimalAsyncEPDispatchMetadata", (), {})
    sys.modules[name] = mod
    sys.modules[name + ".api"] = mod


def load_peer(install: bool = True) -> bool:
    """True when torchtitan's MoE imports (installing it into benchmarks/.peers if allowed)."""
    _gpu_kernels_stand_in()
    return peers.ensure("torchtitan.models.common.moe", PACKAGES, install=install, first=False)


def twin(layer: MoELayer):
    """torchtitan's ``MoE`` with ``layer``'s router, experts and shared experts (SwiGLU, no biases)."""
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import MoE, GroupedExperts, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
    d, f, E, k = layer.d_model, layer.d_ff, layer.num_experts, layer.k
    shared = None
    if layer.shared_experts:
        fs = layer.shared_experts * f
        shared = FeedForward.Config(w1=Linear.Config(in_features=d, out_features=fs),
                                    w2=Linear.Config(in_features=fs, out_features=d),
                                    w3=Linear.Config(in_features=d, out_features=fs))
    cfg = MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=d, hidden_dim=f, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=k)),
        router=TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=d, out_features=E),
                                            top_k=k, score_func=layer.router_kind, route_norm=k > 1),
        load_balance_coeff=None, shared_experts=shared)
    moe = cfg.build()
    with torch.no_grad():
        moe.router.gate.weight.copy_(layer.router.weight)
        inner = moe.routed_experts.inner_experts
        inner.w1_EFD.copy_(torch.stack([e.w1.weight for e in layer.experts]))
        inner.w2_EDF.copy_(torch.stack([e.w2.weight for e in layer.experts]))
        inner.w3_EFD.copy_(torch.stack([e.w3.weight for e in layer.experts]))
        if shared is not None:
            for w in ("w1", "w2", "w3"):
                getattr(moe.shared_experts, w).weight.copy_(getattr(layer.shared, w).weight)
    return moe.to(next(layer.parameters()).dtype)


def compare(*, d_model: int = 64, d_ff: int = 32, num_experts: int = 16, k: int = 4, tokens: int = 256,
            router: str = "sigmoid", shared_experts: int = 1, seed: int = 0) -> dict:
    """Forward and backward of ours (float32) and the twin (float32 around experts it runs in bfloat16) on the
    same tokens and upstream gradient: the largest difference of the output, the input gradient, the router's
    and the experts' first weight gradients, each relative to the largest value of the twin's."""
    torch.manual_seed(seed)
    ours = MoELayer(d_model, d_ff, num_experts, k=k, dropless=True, router=router, shared_experts=shared_experts,
                    activation="swiglu", experts_impl="grouped")
    theirs = twin(ours)
    x, g = torch.randn(tokens, d_model), torch.randn(tokens, d_model)
    xa, xb = x.clone().requires_grad_(), x.clone().unsqueeze(0).requires_grad_()
    y, _ = ours(xa)
    y.backward(g)
    z = theirs(xb)[0]
    z.backward(g)
    rel = lambda a, b: float((a.detach().float() - b.detach().float()).abs().max() / b.detach().float().abs().max())  # noqa: E731, E501
    return {"output": rel(y, z), "input_grad": rel(xa.grad, xb.grad[0]),
            "router_grad": rel(ours.router.weight.grad, theirs.router.gate.weight.grad),
            "experts_w1_grad": rel(torch.stack([e.w1.weight.grad for e in ours.experts]),
                                   theirs.routed_experts.inner_experts.w1_EFD.grad),
            "same_choices": bool(torch.equal(*[m.topk(k).indices.sort(-1).values for m in (
                torch.sigmoid(x @ ours.router.weight.T) if router == "sigmoid" else (x @ ours.router.weight.T),
                theirs.router(xb)[2][0])]))}


def speed(*, d_model: int, d_ff: int, num_experts: int, k: int, tokens: int, reps: int) -> dict:
    """Median seconds of forward + backward, float32, one thread, interleaved: ours (grouped GEMM, float32)
    and the twin (grouped GEMM in bfloat16)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ours = MoELayer(d_model, d_ff, num_experts, k=k, dropless=True, router="sigmoid", activation="swiglu",
                    experts_impl="grouped")
    theirs = twin(ours)
    x = torch.randn(tokens, d_model, requires_grad=True)
    steps = {"ours": lambda: ours(x)[0].square().mean().backward(),
             "torchtitan": lambda: theirs(x.unsqueeze(0)).square().mean().backward()}
    times = {name: [] for name in steps}
    for name, step in steps.items():
        step()                                 # warm-up
    for _ in range(reps):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


TOLERANCE = 2e-2        # relative to the largest value: bfloat16 has an 8-bit mantissa (2^-8 ≈ 0.4 %)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args(argv)
    pair = "MoE layer (SwiGLU, sigmoid top-4 of 16, 1 shared) vs torchtitan MoE, one process"
    if args.no_peer or not load_peer(install=True):
        return [dict(pair=pair, error="peer missing: could not install torchtitan into benchmarks/.peers")]
    diffs = compare()
    print("   ours (float32) vs torchtitan (experts in bfloat16), relative to the largest value: "
          + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items() if k != "same_choices")
          + f"; the same top-k choices: {diffs['same_choices']}")
    worst = max(v for k, v in diffs.items() if k != "same_choices")
    if worst > TOLERANCE or not diffs["same_choices"]:
        return [dict(pair=pair, error=f"values differ: {worst:.3g} of the largest value > {TOLERANCE}")]
    size = dict(d_model=128, d_ff=64, num_experts=32, k=4, tokens=2048) if args.quick else \
        dict(d_model=256, d_ff=128, num_experts=64, k=8, tokens=4096)
    t = speed(**size, reps=3 if args.quick else 5)
    n = size["tokens"]
    print(f"   d={size['d_model']} f={size['d_ff']} E={size['num_experts']} k={size['k']}, {n} tokens: ours "
          f"{t['ours'] * 1e3:.1f} ms, torchtitan {t['torchtitan'] * 1e3:.1f} ms per forward + backward")
    return [dict(pair=f"{pair}, d={size['d_model']} E={size['num_experts']} k={size['k']}", ours=n / t["ours"],
                 peer=n / t["torchtitan"], unit="tok/s", ratio=t["torchtitan"] / t["ours"], target=None,
                 note=f"values equal within {worst:.1e} (bf16 experts: tolerance {TOLERANCE:g})")]


def rows(quick: bool = True, peer: bool = True) -> list[dict]:
    return main((["--quick"] if quick else []) + ([] if peer else ["--no-peer"]))


if __name__ == "__main__":
    main()
