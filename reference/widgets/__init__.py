"""Widgets that replay traces of real runs.  Each is a pure state function (tested) plus a thin
drawing and a :class:`~reference.widgets.player.Player`.

    collective   lecture 0: ranks on a circle, chunks moving (any ring collective)
    matrix_split lecture 4a: weights cut across ranks, a parallel MLP forward and backward, collectives lit
    pipeline     lecture 4b: a pipeline step as a Gantt chart (slots or wall clock), messages, stash per rank;
                 gantt, its pure part: a trace or a schedule's order laid out in time
    ring         lecture 5a: ring attention — K/V moving, the score matrix filling
    ulysses      lecture 5a: Ulysses' two all-to-alls — sequence split to head split and back, bytes per rank
    routing      lecture 5b: tokens routed to experts, capacity buffers, all-to-all
    planner      lecture 5c: the rank grid by node, memory per device, bytes per axis of a composition
"""
