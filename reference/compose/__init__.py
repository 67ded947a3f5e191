"""Lecture 5c — four axes, composed: the tiny GPT trained on one rank grid, exactly as one process.

Read in this order: :mod:`.parallel_gpt` (this rank's piece of the model: which layer of which
lecture cuts each parameter, and which group averages its gradient), :mod:`.train` (the step:
data slices, pipeline, gradient synchronisation, Adam; the bytes each axis moves, measured and
by formula), :mod:`.estimate` (a planner's estimate of one rank's bytes: exercise 5c.3),
:mod:`.zero` (ZeRO-1/2 over the dp_cp ranks, lecture 3's optimizer), :mod:`.clip` (global-norm
gradient clipping: each parameter's squares counted once on the grid), :mod:`.workers` (rank
functions for ``run_world``), :mod:`.lecture` (the notebook's recorded runs), then
``scripts/train_composed.py`` (the same under ``torchrun``).  :mod:`.checkpoint` (what each rank
holds, as slices of the single-process tensors: save on one grid, resume on another) and
:mod:`.checkpoint_files` (the same through torch.distributed.checkpoint: atomic, checksummed,
refused on every rank when it does not fit) are imported on demand (``from reference.compose import
checkpoint``): DCP takes half a second to import.  :mod:`.cases` computes what exercises
5c.2 and 5c.3 are checked on; :mod:`.memory` and :mod:`.peers` hold the run against the planner and DDP.

Every axis is the lecture's own layer, reused: tensor (reference.tensor), context
(reference.sequence.ring_attention), expert (reference.moe), pipeline (reference.pipeline),
data (reference.moe.sync_moe_gradients / the dp_cp all-reduce); the grid is reference.mesh.RankGrid.
"""
from .clip import clip_grad_norm_, global_grad_norm
from .estimate import step_bytes
from .parallel_gpt import (SIZE_KEYS, AuxLossAutoScaler, ComposedBlock, ContextParallelAttention, ExpertParallelMLP,
                           ParallelGPT, Shard, check_sizes, full_state_dict, padded_vocab)
from .train import (axis_of, expected_bytes, global_loss, local_batch, measured_bytes, param_counts, sync_gradients,
                    train_step)
from .workers import Adam, build, fit, make_optimizer, size_errors, train_worker
from .zero import ComposedZero, zero_bytes

__all__ = ["SIZE_KEYS", "ParallelGPT", "ComposedBlock", "ContextParallelAttention", "ExpertParallelMLP",
           "AuxLossAutoScaler", "Shard",
           "check_sizes", "padded_vocab", "full_state_dict", "local_batch", "sync_gradients", "train_step",
           "step_bytes", "global_loss", "axis_of", "measured_bytes", "param_counts", "expected_bytes", "build", "fit",
           "train_worker", "size_errors", "Adam", "make_optimizer", "ComposedZero", "zero_bytes", "clip_grad_norm_",
           "global_grad_norm"]
