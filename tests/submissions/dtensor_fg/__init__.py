"""4.1 without the work: f and g from DTensor — ``from_local(Replicate).to_local(grad_placements=
[Partial()])`` is f (identity forward, all-reduce backward); ``from_local(Partial).redistribute(
Replicate)`` is g.  The exercise's ranks switch DTensor off, and its collectives at the dispatcher."""
