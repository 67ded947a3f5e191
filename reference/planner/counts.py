"""The planner's formulas, one device at a time: parameters (by stage, tensor and expert shard),
model states per ZeRO stage, activations per layer (Korthikanti et al.), and the bytes of the ring
collectives and the pipeline bubble.  The symbols are those of the package docstring."""
from __future__ import annotations

from .model import Composition, Model

__all__ = ["param_counts", "active_params", "padded_vocab", "stage_layers", "device_params", "model_state_bytes",
           "activation_bytes_per_layer", "output_layer_bytes", "allreduce_bytes", "all_to_all_bytes",
           "bubble_fraction"]


# ---------------------------------------------------------------------------------- parameters

def param_counts(model: Model) -> dict[str, float]:
    """Parameters by kind (whole model): attention, dense FFN, experts, router, norms, embeddings."""
    h, hd, f = model.hidden, model.hidden // model.heads, model.ffn
    q_kv = (model.heads + 2 * model.kv_heads) * hd                       # Q, K, V outputs (GQA)
    attn = h * q_kv + model.heads * hd * h + (q_kv + h if model.biases else 0)
    mats = 3 if model.gated_ffn else 2
    mlp = mats * h * f + ((mats - 1) * f + h if model.biases else 0)
    moe, dense = model.moe_layers, model.layers - model.moe_layers
    return dict(
        attention=model.layers * attn,
        ffn=dense * mlp,
        experts=moe * model.num_experts * mlp,
        router=moe * h * model.num_experts,
        norms=(model.layers * 2 + (1 if model.final_norm else 0)) * model.norm_params,
        embeddings=model.vocab * h * (1 if model.tied_embeddings else 2)
        + (model.seq_len * h if model.learned_positions else 0),
    )


def active_params(model: Model) -> float:
    """Parameters one token passes through: experts count k of E."""
    c = param_counts(model)
    experts = c["experts"] * model.top_k / model.num_experts if model.num_experts > 1 else 0
    return sum(c.values()) - c["experts"] + experts


def padded_vocab(model: Model, tp: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp`` (Megatron pads it so it splits evenly)."""
    return -(-model.vocab // tp) * tp


def stage_layers(model: Model, pp: int, stage: int) -> tuple[int, int]:
    """(layers, MoE layers) of pipeline stage ``stage``: contiguous, as equal as possible, larger first
    (``reference.pipeline.balanced_sizes``)."""
    q, extra = divmod(model.layers, pp)
    start = stage * q + min(stage, extra)
    n = q + (1 if stage < extra else 0)
    return n, sum(model.is_moe(i) for i in range(start, start + n)) if model.num_experts > 1 else 0


def _stage_params(model: Model, t: int, e: int, n_layers: int, n_moe: int, first: bool, last: bool
                  ) -> tuple[float, float, float]:
    """(dense, expert, replicated-over-tp) parameters of one device of a stage."""
    h, hd, f = model.hidden, model.hidden // model.heads, model.ffn
    q_kv = (model.heads + 2 * model.kv_heads) * hd
    mats = 3 if model.gated_ffn else 2
    attn_split = (h * q_kv + model.heads * hd * h + (q_kv if model.biases else 0)) / t
    mlp_split = (mats * h * f + ((mats - 1) * f if model.biases else 0)) / t
    out_bias = h if model.biases else 0                       # after a row-parallel layer: replicated
    replicated = n_layers * (2 * model.norm_params + out_bias) + (n_layers - n_moe) * out_bias \
        + n_moe * h * model.num_experts                       # norms, proj/fc2 biases, router
    vocab_rows = padded_vocab(model, t) // t * h
    # the word embedding (first) and the head (last): one table when tied and both on this device, none
    # on a middle stage
    embed = vocab_rows * (first + last) if (first != last or not model.tied_embeddings) else vocab_rows * first
    if first and model.learned_positions:
        replicated += model.seq_len * h
    if last and model.final_norm:
        replicated += model.norm_params
    dense = n_layers * attn_split + (n_layers - n_moe) * mlp_split + embed + replicated
    experts = n_moe * model.num_experts // e * (mlp_split + out_bias) if n_moe else 0.0
    return dense, experts, replicated


def device_params(model: Model, comp: Composition, stage: int | None = None) -> tuple[float, float]:
    """(dense, expert) parameters held by one device of pipeline stage ``stage`` (None: of the stage
    holding the most)."""
    p = comp.pp
    best = None
    for k in (range(p) if stage is None else (stage,)):
        n, moe = stage_layers(model, p, k)
        dense, experts, _ = _stage_params(model, comp.tp, comp.ep, n, moe, k == 0, k == p - 1)
        if best is None or dense + experts > sum(best):
            best = (dense, experts)
    return best


def model_state_bytes(psi: float, zero: int, n: int, *, param_bytes: int = 2, grad_bytes: int = 2,
                      optimizer_bytes: int = 12) -> dict[str, float]:
    """Parameters, gradients and optimizer state of ``psi`` parameters with ZeRO ``zero`` over ``n`` ranks."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero}")
    return dict(params=psi * param_bytes / (n if zero >= 3 else 1),
                grads=psi * grad_bytes / (n if zero >= 2 else 1),
                optimizer=psi * optimizer_bytes / (n if zero >= 1 else 1))


