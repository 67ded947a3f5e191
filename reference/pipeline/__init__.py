"""Lecture 4b — the pipeline axis: stages, micro-batches and schedules (GPipe, 1F1B, interleaved, ZB-H1).

Read in this order: :mod:`.schedules` (the orders as pure data, their slot timelines and bubbles),
:mod:`.stages` (cutting a model into contiguous stages), :mod:`.executor` (running an order on real
ranks: activations forward, gradients back, one traced span per F/B/W); then :mod:`.workers` (rank
functions for ``reference.launch.run_world``), :mod:`.oracles` (the single-process truth) and
:mod:`.lecture` (the notebook's runs).

Conventions: p stages (one per rank), m micro-batches, v model chunks per rank (interleaved only);
chunk c on rank r is virtual stage c·p + r.  Papers: GPipe arXiv:1811.06965, PipeDream
arXiv:1806.03377, PipeDream-Flush arXiv:2006.09503, Megatron-LM arXiv:2104.04473, Zero Bubble
arXiv:2401.10241.
"""
from .executor import (Link, actions_from_trace, backward_input_step, backward_step, backward_weight_step, forward_step,
                       infer_shapes, peak_stashed_from_trace, run_pipeline, wall_clock_bubble)
from .schedules import (SCHEDULES, Action, bubble_fraction, gpipe, interleaved_one_f_one_b, measured_bubble,
                        one_f_one_b, peak_stash, render, schedule, simulate, validate_actions, zb_h1)
from .stages import balanced_sizes, chunks_of_rank, parameter_names, split_model

__all__ = ["SCHEDULES", "Action", "schedule", "gpipe", "one_f_one_b", "interleaved_one_f_one_b", "zb_h1",
           "validate_actions", "simulate", "measured_bubble", "bubble_fraction", "peak_stash", "render",
           "balanced_sizes", "split_model", "chunks_of_rank", "parameter_names",
           "Link", "forward_step", "backward_step", "backward_input_step", "backward_weight_step", "infer_shapes",
           "run_pipeline", "actions_from_trace", "peak_stashed_from_trace", "wall_clock_bubble"]
