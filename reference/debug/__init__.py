"""Lecture 6 — when the split goes wrong: hangs, mismatched collectives and silent numerical bugs.

    hangs       six programs that really hang on real ranks (the bug on chosen ranks), their fixes,
                and the course's report of each as plain data
    diagnose    exercise 6.1: from that report, the kind of hang and the ranks at fault
    tools       the same programs under PyTorch's own tools: TORCH_DISTRIBUTED_DEBUG=DETAIL, the process
                group's timeout, the flight recorder (gloo), py-spy dump of every rank's stack
"""
