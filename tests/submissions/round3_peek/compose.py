"""5c.2 given_sync_rest: only the dense mean over dp_cp written; the given sync_the_rest does the
sequence-parallel copies (Σ over tp, then the mean) and the experts (Σ over edp, ÷ dp·cp)."""
from reference import comm
from reference.compose.overlap import sync_the_rest


def sync_gradients(model):
    n = model.grid.dp * model.grid.cp
    sp = {id(p) for p in model.sequence_parallel_params()}
    if n > 1:
        for p in model.dense_params():
            if p.grad is not None and id(p) not in sp:
                comm.all_reduce(p.grad, group=model.groups["dp_cp"])
                p.grad /= n
    sync_the_rest(model)
