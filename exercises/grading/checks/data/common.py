"""Shared by the checks of lecture 3: the four exercises, their hints, and the single-process truth."""
from __future__ import annotations

import torch

from ...core import exercise

H = "exercises.grading.harness.data"

# What the learner writes, and what the exercise's ranks switch off (exercises.grading.shortcuts):
# 3.1's answer is one library all-reduce per gradient, and that stays.  The wrappers broadcast the
# replicas' first parameters (given code); the learner's code may not broadcast — what
# ZeroRedundancyOptimizer and DDP's constructor need.
ALLREDUCE = exercise("3.1", "The gradient all-reduce: a mean over ranks", "data", ["all_reduce_gradients"],
                     comm=("all_reduce",))
BUCKETS = exercise("3.2", "Buckets, overlapped with backward", "data",
                   ["assign_buckets", "grad_ready", "finish_buckets"],
                   comm=("all_reduce", "all_gather"), driver_comm=("broadcast",), shortcuts=("ddp",),
                   counted=("all_reduce",))
# 3.3: before the learner's zero_step sees them, the parameters outside this rank's shard are garbage
# (harness.data.garble_outside_shard): only a step that all-gathers the owners' shards is right.
ZERO = exercise("3.3", "A ZeRO-1/2 optimizer step: reduce, update my shard, all-gather", "data", ["zero_step"],
                comm=("all_reduce", "reduce_scatter", "all_gather"), driver_comm=("broadcast",),
                shortcuts=("zero_redundancy_optimizer", "ddp", "fsdp"),
                before={"zero_step": "exercises.grading.harness.data:garble_outside_shard"},
                mirrors=("reference.data.zero:ShardBuckets",))
ZERO3 = exercise("3.4", "ZeRO-3's collectives: gather before use, reduce-scatter the gradient", "data",
                 ["gather_full_params", "reduce_scatter_grad"], comm=("all_gather", "reduce_scatter"),
                 driver_comm=("broadcast",), shortcuts=("fsdp", "zero_redundancy_optimizer"))

T1_31 = ('Every rank must end with the gradient of the MEAN loss over ranks. Which collective gives every rank'
         ' the same total, and what turns a total into a mean?')
T1_32 = ('assign_buckets is one greedy pass in the given order, counting bytes; grad_ready counts a gradient '
         'and posts every complete bucket next in line with comm.all_reduce_async, never waiting; '
         'finish_buckets posts the rest, waits, turns sums into means and puts the gradients back.')
T1_33 = ('Reduce the flat gradient (stage 1 and stage 2 differ here), let the optimizer update only this '
         "rank's shard, then share the updated shards. Which elements does rank r own?")
T1_34 = ("gather_full_params: every rank's shard, in rank order (one all-gather). reduce_scatter_grad: only "
         'your own S elements of the gradient summed over ranks — and as a mean.')


# Hints in tiers: tier 1 is what the stub raises; hint("3.2") shows the next.
HINTS = {
    "3.1": [T1_31,
            "L = (1/N) Σ_r L_r, so ∇L = (1/N) Σ_r ∇L_r: the all-reduce gives the Σ, you give the 1/N.",
            "for p in parameters: if p.grad is not None: comm.all_reduce(p.grad, group=group); then divide "
            "p.grad in place by comm.world_size(group)."],
    "3.2": [T1_32,
            "assign_buckets: keep `filled` (bytes in the current bucket); a parameter starts a new bucket when "
            "the current one is non-empty and filled + its bytes > cap.",
            "grad_ready: collectives match by order, so every rank must post the same buckets in the same order "
            "whatever order its gradients arrive in. After counting, walk the buckets from the first one not yet "
            "posted and stop at the first that is still incomplete; posting one means packing its gradients into "
            "one flat buffer and keeping the handle comm.all_reduce_async returns.",
            "A sketch of finish_buckets: post whatever is still unposted (a missing gradient counts as zeros, so "
            "every rank posts the same collectives); then, bucket by bucket, wait (the wait hands back the summed "
            "buffer), divide by N and unpack each parameter's slice into its .grad (creating it where it is None); "
            "leave every bucket ready for the next step."],
    "3.3": [T1_33,
            "Rank r owns flat elements [r·S, (r+1)·S), S = shard.numel(). Build a flat gradient of N·S zeros and copy "
            "each p.grad at its offset (parameters in order).",
            "stage 1: all-reduce the flat gradient and divide it by N; each p.grad becomes a view of its own "
            "slice of it, and shard.grad the slice rank r owns.  stage 2: reduce-scatter the flat gradient into a "
            "new tensor of S elements, divide it by N, set every p.grad to None and make that tensor shard.grad.",
            "Then step the optimizer you were given (it holds only your shard), all-gather every rank's updated "
            "shard into a new tensor of N·S elements (comm.all_gather_into_tensor), and, under torch.no_grad(), "
            "copy each parameter's slice of it back into the parameter."],
    "3.4": [T1_34,
            "Both work on flat 1-D tensors: gather takes S elements and returns N·S; reduce-scatter takes N·S and "
            "returns S. S is shard.numel() (or flat_grad.numel() // N), and N is comm.world_size(group).",
            "gather: allocate an empty tensor of N·S elements like the shard and all-gather the (detached) shard "
            "into it with comm.all_gather_into_tensor — pass group, and what='params', layer and phase for the "
            "trace — then return it.",
            "reduce-scatter: allocate an empty output of S elements like the flat gradient, reduce-scatter the flat "
            "gradient into it with comm.reduce_scatter_tensor (group, what='grads', layer), and return it divided "
            "by N."],
}


# Ground truth (one process, float64)


def _single(ctx, kind: str, opt: str, W: int, **kw) -> dict:
    from reference.data import workers
    return workers.train("single", kind, opt, world_size=W, **kw)


def _data_seeds(ctx, seed: int, W: int) -> list[int]:
    """A seed of its own for each rank's micro-batches (rank r is sent its own only: no rank can make
    another's batches, so no rank can compute the mean gradient without the others)."""
    return [ctx.seed(1000 * seed + 1 + r) for r in range(W)]


def _compare_params(ctx, res, truth, W, case, start=None, detectors=()):
    """Compare each rank's parameters, or their update (after − ``start``) when ``start`` is given."""
    for r, v in enumerate(res.values):
        for n, want in truth["params"].items():
            got = v["params"].get(n)
            if start is not None and isinstance(got, torch.Tensor):
                got, want = got - start[n], want - start[n]
            ctx.compare(got, want, f"{'update of' if start is not None else 'parameter'} {n}", rank=r, world_size=W,
                        atol=1e-10, rtol=1e-9, case=case, detectors=detectors,
                        extra={"all_got": v["params"], "all_want": truth["params"], "start": start, "name": n})


