import sys
import warnings

from .._ring import ring_all_gather as _gather
from .._ring import ring_all_reduce as _reduce
from .._ring import ring_reduce_scatter  # noqa: F401  (correct)

print("noisy: importing", file=sys.stderr)


def ring_all_reduce(tensor, *, group=None):
    warnings.warn("noisy: this is only a warning")
    print("noisy: WARNING to stderr", file=sys.stderr, flush=True)
    print("noisy: chatter on stdout")
    return _reduce(tensor, group=group)


def ring_all_gather(chunk, numel, *, group=None):
    print("noisy: WARNING to stderr", file=sys.stderr, flush=True)
    return _gather(chunk, numel, group=group)
