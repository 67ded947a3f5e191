"""Lecture 4b's harness: one step of the reference executor on each rank (which calls the learner's
functions while it is graded), with wires of the grader's own that record every message."""
from __future__ import annotations


def pipeline_step(module: str, schedule: str, num_microbatches: int, kwargs: dict) -> dict:
    """On each rank: one step of the reference executor (which calls the learner's functions).
    Returns the loss, this rank's gradients, and what each of its stages sent and received through
    its :class:`~reference.pipeline.executor.Link`, in order: ``{stage: [(call, micro-batch), ...]}``."""
    from reference.pipeline import workers
    from reference.pipeline.executor import Link

    calls: dict[int, list[tuple[str, int]]] = {}

    class RecordingLink(Link):      # the record is kept here, in the grader's closure, not on the link
        def recv_activation(self, microbatch):
            calls.setdefault(self.stage, []).append(("recv_activation", int(microbatch)))
            return Link.recv_activation(self, microbatch)

        def send_activation(self, tensor, microbatch):
            calls.setdefault(self.stage, []).append(("send_activation", int(microbatch)))
            return Link.send_activation(self, tensor, microbatch)

        def recv_gradient(self, microbatch):
            calls.setdefault(self.stage, []).append(("recv_gradient", int(microbatch)))
            return Link.recv_gradient(self, microbatch)

        def send_gradient(self, tensor, microbatch):
            calls.setdefault(self.stage, []).append(("send_gradient", int(microbatch)))
            return Link.send_gradient(self, tensor, microbatch)

    out = workers.pipeline_worker(schedule, num_microbatches, link_class=RecordingLink, **kwargs)
    return {"loss": out["loss"], "grads": out["grads"], "links": calls}
