"""3.2 without its point: right buckets and right means, but nothing overlaps — grad_ready does
nothing and finish_buckets all-reduces every parameter, blocking, after backward."""
