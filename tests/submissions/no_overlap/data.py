import torch.distributed as dist

from reference.data.ddp import Bucket  # noqa: F401


def assign_buckets(params, bucket_cap_bytes):
    buckets, filled = [], 0
    for i, p in enumerate(params):
        size = p.numel() * p.element_size()
        if buckets and filled + size <= bucket_cap_bytes:
            buckets[-1].append(i)
            filled += size
        else:
            buckets.append([i])
            filled = size
    return buckets


def grad_ready(buckets, index, *, group=None):
    pass


def finish_buckets(buckets, *, group=None):
    n = dist.get_world_size(group)
    for b in buckets:
        for p in b.params:
            if p.grad is None:
                p.grad = p.detach().new_zeros(p.shape)
            dist.all_reduce(p.grad, group=group)
            p.grad /= n
        b.ready = 0
