"""Which source files a rank imported, and which of them changed since: how an edit reaches kept-alive ranks.

A rank imports a module once.  When the learner fixes their exercise and runs the demo cell again, a
world kept alive since before the fix would run the old code (``%autoreload`` only reaches the
notebook's own process).  So after each task a rank reports the files of the modules it imported
since its last report (:func:`imported_since`) — the course's, the learner's, a script's; not the
standard library's or installed packages' — with their modification time and size, and before each
run :meth:`reference.launch.World.run` asks :func:`changed` which of them differ now; if any do,
the world starts fresh ranks, which import the edit.
"""
from __future__ import annotations

import functools
import os
import sys

Stamp = tuple[int, int]          # (st_mtime_ns, st_size)

_installed_dirs: tuple[str, ...] = ()


def _installed() -> tuple[str, ...]:
    """Folders of the standard library and of installed packages (never edited by a learner)."""
    global _installed_dirs
    if not _installed_dirs:
        import site
        import sysconfig
        paths = sysconfig.get_paths()
        dirs = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
        dirs += site.getsitepackages() + [site.getusersitepackages()]
        _installed_dirs = tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)
    return _installed_dirs


def _stamp(path: str) -> Stamp | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


@functools.cache
def _real_folder(folder: str) -> str:
    """``folder`` with its symbolic links resolved, and a trailing separator."""
    return os.path.join(os.path.realpath(folder), "")


@functools.cache
def _editable_source(path: str) -> str | None:
    """The real path of the source file ``path`` (a module's ``__file__``), or None for a file of the
    standard library or an installed package.  Cached: a rank forked from a zygote inherits what the
    zygote looked at (torch alone is ~2,000 modules in ~200 folders, and a grading starts hundreds of ranks)."""
    real = _real_folder(os.path.dirname(path)) + os.path.basename(path)
    if os.path.islink(real):
        real = os.path.realpath(real)
    return None if real.startswith(_installed()) else real


def imported_since(seen: set[str]) -> dict[str, Stamp]:
    """Source files of the modules imported since the last call (``seen``: module names already
    looked at, updated), outside the standard library and installed packages: {path: stamp}."""
    found = {}
    for name, module in list(sys.modules.items()):
        if name in seen:
            continue
        seen.add(name)
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or not path.endswith(".py"):
            continue
        path = _editable_source(path)
        stamp = None if path is None else _stamp(path)
        if stamp is not None:
            found[path] = stamp
    return found


def changed(sources: dict[str, Stamp]) -> list[str]:
    """The files in ``sources`` whose stamp differs now (edited, replaced or removed), sorted."""
    return sorted(path for path, stamp in sources.items() if _stamp(path) != stamp)


def describe(paths: list[str], most: int = 3) -> str:
    """``exercises/collectives.py, …``: each file with its folder, the first ``most`` of them."""
    names = [os.path.join(os.path.basename(os.path.dirname(p)), os.path.basename(p)) for p in paths[:most]]
    return ", ".join(names) + (" …" if len(paths) > most else "")
