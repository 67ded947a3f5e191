"""Outside implementations the benchmarks compare against, installed on first use.

They go into ``benchmarks/.peers/`` with ``pip install --target --no-deps`` (never committed, never
into the course's environment), so a benchmark can measure a published peer without the course
depending on it.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".peers")


def add_to_path(*, first: bool = True) -> None:
    """Make the installed peers importable (``first=False``: after everything else on sys.path)."""
    if PEERS not in sys.path:
        if first:
            sys.path.insert(0, PEERS)
        else:
            sys.path.append(PEERS)


def ensure(module: str, packages: list[str], *, install: bool, first: bool = True) -> bool:
    """True when ``module`` imports, installing ``packages`` into ``.peers/`` first if allowed."""
    add_to_path(first=first)
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        if not install:
            return False
    print(f"installing {' '.join(packages)} into {PEERS} ...", flush=True)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", PEERS, *packages])
    if r.returncode != 0:
        print("could not install the peer; skipping it")
        return False
    importlib.invalidate_caches()
    return True
