"""One module of checks per lecture.  Each registers exercises with ``core.exercise`` and checks
with ``@EX.check(...)``; a check makes inputs, runs learner code through the context, computes the
ground truth itself and compares."""
