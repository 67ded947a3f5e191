import torch
import torch.distributed as dist

_ZERO = {}


def zero_step(params, shard, optimizer, *, stage, group=None):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    n = dist.get_world_size(group)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
        p.grad /= n
    key = tuple(id(p) for p in params)
    if key not in _ZERO:
        group_kw = {k: v for k, v in optimizer.defaults.items() if k not in ("foreach", "fused", "differentiable",
                                                                              "capturable", "maximize")}
        _ZERO[key] = ZeroRedundancyOptimizer(params, optimizer_class=type(optimizer), process_group=group, **group_kw)
    _ZERO[key].step()
