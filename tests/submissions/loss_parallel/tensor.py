import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh


def vocab_parallel_cross_entropy(logits_shard, target, group=None, ignore_index=-100):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import loss_parallel
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    z = DTensor.from_local(logits_shard, mesh, [Shard(1)], run_check=False)
    t = DTensor.from_local(target, mesh, [Replicate()], run_check=False)
    with loss_parallel():
        loss = F.cross_entropy(z, t, reduction="none", ignore_index=ignore_index)
    return loss.to_local(grad_placements=[Replicate()])
