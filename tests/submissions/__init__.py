"""Fixture submissions for the grader tests: each sub-package is laid out like ``exercises``
(``<name>/collectives.py`` holds exercises 0.1 and 0.2) and misbehaves in one documented way.
Grade one with ``python -m exercises.grade 0.1 0.2 --solutions tests.submissions.<name>``."""
