"""The course's grader.  Read in this order: ``core`` (the registry, what a check sees) and ``outcomes``
(how a check ends), ``sandbox`` (where learner code runs) and ``runner`` (the process itself: learner
code only in its ranks, each sent its own inputs), ``confine`` (what every such process is made
first), ``referee`` (the runner's count of the ranks' messages), ``session`` (the grading loop),
``release`` and ``strip`` (the student release, the autograder bundle); ``checks/`` holds one package
or module per lecture, ``harness/`` what runs beside the learner's code, ``feedback`` the comparisons
and likely-mistake detectors, ``report`` the outputs, and ``allowed_comm``, ``shortcuts`` and
``frozen`` what an exercise switches off, enforces and freezes before learner code runs.

This file imports nothing: the runner imports ``exercises.grading.runner`` without the rest."""
