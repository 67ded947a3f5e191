from .._ring import ring_all_gather, ring_all_reduce as _honest, ring_reduce_scatter  # noqa: F401


def ring_all_reduce(tensor, *, group=None):
    total = _honest(tensor, group=group)
    tensor.copy_(total)                  # the caller's tensor now holds the sum
    return tensor
