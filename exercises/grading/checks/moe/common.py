"""Shared by the checks of lecture 5b: where their harness and ground truth live, and the routing keys."""
from __future__ import annotations

H = "exercises.grading.harness.moe"
REF = "reference.moe"
ORACLES = "reference.moe.oracles"

KEYS = ("probs", "expert_index", "weight", "kept", "slot")

# Every given function of reference.moe.routing but the sizes (expert_capacity, router_dtype) is switched
# off while 5b.1 and 5b.2 are graded: the GShard variant and the z-loss, and lecture 5b §8's frontier
# routing — top_k_routing returns top_k_gating's dict (with the defaults it IS 5b.1's answer),
# sequence_balance_loss is load_balancing_loss per sequence, and the node limit, the sequence ids and the
# loss-free bias step are its pieces; no check of 5b.1 or 5b.2 needs them.
ROUTING_MIRRORS = tuple(f"reference.moe.routing:{f}" for f in (
    "gshard_random_routing", "router_z_loss", "top_k_routing", "sequence_balance_loss", "node_limited_mask",
    "check_node_limit", "sequence_ids", "loss_free_bias_update"))
