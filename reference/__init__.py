"""Splitting the Work — the course's reference implementations, in layers (each imports only its own
and the ones above it in this list; the full course's ``tests/test_import_layers.py`` keeps it so):

    runtime       launch (run a function on N local ranks), rank_program (inside one rank), trace (the one
                  event format), comm (traced collectives), saved (activation memory)
    foundations   collectives (lecture 0: ring algorithms from send/recv), mesh (lecture 5c: the rank grid)
    axes          data (3), tensor (4a), pipeline (4b), sequence (5a), moe (5b): one package per axis
    composition   gpt (the tiny GPT), compose (5c: the axes on one grid), planner (which composition)
    notebooks     notebook (quizzes, recordings, figures, lecture 0's runs), widgets, each axis's lecture.py

In every axis package a file name means one role: ``lecture.py`` the notebook's recorded runs,
``workers.py`` rank functions, ``oracles.py`` the grader's single-process truths; the algorithm
modules sit beside them.
"""


def __getattr__(name: str):
    """``reference.__version__``: the course's version, read when asked (ranks never pay for it)."""
    if name == "__version__":
        return _version()
    raise AttributeError(f"module 'reference' has no attribute {name!r}")


def _version() -> str:
    """The version ``pyproject.toml`` states (the one place it is written) — from the file beside this
    package in a checkout or a release, else from the installed package's metadata."""
    from pathlib import Path
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        import tomllib
        return tomllib.loads(pyproject.read_text())["project"]["version"]
    except (ImportError, OSError, KeyError, ValueError):     # Python 3.10 has no tomllib; no pyproject.toml here
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("splitting-the-work")
        except PackageNotFoundError:
            return "unknown"
