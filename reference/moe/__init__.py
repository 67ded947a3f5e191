"""Lecture 5b — the expert axis: GShard top-2 and Switch top-1 routing, capacity and dropped
tokens, expert parallelism over all-to-all, and gradient synchronisation with data parallelism.

    routing    top_k_gating, expert_capacity, load_balancing_loss, router_z_loss
    layer      MoELayer: the single-process layer (ground truth, loop over experts)
    parallel   dispatch / combine (padded, GShard-style) and the dropless variable-split path,
               differentiable all-to-all, ExpertParallelMoE
    grad_sync  sync_moe_gradients: expert parallelism combined with data parallelism
    workers    rank functions (EP vs single process, EP×DP, the notebook's routing and training runs)
    oracles    the grader's single-process truths
    lecture    the notebook's recorded runs

Read them in that order.
"""
from .grad_sync import sync_moe_gradients
from .layer import Expert, MoELayer
from .parallel import ExpertParallelMoE, all_to_all, combine, combine_dropless, dispatch, dispatch_dropless
from .routing import expert_capacity, gshard_random_routing, load_balancing_loss, router_z_loss, top_k_gating

__all__ = ["expert_capacity", "top_k_gating", "load_balancing_loss", "router_z_loss", "gshard_random_routing",
           "Expert", "MoELayer", "all_to_all", "dispatch", "combine", "dispatch_dropless", "combine_dropless",
           "ExpertParallelMoE", "sync_moe_gradients"]
