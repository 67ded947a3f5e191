"""The course's grader: see ``core`` (how learner code is run and judged), ``feedback`` (comparisons
and likely-mistake detectors), ``checks/`` (one module per lecture) and ``report`` (outputs)."""
