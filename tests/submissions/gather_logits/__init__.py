"""4.3 without its point: gather the whole vocabulary's logits (an all-gather, or failing that an
all-reduce of the zero-padded logits), then ``F.cross_entropy`` — exactly what the exercise says
never to do."""