# ---------------------------------------------------------------------------------- activations

def activation_bytes_per_layer(model: Model, *, tp: int = 1, cp: int = 1, sequence_parallel: bool = True,
                               recompute: str = "none", flash: bool = False, moe: bool = False) -> float:
    """Bytes of activations one transformer layer keeps for the backward, one micro-batch, per device.

    The accounting of Korthikanti et al. §4, written per stored tensor so that it also covers GQA,
    a gated or non-4h FFN, MoE (k experts' FFN activations per token, × capacity factor, and the
    experts' input and output), no dropout, and context parallelism.  With MHA, FFN 4h, GELU and
    dropout it is exactly ``s·b·h·34 + 5·a·s²·b`` (tested).  ``model.stats_bytes`` > 0 adds the
    per-token statistics Korthikanti leaves out (norms, flash log-sum-exp, router probabilities).
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    s, b, h, a = model.seq_len / cp, model.micro_batch, model.hidden, model.heads
    kv = model.kv_heads * (h // a)
    e, mask = model.act_bytes, (1 if model.dropout else 0)
    sbh = s * b * h
    sp = tp if sequence_parallel else 1
    if recompute == "full":
        return e * sbh / sp
    # replicated across tensor ranks unless sequence parallel: LayerNorm inputs, QKV and FC1 inputs, dropout masks
    replicated = e * 2 * sbh + e * sbh + e * sbh + mask * 2 * sbh
    gathered = 0.0
    if sp > 1 and model.sp_saves_gathered:      # QKV and FC1 inputs kept all-gathered
        replicated, gathered = replicated - 2 * e * sbh, 2 * e * sbh
    # split across tensor ranks: Q, K (for QKᵀ), V, the attention output (proj input), the FFN internals
    ffn_tokens = model.top_k * model.capacity_factor if moe else 1
    ffn_inner = (3 if model.gated_ffn else 2) * e * s * b * model.ffn * ffn_tokens
    split = e * (sbh + s * b * kv) + e * s * b * kv + e * sbh + ffn_inner
    if moe:     # the dispatched tokens (the experts' input) and the experts' output (the gate's gradient)
        replicated += 2 * e * ffn_tokens * sbh
    scores = 0.0
    if recompute == "none" and not flash:       # softmax output, dropout mask, dropout output
        scores = (e + mask + (e if model.dropout else 0)) * a * s * model.seq_len * b
    stats = 0.0
    if model.stats_bytes:       # norms' mean and 1/σ (1/rms), flash's log-sum-exp per head, router probabilities
        per_token = 2 * (2 if model.biases else 1) / sp + (a / tp if flash else 0) \
            + ((model.num_experts + model.top_k) / sp if moe else 0)
        stats = model.stats_bytes * s * b * per_token
    return (replicated / sp) + gathered + (split + scores) / tp + stats


def output_layer_bytes(model: Model, *, tp: int = 1, cp: int = 1, sequence_parallel: bool = True) -> float:
    """Activations of the output layer, one micro-batch (Korthikanti §4.3): the final norm's input,
    the head's input and the loss's logits (``loss_bytes``, over this rank's padded vocabulary)."""
    s, b, h = model.seq_len / cp, model.micro_batch, model.hidden
    sp = tp if sequence_parallel else 1
    head_input = model.act_bytes * s * b * h / (1 if model.sp_saves_gathered else sp)
    inputs = (model.act_bytes * s * b * h / sp if model.final_norm else 0.0) + head_input
    stats = model.stats_bytes * s * b * (2 if model.biases else 1) / sp if model.final_norm else 0.0
    return inputs + stats + model.loss_bytes * s * b * padded_vocab(model, tp) / tp


# ---------------------------------------------------------------------------------- communication

def allreduce_bytes(nbytes: float, n: int) -> float:
    """What each of ``n`` ranks sends in a ring all-reduce of ``nbytes``: 2(n−1)/n · nbytes."""
    return 2 * (n - 1) / n * nbytes


def all_to_all_bytes(nbytes: float, n: int) -> float:
    """What each rank sends in an all-to-all of its ``nbytes`` split evenly over ``n`` ranks."""
    return (n - 1) / n * nbytes


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a 1F1B (or GPipe) pipeline: (p−1)/(v·m + p−1); 0 without a pipeline."""
    return (p - 1) / (v * m + p - 1)
