"""Attack fixture (round 3): routes that respect the ring's neighbours but not its point.

    0.1   relay: every rank's whole tensor relayed round the ring in chunk-sized messages, then summed
    0.2   frozen_verify_off: an honest ring, but while it runs the grader's verifier is rebound and a
          given function (chunk_bounds) swapped
    5a.3  relay: the ring's own messages, but every K/V block kept and plain attention computed at the end
          (only memory tells it from the ring)
    3.2   dummy_post: grad_ready posts an all-reduce of zeros the size of a complete bucket (so a post
          is seen in time) and keeps a copy; finish_buckets reduces the copies
    5a.5  relay: K/V relayed and kept, every block's share computed at once, the shares sent home
    5c.1  published_lookup: answers only for the published seeds' inputs (see mesh.py)
"""
