"""Lecture 5a — the sequence axis: blockwise attention, Ring Attention, Ulysses and USP.

Read in this order: :mod:`.layouts` (who holds which tokens), :mod:`.blockwise` (attention one
block at a time and the merge), :mod:`.ring` (forward and backward around a ring),
:mod:`.ulysses` (all-to-all between sequence and head sharding), :mod:`.usp` (both at once),
:mod:`.scaling` (a timeline model of ring, Ulysses and all-gather attention vs W, in the α–β model).
Tensors are (batch, heads, seq, head_dim), as in ``scaled_dot_product_attention``.
"""
from .blockwise import (attention_block, attention_block_backward, attention_block_backward_explicit,
                        attention_block_explicit, blockwise_attention, causal_pairs, merge_attention)
from .layouts import LAYOUTS, chunk_ids, num_chunks, positions, shard_sequence, unshard_sequence
from .ring import block_plan, ring_attention, ring_attention_backward, ring_attention_forward, tile_kind
from .ulysses import heads_to_seq, seq_to_heads, ulysses_attention
from .usp import usp_attention, usp_groups, usp_shard, usp_unshard

__all__ = ["LAYOUTS", "shard_sequence", "unshard_sequence", "chunk_ids", "num_chunks", "positions",
           "attention_block", "attention_block_explicit", "attention_block_backward",
           "attention_block_backward_explicit", "merge_attention", "blockwise_attention", "causal_pairs",
           "ring_attention_forward", "ring_attention_backward", "ring_attention", "block_plan", "tile_kind",
           "seq_to_heads", "heads_to_seq", "ulysses_attention",
           "usp_attention", "usp_groups", "usp_shard", "usp_unshard"]
