"""Lecture 5c, part 4 (files) — how a checkpoint is written and read: DCP, atomically, checked.

:mod:`.checkpoint` says WHAT each rank holds, as boxes of the single-process tensors
(:class:`GlobalTensor`); this module hands those boxes to PyTorch's distributed checkpoint
(``torch.distributed.checkpoint``, DCP) and makes the result safe to resume from::

    DIR/step_000003.tmp/          while writing (a crash leaves only this; latest() ignores it)
    DIR/step_000003/              after the commit (rank 0 renames the directory: atomic)
        __0_0.distcp, __1_0.distcp, …   each rank's chunks (DCP's FileSystemWriter, one file per rank;
                                        a replicated chunk is written by one rank only)
        .metadata                       every chunk: key, global shape, offsets, sizes, dtype, file
                                        (written by DCP's coordinator after all the ranks' files)
        checksums.json                  size and CRC-32 of every file (written last, before the commit)

Why the checksums: DCP stores each chunk as a ``torch.save`` archive and ``torch.load`` does not
verify its CRC, so a flipped bit would load silently; a truncated file does fail, in DCP's read.
Both are refused: every rank verifies its share of the files (round-robin), reads ``.metadata`` and
checks it against the model (keys, global shapes, dtypes), then the ranks agree — one
all-gather of their error lists — and ALL raise :class:`CheckpointError` naming the tensor or the
file, before any rank starts DCP's load (whose own collectives would otherwise meet a rank that
gave up: DCP falls back to per-rank metadata without collectives when ``.metadata`` is unreadable).
DCP passes a rank's failure during the read itself to every rank; it is re-raised naming the path.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .. import comm

__all__ = ["CheckpointError", "GlobalTensor", "Saved", "save", "load", "latest", "MANIFEST"]

STEP_DIR = re.compile(r"step_(\d+)")
MANIFEST = "checksums.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used here: another model, missing or damaged files."""


@dataclass
class GlobalTensor:
    """This rank's slices of one single-process tensor: ``size`` its global shape, ``pieces`` a list of
    (global offsets, a view into this rank's memory) — saved from and loaded into in place."""
    size: tuple[int, ...]
    pieces: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)


@dataclass
class Saved:
    """A finished save: where, its wall time on this rank (to the commit), the bytes each rank wrote."""
    path: Path
    seconds: float
    bytes_per_rank: dict[int, int]


