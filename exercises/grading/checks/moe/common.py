"""Shared by the checks of lecture 5b: where their harness and ground truth live, and the routing keys."""
from __future__ import annotations

H = "exercises.grading.harness.moe"
REF = "reference.moe"
ORACLES = "reference.moe.oracles"

KEYS = ("probs", "expert_index", "weight", "kept", "slot")
