"""What the grader's tests share."""
from __future__ import annotations

import pytest

from exercises.grading import core


@pytest.fixture
def fresh(monkeypatch):
    """Grade on fresh inputs, as run_autograder does: ``fresh(secret)`` sets the secret seed (reset afterwards)."""
    def use(secret: bytes) -> None:
        monkeypatch.setattr(core, "_SALT", secret)
    return use
