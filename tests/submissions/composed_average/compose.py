def sync_gradients(model):
    from reference.compose.train import _average_flat
    from reference.tensor import sync_sequence_parallel_grads
    sync_sequence_parallel_grads(model.sequence_parallel_params(), group=model.groups["tp"])
    if model.grid.dp * model.grid.cp > 1:
        _average_flat(model.dense_params(), model.groups["dp_cp"])
