"""Small helpers the notebooks share.

``needs("5a.1")`` wraps a notebook cell that runs code built on an exercise.  In the full course
it changes nothing.  In the student release, where the graded reference functions call the
learner's own code, a cell whose exercise is not done yet prints what to implement instead of
failing with a traceback::

    with needs("5a.1"):
        out, lse = merge_attention(o1, l1, o2, l2)
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


def _not_implemented(e: BaseException) -> str | None:
    if isinstance(e, NotImplementedError):
        return str(e) or "NotImplementedError"
    failures = getattr(e, "failures", None)  # reference.launch.WorldError
    if failures:
        for f in failures.values():
            if getattr(f, "exc_type", "") == "NotImplementedError":
                return f.message.split(": ", 1)[-1]
    return None


@contextmanager
def needs(*exercise_ids: str) -> Iterator[None]:
    """Run the block; if it stops on an exercise not implemented yet, say which and carry on."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - only NotImplementedError is swallowed, see below
        msg = _not_implemented(e)
        if msg is None:
            raise
        ids = ", ".join(exercise_ids)
        print(f"⏸  This cell needs your solution to exercise {ids}; implement it first, then run the cell again.\n"
              f"   ({msg.splitlines()[0][:200]})")


def quiz(question: str, options: list[str], answer: int, explanation: str = ""):
    """Predict, then reveal: radio buttons and a Reveal button (the answer stays hidden until asked).

    ``answer`` is the index of the right option.  Returns the widget; in a headless run it shows
    the question and the options as text.
    """
    import ipywidgets as W

    choice = W.RadioButtons(options=options, value=None, layout=W.Layout(width="auto"))
    button = W.Button(description="Reveal", button_style="info")
    out = W.HTML()

    def reveal(_):
        picked = choice.value
        right = options[answer]
        verdict = ("✅ Right." if picked == right else
                   "❌ Not quite." if picked is not None else "The answer:")
        out.value = f"<b>{verdict}</b> {right}. {explanation}"
    button.on_click(reveal)
    return _Quiz(W.VBox([W.HTML(f"<b>Predict:</b> {question}"), choice, button, out]), question, options)


class _Quiz:
    def __init__(self, widget, question, options):
        self.widget, self.question, self.options = widget, question, options

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = dict(self.widget._repr_mimebundle_(include=include, exclude=exclude) or {})
        bundle["text/plain"] = "Predict: " + self.question + "\n" + "\n".join(f"  ( ) {o}" for o in self.options)
        return bundle
