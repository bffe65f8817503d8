"""Deltas: the rows changed since the last publish and the dense parameters, numbered and
published beside a base export, so a serving fleet follows training without full exports.

An export directory (``model.json``, ``model.pt``) may hold ``deltas/000001/``,
``deltas/000002/``, ... Each delta holds:

* ``rows.pt``: ``{state dict key of a table: {"ids": int64 [n], "rows": [n, dim]}}``, the
  table's rows whose weights may have changed since the previous delta (weights only);
* ``dense.pt``: every other tensor of the state dict (the dense, interaction and over arches),
  in full;
* ``manifest.json``, written last: format, sequence number, training step, the id of the base
  it applies to, the previous delta's sequence number, and each file's size and sha256.

A delta is written into a hidden temporary directory, fsynced, and renamed into place, so a
reader sees all of it or nothing; a directory without its manifest is not published and is
ignored. :func:`apply_deltas` applies them in order and refuses a gap, a duplicate, an
out-of-order delta, a delta of another base, or a file whose checksum differs, naming the delta.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from raytrec.checkpoint.errors import CheckpointError
from raytrec.checkpoint.layout import _fsync_dir

__all__ = [
    "DELTAS",
    "DeltaError",
    "DeltaManifest",
    "DeltaWriter",
    "TableRows",
    "apply_deltas",
    "delta_name",
    "published_deltas",
    "write_delta",
]

DELTAS = "deltas"
DELTA_FORMAT = "raytrec-delta"
DELTA_FORMAT_VERSION = 1
ROWS_FILE = "rows.pt"
DENSE_FILE = "dense.pt"
DELTA_MANIFEST = "manifest.json"
_NAME = re.compile(r"^\d{6,}$")

#: A table's changed rows: (row ids int64 [n], their rows [n, dim]).
TableRows = tuple[torch.Tensor, torch.Tensor]


class DeltaError(CheckpointError):
    """A delta that cannot be applied: missing, duplicated, out of order, of another base, or
    corrupt."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeltaManifest:
    """What ``manifest.json`` of a delta says."""

    seq: int
    step: int
    base_id: str
    previous: int  # the previous delta's seq; 0 for the first
    files: dict[str, dict[str, Any]]  # name -> {"bytes": int, "sha256": str}

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": DELTA_FORMAT,
            "format_version": DELTA_FORMAT_VERSION,
            "seq": self.seq,
            "step": self.step,
            "base_id": self.base_id,
            "previous": self.previous,
            "files": self.files,
        }

    @classmethod
    def read(cls, directory: str) -> DeltaManifest:
        file = os.path.join(directory, DELTA_MANIFEST)
        try:
            with open(file) as f:
                doc = json.load(f)
            if doc.get("format") != DELTA_FORMAT or doc.get("format_version") != (
                DELTA_FORMAT_VERSION
            ):
                raise ValueError(f"not a {DELTA_FORMAT} v{DELTA_FORMAT_VERSION} manifest")
            return cls(
                seq=int(doc["seq"]),
                step=int(doc["step"]),
                base_id=str(doc["base_id"]),
                previous=int(doc["previous"]),
                files={str(k): dict(v) for k, v in doc["files"].items()},
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DeltaError(f"delta {directory}: unreadable {DELTA_MANIFEST} ({e})") from None


def delta_name(seq: int) -> str:
    """The directory name of delta ``seq``: six digits, so names sort in order."""
    return f"{seq:06d}"


def _sha256(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def published_deltas(export_dir: str) -> list[tuple[str, DeltaManifest]]:
    """The published deltas of ``export_dir`` (directories with a manifest), by sequence
    number, checked: no gap from 1, no duplicate, each named by its sequence number and
    following the previous one. Hidden (temporary) directories and directories without a
    manifest (not published) are skipped; an unpublished one before a published one is a gap."""
    root = os.path.join(export_dir, DELTAS)
    if not os.path.isdir(root):
        return []
    found: dict[int, list[tuple[str, DeltaManifest]]] = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith(".") or not os.path.isdir(path):
            continue
        if not os.path.exists(os.path.join(path, DELTA_MANIFEST)):
            continue  # not published
        manifest = DeltaManifest.read(path)
        found.setdefault(manifest.seq, []).append((path, manifest))
    for seq, copies in sorted(found.items()):
        if len(copies) > 1:
            paths = ", ".join(p for p, _ in copies)
            raise DeltaError(f"delta {seq} is published more than once: {paths}")
    out = [copies[0] for _, copies in sorted(found.items())]
    for expected, (path, manifest) in enumerate(out, start=1):
        if os.path.basename(path) != delta_name(manifest.seq):
            raise DeltaError(
                f"delta {path}: its manifest says sequence {manifest.seq}, its name "
                f"{os.path.basename(path)} (a delta renamed or copied out of place)"
            )
        if manifest.seq != expected:
            before = "the base" if expected == 1 else out[expected - 2][0]
            raise DeltaError(
                f"delta {expected} is missing: {path} (delta {manifest.seq}) follows {before}"
            )
        if manifest.previous != expected - 1:
            raise DeltaError(
                f"delta {path} is out of order: it follows delta {manifest.previous}, "
                f"not {expected - 1}"
            )
    return out


def _verified(path: str, manifest: DeltaManifest, name: str) -> str:
    file = os.path.join(path, name)
    entry = manifest.files.get(name)
    if entry is None or not os.path.isfile(file):
        raise DeltaError(f"delta {path} is incomplete: {name} missing")
    if os.path.getsize(file) != entry["bytes"] or _sha256(file) != entry["sha256"]:
        raise DeltaError(f"delta {path} is corrupt: {name} does not match its checksum")
    return file


def apply_deltas(
    export_dir: str, state: dict[str, torch.Tensor], base_id: str
) -> DeltaManifest | None:
    """Applies the published deltas of ``export_dir`` to ``state`` (the base's state dict) in
    place, in order; the last delta's manifest, None when there is none. Refuses (with a
    :class:`DeltaError` naming the delta) a gap, a duplicate, an out-of-order delta, one of
    another base, a corrupt file, or a key or shape the base does not have."""
    last = None
    for path, manifest in published_deltas(export_dir):
        if manifest.base_id != base_id:
            raise DeltaError(
                f"delta {path} belongs to base {manifest.base_id}, not to this export's base "
                f"{base_id}"
            )
        rows = torch.load(_verified(path, manifest, ROWS_FILE), weights_only=True)
        dense = torch.load(_verified(path, manifest, DENSE_FILE), weights_only=True)
        for key, table in rows.items():
            target = state.get(key)
            ids, values = table["ids"], table["rows"]
            if target is None or target.dim() != 2 or values.shape[1:] != target.shape[1:]:
                raise DeltaError(f"delta {path}: table {key!r} does not fit the base")
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= target.shape[0]):
                raise DeltaError(f"delta {path}: table {key!r} has row ids out of range")
            target[ids] = values.to(target.dtype)
        for key, value in dense.items():
            if key not in state or state[key].shape != value.shape:
                raise DeltaError(f"delta {path}: dense tensor {key!r} does not fit the base")
            state[key] = value
        last = manifest
    return last


def write_delta(
    export_dir: str,
    *,
    base_id: str,
    seq: int,
    step: int,
    rows: Mapping[str, TableRows],
    dense: Mapping[str, torch.Tensor],
) -> str:
    """Publishes delta ``seq`` of ``export_dir`` atomically and returns its path: files
    written and fsynced in a hidden directory, the manifest last, then renamed into
    ``deltas/<seq>``. Refuses a ``seq`` that is not the next one."""
    root = os.path.join(export_dir, DELTAS)
    os.makedirs(root, exist_ok=True)
    published = published_deltas(export_dir)
    if seq != len(published) + 1:
        raise DeltaError(
            f"delta {seq} cannot be published in {root}: the next delta is {len(published) + 1}"
        )
    final = os.path.join(root, delta_name(seq))
    tmp = os.path.join(root, f".{delta_name(seq)}.{uuid.uuid4().hex}")
    os.makedirs(tmp)
    try:
        tables = {
            k: {"ids": ids.to(torch.int64).contiguous(), "rows": values.contiguous()}
            for k, (ids, values) in rows.items()
        }
        torch.save(tables, os.path.join(tmp, ROWS_FILE))
        torch.save({k: v.contiguous() for k, v in dense.items()}, os.path.join(tmp, DENSE_FILE))
        files = {}
        for name in (ROWS_FILE, DENSE_FILE):
            file = os.path.join(tmp, name)
            _fsync_dir(file)
            files[name] = {"bytes": os.path.getsize(file), "sha256": _sha256(file)}
        manifest = DeltaManifest(seq=seq, step=step, base_id=base_id, previous=seq - 1, files=files)
        with open(os.path.join(tmp, DELTA_MANIFEST), "w") as f:
            json.dump(manifest.to_dict(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.exists(final):  # an unpublished leftover (no manifest) of a failed publish
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


class DeltaWriter:
    """Publishes deltas of one export in a background thread: :meth:`publish` copies the rows
    and dense tensors it is given (the only time the caller waits) and returns; the write runs
    while training goes on. One write at a time: a publish first waits for the previous write,
    and a failed write is raised by the next :meth:`publish` or :meth:`wait`."""

    def __init__(self, export_dir: str, base_id: str) -> None:
        self.export_dir, self.base_id = export_dir, base_id
        self.seq = len(published_deltas(export_dir))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def publish(
        self, step: int, rows: Mapping[str, TableRows], dense: Mapping[str, torch.Tensor]
    ) -> int:
        """Copies ``rows`` and ``dense`` and starts writing them as the next delta; its
        sequence number."""
        self.wait()
        rows_copy = {k: (i.detach().clone(), r.detach().clone()) for k, (i, r) in rows.items()}
        dense_copy = {k: v.detach().clone() for k, v in dense.items()}
        self.seq += 1
        seq = self.seq

        def write() -> None:
            try:
                write_delta(
                    self.export_dir,
                    base_id=self.base_id,
                    seq=seq,
                    step=step,
                    rows=rows_copy,
                    dense=dense_copy,
                )
            except BaseException as e:
                self._error = e

        self._thread = threading.Thread(target=write, name=f"delta-{seq}", daemon=True)
        self._thread.start()
        return seq

    def wait(self) -> None:
        """Waits for the write under way; raises its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            self.seq -= 1  # not published: the next publish takes its number
            raise error
