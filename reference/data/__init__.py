"""Lecture 3 — the data axis: data parallelism from scratch, gradient accumulation, ZeRO-1/2/3.

    replicas  what every rank must agree on: unique parameters, a shape check, bytes held
    ddp       all_reduce_gradients (3.1); buckets, grad_ready, finish_buckets (3.2); DataParallel
    zero      zero_step (3.3); ZeroOptimizer, stages 1 and 2
    fsdp      gather_full_params, reduce_scatter_grad (3.4); FullyShardedDataParallel (stage 3)
    models    TinyMLP, TinyBlock: small models with a tied and a frozen parameter
    workers   rank functions: training runs for the tests, the grader and the benchmark (ours,
              PyTorch's, one process), and the rank side of the notebook's runs
    lecture   the notebook's recorded runs

Read them in that order.
"""
from .ddp import Bucket, DataParallel, all_reduce_gradients, assign_buckets, finish_buckets, grad_ready
from .fsdp import FullyShardedDataParallel, gather_full_params, reduce_scatter_grad
from .zero import ShardBuckets, ZeroOptimizer, shard_size, zero_step

__all__ = ["all_reduce_gradients", "Bucket", "assign_buckets", "grad_ready", "finish_buckets", "DataParallel",
           "shard_size", "zero_step", "ZeroOptimizer", "ShardBuckets", "gather_full_params", "reduce_scatter_grad",
           "FullyShardedDataParallel"]
