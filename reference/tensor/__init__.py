"""Lecture 4a — the tensor axis: cut inside a layer's matrices (Megatron-LM, arXiv:1909.08053).

    regions   f and g (copy_to_tensor_region / reduce_from_tensor_region), scatter/gather, and the
              sequence-parallel all-gather / reduce-scatter pair (arXiv:2205.05198)
    layers    ColumnParallelLinear, RowParallelLinear (from_linear) and their functional forms;
              LinearWithSequenceParallelGather (sequence parallelism saving x's shard, not the gathered x)
    blocks    ParallelMLP, ParallelSelfAttention, ParallelBlock (from_module), dropout streams,
              sync_sequence_parallel_grads, activation recomputation (ParallelBlock(recompute=))
    vocab     VocabParallelEmbedding, vocab_parallel_cross_entropy
    costs     bytes on the wire per collective, counted from a trace; Korthikanti et al.'s activation memory
    workers   rank functions: the tests, the grader, the notebook and the full course's benchmarks/tensor_parallel.py
              run them
    lecture   the notebook's recorded runs

Read them in that order.
"""
from .blocks import (MLP, Block, ParallelBlock, ParallelMLP, ParallelSelfAttention, SelfAttention,
                     sync_sequence_parallel_grads)
from .layers import (ColumnParallelLinear, LinearWithSequenceParallelGather, RowParallelLinear, column_parallel_linear,
                     linear_shard, linear_with_sequence_parallel_gather, row_parallel_linear)
from .regions import (copy_to_tensor_region, gather_from_sequence_region, gather_from_tensor_region,
                      reduce_from_tensor_region, reduce_scatter_to_sequence_region, scatter_to_tensor_region)
from .vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy, vocab_range

__all__ = ["copy_to_tensor_region", "reduce_from_tensor_region", "scatter_to_tensor_region",
           "gather_from_tensor_region", "gather_from_sequence_region", "reduce_scatter_to_sequence_region",
           "linear_shard", "column_parallel_linear", "row_parallel_linear", "LinearWithSequenceParallelGather",
           "linear_with_sequence_parallel_gather", "ColumnParallelLinear",
           "RowParallelLinear", "MLP", "SelfAttention", "Block", "ParallelMLP", "ParallelSelfAttention",
           "ParallelBlock", "sync_sequence_parallel_grads", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "vocab_range"]
