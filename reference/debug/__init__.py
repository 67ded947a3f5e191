"""Lecture 6 — when the split goes wrong: hangs, mismatched collectives and silent numerical bugs.

    hangs       six programs that really hang on real ranks (the bug on chosen ranks), their fixes,
                and the course's report of each as plain data
    diagnose    exercise 6.1: from that report, the kind of hang and the ranks at fault
    tools       the same programs under PyTorch's own tools: TORCH_DISTRIBUTED_DEBUG=DETAIL, the process
                group's timeout, the flight recorder (gloo), py-spy dump of every rank's stack
    records     what a recorded run holds: every module's tensors, each rank's pieces placed in the
                one-process tensor (Record, Run, Divergence)
    recorder    the forward and backward hooks that record, and where each rank's pieces lie
    runs        the same training recorded on one process and on a grid (the tiny GPT; lecture 4a's blocks)
    plants      one classic silent bug per axis, planted in an otherwise correct run
    divergence  exercise 6.2: first_divergence(parallel_run, single_run) — bisect the steps, walk the records
    accumulate  exercise 6.3: the given run (gradient accumulation over padded documents) with its silent bug,
                and the repaired step
    oracles     the grader's truths: real hang reports, recorded plant runs, one process's gradients
    lecture     the notebook's recorded demos
"""
from .accumulate import accumulate_gradients
from .diagnose import diagnose_hang
from .divergence import first_divergence
from .records import Divergence, Record, Run

__all__ = ["diagnose_hang", "first_divergence", "accumulate_gradients", "Divergence", "Record", "Run"]