# ----------------------------------------------------------------------------------------------
# DCP's planners, given boxes instead of a state_dict's tensors


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner — it keeps one copy of identical chunks (dp replicas, tp copies of a
    LayerNorm), builds the global metadata and checks that the chunks tile every tensor exactly —
    fed with this rank's boxes; the coordinator also writes ``meta`` as the ``train`` entry."""

    def __init__(self, state: dict[str, GlobalTensor], meta: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes, self.meta = state, meta
        self.views = {(k, tuple(o)): t for k, gt in state.items() for o, t in gt.pieces}

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), t.shape),
                                                       properties=TensorProperties.create_from_tensor(t),
                                                       size=torch.Size(gt.size)))
                 for key, gt in self.boxes.items() for offsets, t in gt.pieces]
        if self.is_coordinator:
            items.append(WriteItem(index=MetadataIndex("train"), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self.meta if index.fqn == "train" else self.views[(index.fqn, tuple(index.offset))]


class _LoadPlanner(LoadPlanner):
    """Reads the saved chunks that overlap this rank's boxes (DCP's resharding arithmetic,
    ``create_read_items_for_chunk_list``) straight into them; with ``want_meta`` also ``train``."""

    def __init__(self, state: dict[str, GlobalTensor], want_meta: bool = False):
        self.state, self.want_meta, self.meta = state, want_meta, None

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, gt in self.state.items():
            chunks = [ChunkStorageMetadata(torch.Size(o), t.shape) for o, t in gt.pieces]
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
        if self.want_meta:
            whole = torch.Size((0,))
            items.append(ReadItem(LoadItemType.BYTE_IO, MetadataIndex("train"), whole, MetadataIndex("train"),
                                  whole, whole))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value) -> None:
        self.meta = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        t = self.state[read_item.dest_index.fqn].pieces[read_item.dest_index.index][1]
        return narrow_tensor_by_index(t, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass                                          # the reader copied into our view: nothing left to do


# ----------------------------------------------------------------------------------------------
# Save (atomic), find, load (checked, agreed)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _first(group) -> bool:
    return not _distributed() or comm.rank(group) == 0


def _all_gather(obj, group) -> list:
    if not _distributed():
        return [obj]
    out: list = [None] * comm.world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _dcp(call, header: str, **kw):
    """Run dcp.save / dcp.load; DCP's exception (every rank's traceback) → CheckpointError, one line per rank."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")           # DCP warns that no_dist means one process: we know
            call({}, no_dist=not _distributed(), **kw)
    except (Exception, CheckpointException) as e:
        lines = ([f"rank {r}: {type(x).__name__}: {(str(x).splitlines() or [''])[0]}"
                  for r, (x, _) in sorted(e.failures.items())] if isinstance(e, CheckpointException)
                 else [f"{type(e).__name__}: {e}"])
        raise CheckpointError(f"{header}: " + "; ".join(lines)) from None


def _commit(tmp: Path, final: Path, files: dict[str, tuple[int, int]]) -> None:
    """Rank 0, once every rank's files are written: checksums.json, then the rename (atomic)."""
    files[".metadata"] = ((tmp / ".metadata").stat().st_size, _crc(tmp / ".metadata"))
    with open(tmp / MANIFEST, "w") as f:
        json.dump({name: {"bytes": n, "crc32": c} for name, (n, c) in sorted(files.items())}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    old = final.with_name(f"{final.name}.old-{os.getpid()}")
    if final.exists():                                # a checkpoint of the same step: replaced
        final.rename(old)
    tmp.rename(final)                                 # the commit
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)                                  # the rename itself on disk
    finally:
        os.close(fd)


def save(directory, state: dict[str, GlobalTensor], meta: dict, *, group=None) -> Saved:
    """Write this rank's ``state`` as ``directory/step_<meta['step']:06d>`` (every rank of ``group`` calls it).

    Into ``step_….tmp`` (a stale one is removed first): DCP returns on every rank once its
    coordinator has written ``.metadata`` (after every rank's files); each rank sums its files
    (CRC-32), rank 0 writes them to ``checksums.json`` and renames the directory — the commit.  The
    ranks agree after the preparation and after the commit (one all-gather each, which is also the
    barrier), so a rank that fails makes every rank raise CheckpointError instead of waiting."""
    t0 = time.perf_counter()
    root = Path(directory)
    final = root / f"step_{int(meta['step']):06d}"
    tmp = root / f"{final.name}.tmp"
    header = f"could not save checkpoint {final}"
    errors = []
    if _first(group):
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)    # what a crashed save left behind
        except OSError as e:
            errors.append(f"{type(e).__name__}: {e}")
    _agree(header, errors, group)
    _dcp(dcp.save, header, storage_writer=dcp.FileSystemWriter(tmp), planner=_SavePlanner(state, meta),
         process_group=group)
    try:
        mine = ({f.name: (f.stat().st_size, _crc(f)) for f in tmp.glob(f"__{comm.rank(group)}_*.distcp")}, [])
    except OSError as e:
        mine = ({}, [f"{type(e).__name__}: {e}"])
    parts = _all_gather(mine, group)
    files = {k: v for part, _ in parts for k, v in part.items()}
    errors = [e for _, errs in parts for e in errs]
    if _first(group) and not errors:
        try:
            _commit(tmp, final, dict(files))
        except OSError as e:
            errors.append(f"{type(e).__name__}: {e}")
    _agree(header, errors, group)
    per_rank: dict[int, int] = {}
    for name, (n, _) in files.items():
        r = int(name[2:].split("_")[0])
        per_rank[r] = per_rank.get(r, 0) + n
    return Saved(final, time.perf_counter() - t0, per_rank)


def latest(directory) -> Path | None:
    """The newest complete checkpoint in ``directory`` — ``step_<n>`` with its ``.metadata`` and
    ``checksums.json`` — or None.  ``.tmp`` directories (a save that did not finish) are ignored."""
    root = Path(directory)
    if not root.is_dir():
        return None
    done = [(int(m.group(1)), p) for p in root.iterdir()
            if (m := STEP_DIR.fullmatch(p.name)) and (p / ".metadata").is_file() and (p / MANIFEST).is_file()]
    return max(done)[1] if done else None


def _agree(header: str, errors: list[str], group) -> None:
    """Every rank's errors to every rank (one all-gather), then CheckpointError(header: errors) everywhere."""
    errors = list(dict.fromkeys(e for part in _all_gather(errors, group) for e in part))
    if errors:
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise CheckpointError(f"{header}: " + "; ".join(errors[:3]) + more)


def _verify(path: Path, group) -> list[str]:
    """This rank's share of the files (round-robin) against checksums.json: present, same size, same CRC."""
    try:
        files = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return [f"no readable {MANIFEST} (incomplete or damaged?): {type(e).__name__}: {e}"]
    bad = []
    for name in sorted(files)[comm.rank(group)::comm.world_size(group)]:
        f, want = path / name, files[name]
        if not f.is_file():
            bad.append(f"its file {name} is missing")
        elif f.stat().st_size != want["bytes"]:
            bad.append(f"its file {name} has {f.stat().st_size} bytes, {want['bytes']} were written (truncated?)")
        elif _crc(f) != want["crc32"]:
            bad.append(f"its file {name} is damaged (its CRC-32 differs from the one written)")
    return bad


def _check(saved: dict, state: dict[str, GlobalTensor], expected: dict[str, tuple]) -> list[str]:
    """The saved tensors against this model: every key, its global shape, the dtype of my slices."""
    tensors = {k: md for k, md in saved.items() if hasattr(md, "size")}
    bad = [f"it has no tensor {k} {tuple(s)} that this model needs" for k, s in expected.items() if k not in tensors]
    bad += [f"its tensor {k} {tuple(md.size)} is not in this model" for k, md in tensors.items() if k not in expected]
    bad += [f"tensor {k} is saved with shape {tuple(md.size)}, this model's is {tuple(expected[k])}"
            for k, md in tensors.items() if k in expected and tuple(md.size) != tuple(expected[k])]
    bad += [f"tensor {k} is saved as {tensors[k].properties.dtype}, this run holds {gt.pieces[0][1].dtype}"
            for k, gt in state.items() if k in tensors and gt.pieces
            and tensors[k].properties.dtype != gt.pieces[0][1].dtype]
    if "train" not in saved:
        bad.append("it has no 'train' entry (the step number)")
    return bad


def load(path, state: dict[str, GlobalTensor], meta: dict, expected: dict[str, tuple], *, group=None) -> dict:
    """Load checkpoint ``path`` into ``state`` (in place) on every rank of ``group``; returns its ``train``
    entry.  ``expected``: every global key → shape this model has; ``meta``: this run's ``train``
    entry (.checkpoint.run_meta) — the saved config, seed and batch size must equal its.

    First every rank verifies its share of the files and checks ``.metadata``; the ranks agree;
    then the ``train`` entry is read and compared; only then the tensors.  Anything wrong raises
    :class:`CheckpointError` on every rank."""
    path = Path(path)
    errors = _verify(path, group)
    try:
        errors += _check(dcp.FileSystemReader(path).read_metadata().state_dict_metadata, state, expected)
    except Exception as e:                            # noqa: BLE001 - a missing or damaged .metadata
        errors.append(f"no readable .metadata: {type(e).__name__}: {e}")
    _agree(f"checkpoint {path} refused", errors, group)
    planner = _LoadPlanner({}, want_meta=True)
    unreadable = f"checkpoint {path} could not be read"
    _dcp(dcp.load, unreadable, storage_reader=dcp.FileSystemReader(path), planner=planner, process_group=group)
    got = planner.meta
    errors = [f"it was saved with {k}={got.get(k)!r}, this run has {meta[k]!r}"
              for k in ("seed", "batch_size") if got.get(k) != meta[k]]
    errors += [f"it was saved with {k}={v!r}, this run's config has {meta['config'].get(k)!r}"
               for k, v in got.get("config", {}).items() if meta["config"].get(k) != v]
    _agree(f"checkpoint {path} refused", errors, group)
    _dcp(dcp.load, unreadable, storage_reader=dcp.FileSystemReader(path), planner=_LoadPlanner(state),
         process_group=group)
    return got
