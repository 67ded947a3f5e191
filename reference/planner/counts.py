"""The planner's formulas, one device at a time: parameters (by stage, tensor and expert shard),
model states per ZeRO stage, activations per layer (Korthikanti et al.), and the bytes of the ring
collectives and the pipeline bubble.  The symbols are those of the package docstring."""
from __future__ import annotations

from .model import Composition, Model

__all__ = ["attention_params", "ffn_params", "param_counts", "active_params", "padded_vocab", "stage_layers",
           "device_params", "model_state_bytes", "routed_rows", "activation_bytes_per_layer", "output_layer_bytes",
           "allreduce_bytes", "all_to_all_bytes", "bubble_fraction"]


# ---------------------------------------------------------------------------------- parameters

def attention_params(model: Model) -> tuple[float, float]:
    """(cut over tp, whole on every tensor rank) parameters of one layer's attention.

    Grouped-query attention: Q [h × a·d], K and V [h × kv·d] each, the output [a·d × h] (d = head_dim), all
    cut over tp (with their biases).  Multi-head latent attention (DeepSeek-V2 §2.1): Q down to q_lora_rank
    and up to a·(d + d_rope) (or straight to it without q_lora_rank), K and V down to kv_lora_rank (+ the
    shared rotary key, d_rope) and up to a·(d + d_v), the output [a·d_v × h]; the down projections and the
    latents' RMSNorms are whole on every tensor rank (Megatron-Core's MLA), the up projections cut over tp.
    """
    h, a = model.hidden, model.heads
    if not model.mla:
        q_kv = (a + 2 * model.kv_heads) * model.d_head
        return h * q_kv + a * model.d_head * h + (q_kv if model.biases else 0), 0.0
    q_up = a * model.d_qk
    split = (model.q_lora_rank or h) * q_up + model.kv_lora_rank * a * (model.d_head + model.d_v) \
        + a * model.d_v * h
    whole = (h * model.q_lora_rank + model.q_lora_rank if model.q_lora_rank else 0) \
        + h * (model.kv_lora_rank + model.qk_rope_head_dim) + model.kv_lora_rank
    return split, whole


def ffn_params(model: Model, size: int) -> float:
    """One FFN of inner size ``size`` (an expert's or the dense MLP's): 2 or 3 matrices, with biases if any."""
    mats = 3 if model.gated_ffn else 2
    return mats * model.hidden * size + ((mats - 1) * size + model.hidden if model.biases else 0)


def param_counts(model: Model) -> dict[str, float]:
    """Parameters by kind (whole model): attention, dense FFN, experts, shared experts (if any), router, norms,
    embeddings."""
    h = model.hidden
    split, whole = attention_params(model)
    attn = split + whole + (h if model.biases else 0)
    moe, dense = model.moe_layers, model.layers - model.moe_layers
    out = dict(
        attention=model.layers * attn,
        ffn=dense * ffn_params(model, model.ffn),
        experts=moe * model.num_experts * ffn_params(model, model.d_expert),
        router=moe * h * model.num_experts,
        norms=(model.layers * 2 + (1 if model.final_norm else 0)) * model.norm_params,
        embeddings=model.vocab * h * (1 if model.tied_embeddings else 2)
        + (model.seq_len * h if model.learned_positions else 0),
    )
    if model.shared_experts:
        out["shared_experts"] = moe * model.shared_experts * ffn_params(model, model.d_shared)
    return out


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


def _stage_params(model: Model, t: int, e: int, n_layers: int, n_moe: int, first: bool, last: bool,
                  etp: int | None = None) -> tuple[float, float, float]:
    """(dense, expert, replicated-over-tp) parameters of one device of a stage: the layers' matrices ÷ t, the
    shared experts ÷ t, the routed experts E/e of them ÷ etp (default t)."""
    h = model.hidden
    etp = t if etp is None else etp
    attn_split, attn_whole = attention_params(model)
    mlp_split = (ffn_params(model, model.ffn) - (h if model.biases else 0)) / t
    expert_split = (ffn_params(model, model.d_expert) - (h if model.biases else 0)) / etp
    shared_split = model.shared_experts * (ffn_params(model, model.d_shared) - (h if model.biases else 0)) / t
    out_bias = h if model.biases else 0                       # after a row-parallel layer: replicated
    replicated = n_layers * (2 * model.norm_params + out_bias + attn_whole) + (n_layers - n_moe) * out_bias \
        + n_moe * h * model.num_experts                       # norms, proj/fc2 biases, MLA's down projections, router
    vocab_rows = padded_vocab(model, t) // t * h
    # the word embedding (first) and the head (last): one table when tied and both on this device, none
    # on a middle stage
    embed = vocab_rows * (first + last) if (first != last or not model.tied_embeddings) else vocab_rows * first
    if first and model.learned_positions:
        replicated += model.seq_len * h
    if last and model.final_norm:
        replicated += model.norm_params
    dense = n_layers * attn_split / t + (n_layers - n_moe) * mlp_split + n_moe * shared_split + embed + replicated
    experts = n_moe * model.num_experts // e * (expert_split + out_bias) if n_moe else 0.0
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

