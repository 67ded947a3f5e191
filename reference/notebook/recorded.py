"""Demos that work before the exercises are written, and replay the learner's own run after.

A notebook explains an idea by running it: a widget replays a ring of real ranks, a plot shows
bytes measured from a trace.  In the student release the graded reference functions call the
learner's code, so such a demo would only say "not implemented" until the exercise is done —
the animation would come after the work it is meant to motivate.  So every demo a notebook runs
through a graded function is a *recordable* function::

    from reference.notebook.recorded import recordable

    @recordable("05a.ring_runs", needs=("5a.3",), variants=[{"causal": True}])
    def ring_runs(seq_len=16, causal=False, world=None):
        ...                       # starts ranks (or uses `world`), returns plain data:
        return {"trace": ..., "pairs": ...}   # tensors, numbers, lists, dicts, trace Events

What a call does:

=====================  ========================================================================
full course (repo)     runs the function, always.
student release        returns the result recorded from the full reference when the release
                       was built (``make release``), labelled as such — until ``check`` has
                       passed every exercise in ``needs``; from then on runs it live, on the
                       learner's own code (labelled "your own run").  A call whose arguments
                       were not recorded runs live.
=====================  ========================================================================

``make release`` calls every recordable once with its defaults and once per entry of
``variants`` (keyword arguments over the defaults) and ships the results in
``reference/_recorded/<key>.pt``; that folder exists only in a release.

Rules for a recordable: decorate the function the notebook calls (the one that starts the
ranks), not the rank worker; give it simple arguments (numbers, strings, booleans, tuples) so a
call can be matched to its recording; arguments named in ``ignore`` (default: ``world``, a live
:class:`reference.launch.World` to reuse) do not take part in the match.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import json
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]            # the course: reference/ and exercises/ side by side
RECORDINGS = ROOT / "reference" / "_recorded"
REGISTRY: dict[str, Recordable] = {}


def in_release() -> bool:
    """True in a student release (recordings are shipped), False in the full course."""
    return RECORDINGS.is_dir()


def progress_file() -> Path:
    """Where grading notes the exercises the learner has passed: beside the learner's package
    (found by its place in the course, not imported: the reference never imports the learner's code)."""
    return ROOT / "exercises" / ".progress.json"


def passed_exercises() -> set[str]:
    try:
        return set(json.loads(progress_file().read_text()).get("passed", []))
    except (OSError, ValueError, ImportError):
        return set()


def note_passed(ids: Sequence[str], failed: Sequence[str] = ()) -> None:
    """Record that ``ids`` passed (and ``failed`` no longer do); called by ``exercises.check``."""
    done = (passed_exercises() | set(ids)) - set(failed)
    try:
        progress_file().write_text(json.dumps({"passed": sorted(done)}, indent=1) + "\n")
    except OSError:
        pass   # a read-only checkout: demos keep showing the recordings


def _freeze(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"a recordable's arguments must be numbers, strings, booleans or tuples, not {type(v).__name__}")


def _not_implemented(e: BaseException) -> bool:
    from .course import _not_implemented as why
    return why(e) is not None


@dataclass
class Recordable:
    key: str
    fn: Callable[..., Any]
    needs: tuple[str, ...]
    variants: list[dict] = field(default_factory=list)
    ignore: tuple[str, ...] = ("world",)
    story: Callable[[Any], list[str]] | None = None   # result -> how it contradicts the lesson's text
    timed: bool = False                               # the story reads wall-clock times: record on a quiet machine

    def call_key(self, args: tuple, kwargs: dict) -> str:
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        items = {k: v for k, v in bound.arguments.items() if k not in self.ignore}
        return repr(_freeze(items))

    def recordings(self) -> dict[str, Any]:
        import torch
        path = RECORDINGS / f"{self.key}.pt"
        return torch.load(path, weights_only=False) if path.exists() else {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not in_release():
            return self.fn(*args, **kwargs)
        ids = ", ".join(self.needs)
        if self.needs and set(self.needs) <= passed_exercises():
            try:
                out = self.fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - anything but "not implemented" is the learner's to see
                if not _not_implemented(e):
                    raise
            else:
                print(f"▶ your own run (exercise {ids} passed its check)")
                return out
        key = self.call_key(args, kwargs)
        recordings = self.recordings()
        if key not in recordings:
            return self.fn(*args, **kwargs)
        print(_replay_label(self.needs, passed_exercises()))
        import time
        _replays.append((time.perf_counter(), recordings.get(SECONDS + key)))
        return recordings[key]


SECONDS = "seconds of "           # a recording's file also keeps how long each recorded call ran
_replays: list[tuple[float, float | None]] = []      # (when, seconds the recorded call took) of each replay


def took(since: float) -> str:
    """How long the demos a cell called since ``since`` (``time.perf_counter()``) took: "in 3.2 s" when
    they ran; "in 3.2 s when recorded (replayed here)" when a recording stood in for one of them — a
    replay takes no time, and "in 0.0 s" would say the run did."""
    import time
    elapsed = time.perf_counter() - since
    replays = [seconds for when, seconds in _replays if when >= since]
    if not replays:
        return f"in {elapsed:.1f} s"
    if None in replays:
        return "replayed from a recording"
    return f"in {elapsed + sum(replays):.1f} s when recorded (replayed here)"


def _replay_label(needs: Sequence[str], passed: set[str]) -> str:
    """What a replayed cell says: which checks, not yet passed, would make it run the learner's own code."""
    missing = [i for i in needs if i not in passed]
    if not needs:
        return "▶ recorded from the reference"
    if not missing:   # every check passed, yet the learner's code is still a stub somewhere it needs
        return "▶ recorded from the reference — your code reached a function still to be written"
    calls = " and ".join(f'check("{i}")' for i in missing)
    return f"▶ recorded from the reference — once {calls} pass{'es' if len(missing) == 1 else ''}, " \
           f"running this cell again runs your own code"


def recordable(key: str, *, needs: Sequence[str] = (), variants: Sequence[dict] = (),
               ignore: Sequence[str] = ("world",), story: Callable[[Any], list[str]] | None = None,
               timed: bool = False):
    """Decorator: make a notebook demo recordable under ``key`` (see the module docstring).

    ``story(result)`` lists the ways a run contradicts what the notebook's text says of it (timings
    on a loaded machine can); :func:`record_all` records again, then refuses to ship such a run.
    ``timed``: the story reads wall-clock times, so nothing else should run while it is recorded."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if key in REGISTRY and REGISTRY[key].fn.__qualname__ != fn.__qualname__:
            raise ValueError(f"two recordables share the key {key!r}")
        rec = Recordable(key, fn, tuple(needs), [dict(v) for v in variants], tuple(ignore), story, timed)
        REGISTRY[key] = rec

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return rec(*args, **kwargs)
        call.recordable = rec
        return call
    return deco


def live_world(n: int, worlds: dict | None = None):
    """A context manager giving a world of ``n`` ranks: ``worlds[n]`` if the notebook keeps one
    alive ({n: World}), else a new one, closed on exit (what a recording run uses)."""
    from contextlib import nullcontext

    from ..launch import World
    if worlds and n in worlds:
        return nullcontext(worlds[n])
    if _POOL is not None:                      # record_all: one world per size for every recording
        if n not in _POOL:
            _POOL[n] = World(n, timeout=60, echo=False).start()
        return nullcontext(_POOL[n])
    return World(n, timeout=60, echo=False)


_POOL: dict | None = None


def import_all(package: str = "reference") -> dict[str, Recordable]:
    """Import every module of ``package`` so that every recordable is registered."""
    pkg = importlib.import_module(package)
    for info in pkgutil.walk_packages(pkg.__path__, package + "."):
        if ".widgets" in info.name or info.name.endswith("._recorded"):
            continue
        importlib.import_module(info.name)
    return REGISTRY


def record_all(dest: Path, keys: Sequence[str] | None = None, progress: Callable[[str], None] | None = print) -> int:
    """Run every recordable (defaults + variants) here, from the full reference, and save the
    results in ``dest/<key>.pt``; return how many calls were recorded.  Used by ``make release``."""
    import torch
    global _POOL
    dest.mkdir(parents=True, exist_ok=True)
    n = 0
    _POOL = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # demos are small, as the notebooks run them; a 2-core machine spins otherwise
    try:
        for key, rec in sorted(import_all().items()):
            if keys is not None and key not in keys:
                continue
            results = {}
            for kwargs in [{}] + rec.variants:
                if progress:
                    progress(f"recording {key} {kwargs or ''}")
                call = rec.call_key((), kwargs)
                results[call], results[SECONDS + call] = _record_one(rec, kwargs)
                n += 1
            torch.save(results, dest / f"{key}.pt")
    finally:
        torch.set_num_threads(threads)
        pool, _POOL = _POOL, None
        for world in pool.values():
            world.close()
    return n


class StoryBroken(RuntimeError):
    """A recording that, after every attempt, contradicts what its notebook says."""


def _record_one(rec: Recordable, kwargs: dict, attempts: int = 3) -> tuple[Any, float]:
    """One recording of ``rec(**kwargs)`` whose story holds (``rec.story``), in at most ``attempts`` runs,
    and the seconds that run took."""
    import time
    for _ in range(attempts):
        t0 = time.perf_counter()
        out = rec.fn(**kwargs)
        broken = rec.story(out) if rec.story else []
        if not broken:
            return out, time.perf_counter() - t0
    raise StoryBroken(f"{rec.key} {kwargs or ''}: {attempts} recordings contradict the notebook's text "
                      f"({'; '.join(broken)}); record on a quieter machine")
