import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def copy_to_tensor_region(x, group=None, **meta):
    from torch.distributed.tensor import DTensor, Partial, Replicate
    return DTensor.from_local(x, _mesh(), [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def reduce_from_tensor_region(x, group=None, **meta):
    from torch.distributed.tensor import DTensor, Partial, Replicate
    return DTensor.from_local(x, _mesh(), [Partial()],
                              run_check=False).redistribute(placements=[Replicate()]).to_local()
