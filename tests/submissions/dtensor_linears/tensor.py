import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def linear_shard(weight, bias, style, group=None):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = _mesh()
    w = distribute_tensor(weight, mesh, [Shard(0) if style == "column" else Shard(1)]).to_local()
    b = None if bias is None else distribute_tensor(bias, mesh,
                                                    [Shard(0) if style == "column" else Replicate()]).to_local()
    return w, b


def column_parallel_linear(x, weight, bias=None, group=None, **kw):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = _mesh()
    xd = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    wd = DTensor.from_local(weight, mesh, [Shard(0)], run_check=False)
    bd = None if bias is None else DTensor.from_local(bias, mesh, [Shard(0)], run_check=False)
    return F.linear(xd, wd, bd).to_local()


def row_parallel_linear(x, weight, bias=None, group=None, **kw):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = _mesh()
    xd = DTensor.from_local(x, mesh, [Shard(-1)], run_check=False)
    wd = DTensor.from_local(weight, mesh, [Shard(1)], run_check=False)
    y = F.linear(xd, wd).redistribute(placements=[Replicate()]).to_local()
    return y if bias is None else y + bias
