"""Attack fixture (hostile student, round 3): one route per exercise, none of them the exercise.

    0.1, 0.2, 3.1, 5a.3, 5a.4, 5a.5, 5b.2   frame_peek: every rank's inputs read from the caller's frames
                                           and the garbage collector, the answer computed locally
    3.2   snapshot_no_overlap: grad_ready copies a complete bucket; finish_buckets all-reduces later
    3.3   zero_unsharded: all-reduce every gradient, step a full replicated optimizer
    5a.2  given_positions: the layouts from reference.sequence.layouts.positions
    5b.1  given_gshard_slots: the slots from reference.moe.routing.gshard_random_routing
    5b.3  given_dispatch_rows: reference.moe.parallel._dispatch_rows / _combine_rows
    5b.4  honest (5c.2's route needs it)
    5c.1  given_coords: RankGrid.coords
    5c.2  given_sync_rest: only the dense mean written; reference.compose.overlap.sync_the_rest does the rest
"""
