from reference.pipeline.schedules import Action


def one_f_one_b(num_stages, num_microbatches, stage):
    from torch.distributed.pipelining.schedules import Schedule1F1B
    s = object.__new__(Schedule1F1B)
    s._num_stages, s._n_microbatches = num_stages, num_microbatches
    out, seen = [], {"F": 0, "B": 0}
    for a in Schedule1F1B._get_pipeline_order(s)[stage]:
        kind = str(a)[len(str(stage)):][:1] if a is not None else None
        if kind in ("F", "B"):          # renumbered: torch's last stage counts its forwards from 1
            out.append(Action(kind, seen[kind]))
            seen[kind] += 1
    return out
