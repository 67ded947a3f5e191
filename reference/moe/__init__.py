"""Lecture 5b — the expert axis: GShard top-2 and Switch top-1 routing, capacity and dropped
tokens, expert parallelism over all-to-all, and gradient synchronisation with data parallelism.

    routing    top_k_gating (and top_k_routing: sigmoid, loss-free bias, node limit), expert_capacity,
               load_balancing_loss (and per sequence), router_z_loss, loss_free_bias_update
    experts    Expert / SwiGLUExpert, run_experts: a loop over experts or one grouped GEMM
    layer      MoELayer: the single-process layer (ground truth): fine-grained, shared experts, balances
    parallel   dispatch / combine (padded, GShard-style) and the dropless variable-split path,
               differentiable all-to-all, ExpertParallelMoE
    overlap    the dropless all-to-all in two halves hidden behind the experts; hidden_fraction
    placement  the node of each expert; bytes crossing nodes, from the grid and from a trace
    grad_sync  sync_moe_gradients: expert parallelism combined with data parallelism
    workers    rank functions (EP vs single process, EP×DP, the notebook's routing and training runs)
    oracles    the grader's single-process truths
    lecture    the notebook's recorded runs

Read them in that order.
"""
from .experts import Expert, SwiGLUExpert, make_expert, run_experts
from .grad_sync import sync_moe_gradients
from .layer import BALANCES, MoELayer
from .parallel import ExpertParallelMoE, all_to_all, combine, combine_dropless, dispatch, dispatch_dropless
from .routing import (expert_capacity, gshard_random_routing, load_balancing_loss, loss_free_bias_update,
                      node_limited_mask, router_z_loss, sequence_balance_loss, sequence_ids, top_k_gating,
                      top_k_routing)

__all__ = ["expert_capacity", "top_k_gating", "load_balancing_loss", "router_z_loss", "gshard_random_routing",
           "top_k_routing", "sequence_balance_loss", "loss_free_bias_update", "node_limited_mask", "sequence_ids",
           "Expert", "SwiGLUExpert", "make_expert", "run_experts", "MoELayer", "BALANCES", "all_to_all", "dispatch",
           "combine", "dispatch_dropless", "combine_dropless", "ExpertParallelMoE", "sync_moe_gradients"]
