"""Splitting the Work — the course's reference implementations, in layers (each imports only its own
and the ones above it in this list; the full course's ``tests/test_import_layers.py`` keeps it so):

    runtime       launch (run a function on N local ranks), rank_program (inside one rank), trace (the one
                  event format), comm (traced collectives), saved (activation memory)
    foundations   collectives (lecture 0: ring algorithms from send/recv), mesh (lecture 5c: the rank grid)
    axes          data (3), tensor (4a), pipeline (4b), sequence (5a), moe (5b): one package per axis
    composition   gpt (the tiny GPT), compose (5c: the axes on one grid), planner (which composition)
    notebooks     notebook (quizzes, recordings, figures, lecture 0's runs), widgets, each axis's lecture.py

In every axis package a file name means one role: ``lecture.py`` the notebook's recorded runs,
``workers.py`` rank functions, ``oracles.py`` the grader's single-process truths; the algorithm
modules sit beside them.
"""
__version__ = "0.1.0"
