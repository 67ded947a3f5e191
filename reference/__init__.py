"""Splitting the Work — the course's reference implementations.

Modules, in teaching order:

    launch        run a function on N local ranks (run_world, World, WorldError)
    trace         the one event format every axis records; comm: traced collectives
    collectives   lecture 0: ring reduce-scatter, all-gather and all-reduce from send/recv
    sequence      lecture 5a: blockwise and ring attention, zigzag/striped layouts, Ulysses, USP
    moe           lecture 5b: GShard/Switch routing, capacity, expert parallelism over all-to-all
    mesh          lecture 5c: RankGrid, the rank grid of a composed run (tp-cp-dp-pp, experts folded)
    gpt           lecture 5c: the single-process tiny GPT every composed run is checked against
    planner       lecture 5c: memory, bytes, time and what runs out first for a composition;
                  published: the worked examples (Llama 3, GShard) with their sources
    widgets       replay traces as animations in notebooks
"""
__version__ = "0.1.0"
