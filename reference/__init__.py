"""Splitting the Work — the course's reference implementations.

Modules, in teaching order:

    launch        run a function on N local ranks (run_world, World, WorldError)
    trace         the one event format every axis records; comm: traced collectives
    collectives   lecture 0: ring reduce-scatter, all-gather and all-reduce from send/recv
    sequence      lecture 5a: blockwise and ring attention, zigzag/striped layouts, Ulysses, USP
    moe           lecture 5b: GShard/Switch routing, capacity, expert parallelism over all-to-all
    widgets       replay traces as animations in notebooks
"""
__version__ = "0.1.0"
