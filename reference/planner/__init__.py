"""Lecture 5c — the parallelism planner: where does a model run out of room, and what composition fixes it?

Read in this order: :mod:`.model` (the three inputs, and the course's tiny GPT described with them),
:mod:`.counts` (the formulas below, one device at a time), :mod:`.plan` (one composition's plan),
:mod:`.search` (every composition, ranked, and why one beats another).  The time from first
principles: :mod:`.hardware` (GPU presets, every figure cited), :mod:`.kernels` (a GEMM's time from its
shape, attention's core, element-wise bytes), :mod:`.collectives` (α + bytes/β, and the experts' all-to-all
by where its group sits), :mod:`.placement` (which groups share a node: the dense grid and the expert grid
folded over it), :mod:`.layout` (stage layouts, schedules, activations in flight), :mod:`.experts` (a MoE
layer's router, permutation, grouped GEMMs and all-to-alls), :mod:`.overlap` (what overlapping tp's
collectives with the GEMMs costs), :mod:`.timing` (the step).  :mod:`.runs` and :mod:`.sparse_runs` hold the
published runs the planner is checked against (the full course's ``benchmarks/planner.py`` prints the tables);
:mod:`.published` the worked examples (Llama 3, GShard, DeepSeek-V3).  Every name is importable from
``reference.planner``.

Pure arithmetic on three dataclasses: a :class:`Model`, a :class:`Cluster` and a
:class:`Composition` (dp × tp × pp × cp, ep and etp for the experts, ZeRO stage, recomputation,
micro-batches).  :func:`plan` gives a :class:`Plan`: memory per device, bytes per step per axis
and their time on the links the rank grid puts them on, the pipeline bubble, the compute time, an
estimated step time and the resource that runs out first.  :func:`search` tries every composition
that fits and ranks them by estimated step time.  Symbols (Korthikanti et al. arXiv:2205.05198):

    s sequence length   b micro-batch (sequences)   h hidden   a heads   L layers   V vocabulary
    t tp   p pp   c cp   d dp   e ep   m micro-batches per step   Ψ parameters (of one device)

Memory per device (bytes)
    model states (ZeRO arXiv:1910.02054, mixed-precision Adam: 2 + 2 + K bytes, K = 12):
        stage 0  (2 + 2 + K)·Ψ      stage 1  (2 + 2)·Ψ + K·Ψ/N      stage 2  2·Ψ + (2 + K)·Ψ/N
        stage 3  (2 + 2 + K)·Ψ/N    N = dp·cp for dense parameters, edp = tp·cp·dp/(etp·ep) for experts
      Ψ counts what the device holds: its layers' matrices (and the biases of column-parallel
      layers) ÷ t, the norms, the biases after row-parallel layers and the router whole (every
      tensor rank holds a copy), its stage's embedding and head rows (the vocabulary padded to a
      multiple of t, as Megatron does) and position table / final norm; experts ÷ (e·etp).
    activations per layer (Korthikanti §4, fp16, with dropout):
        s·b·h·34 + 5·a·s²·b                       no parallelism
        s·b·h·(10 + 24/t) + 5·a·s²·b/t            tensor parallel
        (s·b·h·34 + 5·a·s²·b)/t                   tensor + sequence parallel
        s·b·h·34/t                                + selective recomputation (or flash attention)
        2·s·b·h/t                                 full recomputation (layer inputs only)
      with context parallelism every s·b·h term uses s/c and the score term a·(s/c)·s·b; 1F1B
      keeps min(m, p − stage) micro-batches of the stage's layers alive (the first stage: min(m, p));
      interleaved, 2(p−k−1) + (v−1)·p + 1 chunk-forwards (Korthikanti §4.2.3, :mod:`.layout`).
      MoE layers: the experts' FFN internals for k·cf·s·b tokens, and the dispatched tokens (the
      experts' input) and the experts' output (for the gate's gradient), k·cf·s·b·h each.
      ``Model.stats_bytes`` > 0 also counts what Korthikanti leaves out: the norms' per-token
      statistics (LayerNorm mean and 1/σ, RMSNorm 1/rms), flash attention's log-sum-exp (a per
      token) and the router's probabilities and gate weights (E + k per token).
    output layer ("logits", last stage; Korthikanti §4.3): the final norm's and the head's inputs
      (s·b·h each, ÷ t with SP) and the loss's logits, loss_bytes·s·b·V/t (fp32); the first stage
      adds the embedding's dropout mask (s·b·h, ÷ t with SP).
Communication per device per step (ring algorithms; what one device sends)
    dp    gradient all-reduce 2(N−1)/N · Ψ · bytes (ZeRO-1/2 the same: reduce-scatter + all-gather;
          ZeRO-3 1.5×: parameters gathered again for the backward)
    tp    per micro-batch, each an all-reduce (or all-gather + reduce-scatter with SP, the same
          bytes) of 2(t−1)/t · s·b·h/c · bytes: 4 per dense layer (6 with full recomputation),
          2 + 2·k·cf per MoE layer (each expert is cut over tp like the MLP: f and g on its
          k·cf·s·b rows at perfect balance), 1 for the vocabulary-parallel embedding (first
          stage), 1 for the head and 3 all-reduces of one number per token for the vocabulary-
          parallel cross-entropy (last stage, loss_bytes each); with SP, once per step, the
          all-reduce of the replicated parameters' gradients (each tp rank saw s/t rows); with SP
          and the s·b·h/t shard saved (not ``Model.sp_saves_gathered``), each column-parallel layer
          (qkv, fc1 of a dense layer, the head) all-gathers its input again in the backward: half
          an all-reduce each (hidden behind the dX GEMM in the time model, as Megatron-Core does)
    pp    one activation forward and one gradient back per micro-batch per stage boundary
    cp    ring attention: K and V blocks pass c−1 times forward, K,V and dK,dV c−1 times backward
    ep    4 all-to-alls per MoE layer per micro-batch (dispatch, combine, and their backward; 6 with full
          recomputation), each sending (e−1)/e of k·cf·tokens·h (cf 1 dropless: the mean); ``Plan.ep_payload``
          is what the dispatch and the combine's backward are handed, k·cf·tokens·h each, routing-independent
    etp   with experts cut over etp ≠ tp ranks: an all-gather and a reduce-scatter of etp·k·cf·tokens·h per
          MoE layer each way (etp = tp: counted with tp, the same ranks)
Time, first principles (a cluster with its device figures, e.g. ``Cluster.preset("a100-80gb-sxm", n)``,
and no ``mfu``): kernels from their shapes on a roofline, each collective and message α + bytes/β,
exposed communication per axis with an overlap switch each, the bubble of GPipe, 1F1B, interleaved
1F1B and ZB-H1, recomputation by granularity, MFU and HFU — :mod:`.timing` states the equations.
Time, simple (a hand-made Cluster, or ``mfu`` given):
compute = FLOPs / (devices · peak · MFU), FLOPs = (6·N_active + 6·L·s·h)·tokens (Kaplan et al.
arXiv:2001.08361; 8 instead of 6 with full recomputation: one more forward), stretched by the bubble (p−1)/(v·m + p−1);
tp, pp and ep traffic is in the critical path; dp traffic overlaps the backward (2/3 of the
compute) and cp traffic the attention compute (6·L·s·h per token): only what exceeds them is exposed.
A group's link is the intra-node one if the rank grid
(:mod:`.placement`, the arithmetic of ``reference.mesh.RankGrid``, with the experts' grid folded over each
stage) keeps every group of that axis inside a node, else the inter-node one.

Which device.  ``plan(..., stage=k)`` describes the ranks of pipeline stage k (layers split as
``reference.pipeline.balanced_sizes``: contiguous, larger stages first; layer i is a MoE layer when
i % moe_every = moe_every − 1).  The default, ``stage=None``, takes every entry from the stage
where it is largest (states from the stage with the most parameters, activations from the first,
the output layer from the last, bytes per axis from the busiest stage): an upper bound for every
device.

Bytes are what one device SENDS with the ring algorithms above; ``reference.trace`` records the
payload a rank hands to each collective (an all-reduce of n bytes is one event of n bytes), so a
comparison with a measured run converts with the same 2(N−1)/N factors.

Validated on the tiny GPT (the full course's ``tests/planner/test_measured.py``, :func:`tiny_gpt`, real gloo runs):
bytes per axis per step exactly, parameters, gradients and optimizer state exactly, activations
within a few per cent (``reference.compose.memory`` says what is not counted).

Sparse models (:mod:`.model`): an expert's own FFN size, shared experts (cut over tp like the MLP), dense first
layers, latent attention (its down projections whole on every tensor rank), dropless routing whose busiest
device carries ``load_imbalance`` of the mean (:func:`routed_rows`) or buffers padded to a capacity factor; the
expert grid etp × ep × edp folded over each stage's tp·cp·dp ranks (experts' states sharded over edp).

Not counted: temporary buffers, communication buckets, allocator fragmentation, the CUDA context
(a preset keeps ``Cluster.memory_margin`` free for them instead), integer and boolean tensors saved
for the backward (ids, routing indices, masks other than dropout's), activations FP8 training keeps in
FP8 (counted at ``act_bytes``: an upper bound); in the time model, the SMs NCCL's kernels hold while the
data-parallel, pipeline and context-parallel communication overlaps compute, pipeline sends overlapped with
compute (Megatron's ``overlap_p2p_comm``: counted exposed), kernel launch overheads; and in the simple time
model, latency of small messages.
"""
from __future__ import annotations

