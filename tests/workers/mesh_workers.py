"""Helpers only the mesh tests use (tests/test_mesh.py)."""
from __future__ import annotations

from collections.abc import Sequence


def groups_as_sets(groups: Sequence[Sequence[int]]) -> set[frozenset[int]]:
    """Groups as a set of frozensets (order-free comparison in tests and graders)."""
    return {frozenset(g) for g in groups}
