from reference.pipeline.schedules import _check
from reference.planner.counts import bubble_fraction as _planner_bubble


def bubble_fraction(name, num_stages, num_microbatches, *, virtual_stages=1):
    _check(name, num_stages, num_microbatches, virtual_stages)
    m = 3 * num_microbatches if name == "zb_h1" else num_microbatches
    return _planner_bubble(num_stages, m, virtual_stages)
