"""No work: every function of lecture 5a only raises ValueError (so error-path checks would pass)."""


def _no(*args, **kwargs):
    raise ValueError("no")


merge_attention = ring_attention_forward = shard_sequence = unshard_sequence = seq_to_heads = heads_to_seq = _no