from .counts import (activation_bytes_per_layer, active_params, all_to_all_bytes, allreduce_bytes, attention_params,
                     bubble_fraction, device_params, model_state_bytes, output_layer_bytes, padded_vocab, param_counts,
                     routed_rows, stage_layers)
from .hardware import PRESETS
from .model import GB, LOAD_IMBALANCE, Cluster, Composition, Model, cpu_cluster, tiny_gpt
from .overlap import TE_DEFAULTS, Overlap, TPOverlap
from .plan import Plan, check_composition, plan, with_sizes
from .search import divisors, expert_grids, explain, explain_mfu, mfu_terms, search, time_terms
from .timing import StepTime, model_flops, optimizer_bytes_per_param

preset = Cluster.preset

__all__ = ["Model", "Cluster", "Composition", "Plan", "param_counts", "active_params", "device_params", "stage_layers",
           "padded_vocab", "model_state_bytes", "activation_bytes_per_layer", "output_layer_bytes", "allreduce_bytes",
           "all_to_all_bytes", "bubble_fraction", "check_composition", "plan", "search", "with_sizes", "tiny_gpt",
           "cpu_cluster", "GB", "PRESETS", "preset", "divisors", "expert_grids", "explain", "explain_mfu", "mfu_terms",
           "time_terms", "StepTime", "model_flops", "optimizer_bytes_per_param", "routed_rows", "attention_params",
           "LOAD_IMBALANCE", "TPOverlap", "Overlap", "TE_DEFAULTS"]