def routed_rows(model: Model, ep: int = 1) -> float:
    """Rows the busiest device's experts compute per routed token-choice, relative to the mean (k·T rows at
    perfect balance).  With a capacity factor every expert's buffer is padded to it (and tokens beyond it
    dropped): the capacity factor.  Dropless: the busiest expert carries ``load_imbalance`` × the mean; the
    other E/ep − 1 experts on its device are taken at the mean, so the device carries
    1 + (load_imbalance − 1)·ep/E."""
    if model.capacity_factor is not None:
        return model.capacity_factor
    local = max(1, model.num_experts // ep)
    return 1 + (model.load_imbalance - 1) / local


def activation_bytes_per_layer(model: Model, *, tp: int = 1, cp: int = 1, sequence_parallel: bool = True,
                               recompute: str = "none", flash: bool = False, moe: bool = False, ep: int = 1
                               ) -> float:
    """Bytes of activations one transformer layer keeps for the backward, one micro-batch, per device.

    The accounting of Korthikanti et al. §4, written per stored tensor so that it also covers GQA and other
    head sizes, multi-head latent attention (the latents kept for the up projections, Q, K and V at their
    head sizes), a gated or non-4h FFN, MoE (the routed experts' FFN internals for k·T rows × the busiest
    device's :func:`routed_rows`, the shared experts' internals, the experts' input and output), no dropout,
    and context parallelism.  With MHA, FFN 4h, GELU and dropout it is exactly ``s·b·h·34 + 5·a·s²·b``
    (tested).  ``model.stats_bytes`` > 0 adds the per-token statistics Korthikanti leaves out (norms, flash
    log-sum-exp, router probabilities).
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    s, b, h, a = model.seq_len / cp, model.micro_batch, model.hidden, model.heads
    kv_heads = a if model.mla else model.kv_heads
    q, k, v, o = a * model.d_qk, kv_heads * model.d_qk, kv_heads * model.d_v, a * model.d_v
    e, mask = model.act_bytes, (1 if model.dropout else 0)
    sb, sbh = s * b, s * b * h
    sp = tp if sequence_parallel else 1
    if recompute == "full":
        return e * sbh / sp
    # replicated across tensor ranks unless sequence parallel: LayerNorm inputs, QKV and FC1 inputs, dropout masks
    replicated = e * 2 * sbh + e * sbh + e * sbh + mask * 2 * sbh
    gathered = 0.0
    if sp > 1 and model.sp_saves_gathered:      # QKV and FC1 inputs kept all-gathered
        replicated, gathered = replicated - 2 * e * sbh, 2 * e * sbh
    if model.mla:   # the latents: each kept for its RMSNorm and for its up projection, and the rotary key
        replicated += e * sb * (2 * model.q_lora_rank + 2 * model.kv_lora_rank + model.qk_rope_head_dim)
    # split across tensor ranks: Q, K (for QKᵀ), V, the attention output (proj input), the FFN internals
    acts = 3 if model.gated_ffn else 2
    if moe:
        rows = model.top_k * routed_rows(model, ep)
        ffn_inner = acts * e * sb * (model.d_expert * rows + model.d_shared * model.shared_experts)
        # the dispatched tokens (the experts' input) and the experts' output (the gate's gradient)
        replicated += 2 * e * rows * sbh
    else:
        ffn_inner = acts * e * sb * model.ffn
    split = e * sb * (q + k) + e * sb * v + e * sb * o + ffn_inner
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
