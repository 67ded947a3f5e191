"""Lecture 4b's harness: one step of the reference executor on each rank (which calls the learner's
functions while it is graded), with wires of the grader's own that record every message."""
from __future__ import annotations


def pipeline_step(module: str, mine: None, schedule: str, num_microbatches: int, kwargs: dict) -> dict:
    """On each rank: one step of the reference executor (which calls the learner's functions).
    Returns the loss, this rank's gradients, and what each of its stages sent and received through
    its :class:`~reference.pipeline.executor.Link`, in order: ``{stage: [(call, micro-batch), ...]}``."""
    from reference.pipeline import workers
    from reference.pipeline.executor import Link

    calls: dict[int, list[tuple[str, int]]] = {}

    def recording(call: str):
        def method(self, *args):                 # (tensor,) microbatch: the record is kept here, not on the link
            calls.setdefault(self.stage, []).append((call, int(args[-1])))
            return getattr(Link, call)(self, *args)
        return method

    RecordingLink = type("RecordingLink", (Link,), {c: recording(c) for c in
                                                    ("recv_activation", "send_activation", "recv_gradient",
                                                     "send_gradient")})
    out = workers.pipeline_worker(schedule, num_microbatches, link_class=RecordingLink, **kwargs)
    return {"loss": out["loss"], "grads": out["grads"], "links": calls}
