"""4.6 without the work: the formula taken from the given planner
(``reference.planner.counts.bubble_fraction``), its errors from ``reference.pipeline.schedules._check``."""
