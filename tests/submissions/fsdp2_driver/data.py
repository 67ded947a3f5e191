import torch

import reference.data.fsdp as _fsdp


class _TorchFSDP(torch.nn.Module):
    def __init__(self, module, *, group=None):
        super().__init__()
        from torch.distributed.fsdp import fully_shard
        self.module = module
        fully_shard(module)

    def forward(self, *a, **k):
        return self.module(*a, **k)

    def full_state_dict(self):
        return {n: p.full_tensor().detach().clone() for n, p in self.module.named_parameters()}

    def memory_report(self, optimizer=None):
        return {"params": 0, "grads": 0, "optimizer_state": 0, "total": 0}


_fsdp.FullyShardedDataParallel = _TorchFSDP


def gather_full_params(shard, *, group=None, layer=None, phase="forward"):
    return shard.new_zeros(shard.numel() * 2)        # not written: the driver swap is the whole attack


def reduce_scatter_grad(flat_grad, *, group=None, layer=None):
    return flat_grad[: flat_grad.numel() // 2].clone()
