"""Checkpoints on a filesystem: naming, atomic commit, listing, keep-last-K, verification.

A job's checkpoints live in one root directory (``<run_dir>/checkpoints``),
on any fsspec or pyarrow filesystem (a local path, ``file://``, ``s3://``,
...; :func:`filesystem`), one directory per checkpoint named
``checkpoint_<step, 10 digits>``.

A checkpoint becomes visible only when complete. Every directory's commit
marker (``_COMMITTED``, holding the SHA-256 of the manifest) is written last,
after the data files and the manifest; listing ignores any directory without
it. On a local filesystem the checkpoint is also written under a hidden
temporary name (``.checkpoint_<step>.tmp-<nonce>``) and renamed into place
once committed, so even its name appears atomically; object stores have no
atomic rename, and there the marker alone is the commit.

:func:`read_manifest` verifies a checkpoint before anything reads its
tensors: the directory exists, it was committed, the manifest matches the
marker's digest, and every data file the manifest lists is there with its
recorded size. Each failure is a :class:`CheckpointError` saying which.

No torch here; only fsspec (or pyarrow) and the JSON manifest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import re
import secrets
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from raytrec.checkpoint.config import CheckpointConfig, SavedCheckpoint, checkpoints_to_remove
from raytrec.checkpoint.errors import CheckpointError
from raytrec.checkpoint.manifest import Manifest

__all__ = [
    "MANIFEST",
    "MARKER",
    "CheckpointRef",
    "CheckpointStore",
    "PendingCheckpoint",
    "arrow_filesystem",
    "checkpoint_name",
    "data_files",
    "filesystem",
    "read_manifest",
]

MANIFEST = "manifest.json"
MARKER = "_COMMITTED"
_NAME = re.compile(r"^checkpoint_(\d+)$")
_TEMP = re.compile(r"^\.checkpoint_(\d+)\.(tmp|old)-[0-9a-f]+$")


def checkpoint_name(step: int) -> str:
    return f"checkpoint_{step:010d}"


def _join(uri: str, name: str) -> str:
    return uri.rstrip("/") + "/" + name


def filesystem(uri: str, **storage_options: Any) -> tuple[AbstractFileSystem, str]:
    """The filesystem and path of a local path or URI.

    fsspec first; where fsspec has the protocol but not its package (``s3://``
    without s3fs, say), pyarrow's filesystem for the URI, as Ray Train uses,
    wrapped for fsspec.
    """
    try:
        return url_to_fs(uri, **storage_options)
    except ImportError as missing:
        try:
            return arrow_filesystem(uri)
        except Exception as e:
            raise CheckpointError(
                f"cannot open checkpoint location {uri!r}: fsspec: {missing}; pyarrow: {e}"
            ) from None
    except ValueError as e:
        raise CheckpointError(f"cannot open checkpoint location {uri!r}: {e}") from None


def arrow_filesystem(uri: str) -> tuple[AbstractFileSystem, str]:
    """pyarrow's filesystem for ``uri`` (``pyarrow.fs.FileSystem.from_uri``), as fsspec's."""
    from fsspec.implementations.arrow import ArrowFSWrapper
    from pyarrow import fs as arrow_fs

    fs, path = arrow_fs.FileSystem.from_uri(uri)
    return ArrowFSWrapper(fs), path


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointRef:
    """A committed checkpoint: its step and where it is (a path or URI)."""

    step: int
    uri: str

    @property
    def name(self) -> str:
        return posixpath.basename(self.uri.rstrip("/"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PendingCheckpoint:
    """A checkpoint being written: the data goes to ``write_uri`` until :meth:`commit`."""

    step: int
    write_uri: str
    final_uri: str


class CheckpointStore:
    """The checkpoints of one job under ``root``; one writer at a time."""

    def __init__(self, root: str, **storage_options: Any) -> None:
        self.root = root
        self.fs, self._root = filesystem(root, **storage_options)
        # A local rename is atomic; an object store's "rename" is copy + delete.
        self.atomic_rename = isinstance(self.fs, LocalFileSystem)

    def _path(self, name: str) -> str:
        return posixpath.join(self._root, name)

    def _names(self) -> list[str]:
        try:
            entries = self.fs.ls(self._root, detail=False)
        except FileNotFoundError:
            return []
        return [posixpath.basename(str(e).rstrip("/")) for e in entries]

    # -- reading -----------------------------------------------------------

    def committed(self) -> list[CheckpointRef]:
        """Committed checkpoints, oldest step first."""
        refs = []
        for name in self._names():
            m = _NAME.match(name)
            if m and self.fs.exists(posixpath.join(self._path(name), MARKER)):
                refs.append(CheckpointRef(step=int(m.group(1)), uri=_join(self.root, name)))
        return sorted(refs, key=lambda r: r.step)

    def latest(self) -> CheckpointRef | None:
        refs = self.committed()
        return refs[-1] if refs else None

    def uncommitted(self) -> list[str]:
        """Names of directories left by saves that never committed (or by replaced ones)."""
        out = []
        for name in self._names():
            leftover = _TEMP.match(name) is not None
            partial = _NAME.match(name) is not None and not self.fs.exists(
                posixpath.join(self._path(name), MARKER)
            )
            if leftover or partial:
                out.append(name)
        return sorted(out)

    # -- writing -------------------------------------------------------------

    def begin(self, step: int) -> PendingCheckpoint:
        """Creates the directory the checkpoint of ``step`` is written into."""
        name = checkpoint_name(step)
        if self.atomic_rename:
            temp = f".{name}.tmp-{secrets.token_hex(4)}"
            self.fs.makedirs(self._path(temp), exist_ok=False)
            return PendingCheckpoint(
                step=step, write_uri=_join(self.root, temp), final_uri=_join(self.root, name)
            )
        # No atomic rename: write in place. A directory already there for this step (a
        # failed save, or one this save replaces after a rewind) is removed marker first.
        if self.fs.exists(self._path(name)):
            self._remove(name)
        self.fs.makedirs(self._path(name), exist_ok=True)
        uri = _join(self.root, name)
        return PendingCheckpoint(step=step, write_uri=uri, final_uri=uri)

    def commit(self, pending: PendingCheckpoint, manifest: Manifest) -> CheckpointRef:
        """Writes the manifest, then the commit marker, then (locally) renames into place."""
        if manifest.step != pending.step:
            raise CheckpointError(
                f"manifest step {manifest.step} does not match the pending checkpoint's "
                f"step {pending.step}"
            )
        _, write_path = filesystem(pending.write_uri)
        text = manifest.to_json().encode()
        marker = json.dumps(
            {"step": pending.step, "manifest_sha256": hashlib.sha256(text).hexdigest()}
        ).encode()
        self._write(posixpath.join(write_path, MANIFEST), text)
        self._write(posixpath.join(write_path, MARKER), marker)
        if self.atomic_rename:
            final = self._path(checkpoint_name(pending.step))
            if os.path.exists(final):  # replaced (a rewind saves a step again)
                old = self._path(f".{checkpoint_name(pending.step)}.old-{secrets.token_hex(4)}")
                os.rename(final, old)
                os.rename(write_path, final)
                self.fs.rm(old, recursive=True)
            else:
                os.rename(write_path, final)
            _fsync_dir(self._root)
        return CheckpointRef(step=pending.step, uri=pending.final_uri)

    def _write(self, path: str, data: bytes) -> None:
        if self.atomic_rename:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            self.fs.pipe_file(path, data)

    def prune(
        self, retention: CheckpointConfig | int | None, *, keep: str | None = None
    ) -> list[str]:
        """Removes the committed checkpoints that ``retention`` does not keep
        (:func:`~raytrec.checkpoint.config.checkpoints_to_remove`: an int keeps the newest that
        many, None keeps all) and every uncommitted directory except ``keep``; returns the
        removed names.

        Call it after a commit, when no other save is in flight.
        """
        if not isinstance(retention, CheckpointConfig):
            retention = CheckpointConfig(num_to_keep=retention)
        removed = [n for n in self.uncommitted() if n != keep]
        if retention.num_to_keep is not None:
            removed += checkpoints_to_remove(
                [
                    self.scored(ref, retention.checkpoint_score_attribute)
                    for ref in self.committed()
                ],
                retention,
            )
        for name in removed:
            self._remove(name)
        return removed

    def scored(self, ref: CheckpointRef, attribute: str | None) -> SavedCheckpoint:
        """``ref`` with its score: metric ``attribute`` at its step, from its manifest."""
        score = None
        if attribute is not None:
            value = read_manifest(ref.uri).extra.get("metrics", {}).get(attribute)
            score = None if value is None else float(value)
        return SavedCheckpoint(name=ref.name, step=ref.step, score=score)

    def _remove(self, name: str) -> None:
        path = self._path(name)
        marker = posixpath.join(path, MARKER)
        if self.fs.exists(marker):  # invisible first, then gone
            self.fs.rm(marker)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(uri: str) -> Manifest:
    """The verified manifest of the checkpoint at ``uri``; a :class:`CheckpointError` naming
    the problem when the checkpoint is missing, uncommitted, or corrupt."""
    fs, path = filesystem(uri)
    if not fs.isdir(path):
        raise CheckpointError(f"no checkpoint at {uri}: the directory does not exist")
    marker_path = posixpath.join(path, MARKER)
    manifest_path = posixpath.join(path, MANIFEST)
    if not fs.exists(marker_path):
        raise CheckpointError(
            f"checkpoint {uri} is incomplete: it has no commit marker ({MARKER}), so its save "
            "never finished (the writer may have died); resume from an earlier checkpoint"
        )
    if not fs.exists(manifest_path):
        raise CheckpointError(f"checkpoint {uri} is incomplete: {MANIFEST} is missing")
    text = fs.cat_file(manifest_path)
    try:
        recorded = json.loads(fs.cat_file(marker_path))["manifest_sha256"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"checkpoint {uri} is corrupt: its commit marker {MARKER} is unreadable"
        ) from None
    if hashlib.sha256(text).hexdigest() != recorded:
        raise CheckpointError(
            f"checkpoint {uri} is corrupt: {MANIFEST} does not match the digest in {MARKER}"
        )
    manifest = Manifest.from_json(text, where=uri)
    for name, size in sorted(manifest.files.items()):
        file_path = posixpath.join(path, name)
        if not fs.exists(file_path):
            raise CheckpointError(
                f"checkpoint {uri} is corrupt: data file {name} listed in {MANIFEST} is missing"
            )
        actual = fs.size(file_path)
        if actual != size:
            raise CheckpointError(
                f"checkpoint {uri} is corrupt: data file {name} has {actual} bytes, "
                f"{MANIFEST} records {size} (truncated or overwritten)"
            )
    return manifest


def data_files(uri: str) -> dict[str, int]:
    """``{relative name: size}`` of the files in a checkpoint directory being written."""
    fs, path = filesystem(uri)
    out = {}
    for entry in fs.find(path, detail=True).values():
        name = posixpath.relpath(str(entry["name"]), path)
        if name not in (MANIFEST, MARKER):
            out[name] = int(entry["size"])
    return out
