"""DCP's ``FileSystemReader``, reading each tensor's bytes straight into its destination.

DCP's reader loads every saved piece with ``torch.load`` into a fresh tensor and
copies that into the destination: two passes over the bytes, and page faults on
memory touched for the first time. This reader keeps DCP's file layout, planner
and metadata, and splits the read in two steps:

* :meth:`DirectReader.prepare_local_plan` (DCP calls it on every rank before the
  plans are exchanged, so an error there fails the load on every rank before
  anything is read): reads the small ``torch.save`` header of each record this
  rank will read, on the meta device, and checks where the record's bytes lie.
* :meth:`DirectReader.read_data`: reads each piece with ``preadv`` directly into
  the planner's destination tensor (the tables' own storage when the state dict
  holds them), split in chunks over a few threads. A destination that is not one
  contiguous CPU block of the saved dtype (a column slice, a GPU tensor) gets the
  bytes in a scratch tensor and a copy. A record this reader cannot place (DCP
  stream transforms, several storages) goes through DCP's own reader.
"""

from __future__ import annotations

import dataclasses
import io
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_THREADS", "DirectReader", "RecordLayout"]

DEFAULT_THREADS = max(1, min(4, os.cpu_count() or 1))
DEFAULT_CHUNK_BYTES = 8 << 20  # one read call; large reads are split so the threads share them


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    """Where one saved tensor's bytes lie in its ``torch.save`` record."""

    meta: torch.Tensor  # the saved tensor on the meta device: dtype, shape, strides, offset
    data_offset: int  # where its storage's first byte lies, from the record's start

    def offset_of(self, piece: torch.Tensor) -> int:
        """Where the first byte of ``piece`` (a view of :attr:`meta`) lies in the record."""
        return self.data_offset + int(piece.storage_offset()) * piece.element_size()


def parse_record(
    stream: IO[bytes], where: str, name: str, seen: dict[bytes, torch.Tensor] | None = None
) -> RecordLayout | None:
    """The layout of the ``torch.save`` record ``stream`` (a view of exactly the record, found
    at ``where``, of tensor ``name``), from its zip directory and pickle; the tensor's bytes are
    not read. None where it is not one tensor over one storage in this machine's byte order
    (DCP's reader then loads it). ``seen``: tensors already unpickled, by their pickle (records
    of tables of one shape have the same), so each distinct pickle is unpickled once."""
    try:
        archive: Any = torch._C.PyTorchFileReader(stream)  # what torch.load opens it with
        storages = [r for r in archive.get_all_records() if r.startswith("data/")]
        byteorder = (
            archive.get_record("byteorder").decode()
            if archive.has_record("byteorder")
            else "little"  # torch.load's default for records without the mark
        )
        placeable = storages == ["data/0"]
        data_offset = archive.get_record_offset("data/0") if placeable else -1
        data_size = -1
        if placeable:  # torch before 2.12 has no get_record_size: read the record's length
            sized = getattr(archive, "get_record_size", None)
            data_size = sized("data/0") if sized else len(archive.get_record("data/0"))
        pickled = archive.get_record("data.pkl")
        meta = seen.get(pickled) if seen is not None else None
        if meta is None:
            stream.seek(0)
            meta = torch.load(stream, map_location="meta", weights_only=True)
    except Exception as e:
        raise ValueError(f"{where}: not a readable torch.save record ({name!r}: {e})") from None
    if not isinstance(meta, torch.Tensor):
        raise ValueError(f"{where}: {name!r} holds a {type(meta).__name__}, not a tensor")
    if seen is not None:
        seen[pickled] = meta
    if not placeable or byteorder != sys.byteorder:
        return None
    nbytes = meta.untyped_storage().nbytes()
    if data_size != nbytes:
        raise ValueError(
            f"{where}: {name!r} has {data_size} bytes of data, its tensor needs {nbytes}"
        )
    stream.seek(0, io.SEEK_END)
    length = stream.tell()
    if data_offset + nbytes > length:
        raise ValueError(
            f"{where}: the bytes of {name!r} end at {data_offset + nbytes}, past the record's "
            f"{length}"
        )
    return RecordLayout(meta=meta, data_offset=data_offset)


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable."""
    return t.detach().reshape(-1).view(torch.uint8).numpy().data


def _pread_into(fd: int, view: memoryview, offset: int, where: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"{where}: the file ends at byte {offset + done}, inside a tensor")
        done += n


def _stream_read_into(stream: Any, view: memoryview, offset: int, where: str) -> None:
    stream.seek(offset)
    done = 0
    while done < len(view):
        if hasattr(stream, "readinto"):
            n = stream.readinto(view[done:])
        else:
            data = stream.read(len(view) - done)
            n = len(data)
            view[done : done + n] = data
        if not n:
            raise OSError(f"{where}: the file ends at byte {offset + done}, inside a tensor")
        done += n


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One read: the bytes of ``into`` from ``offset`` of the file, then, if ``then`` is set,
    the copy that brings them to ``destination`` (else ``into`` is the destination)."""

    req: ReadItem
    destination: torch.Tensor
    into: torch.Tensor
    offset: int
    then: Callable[[], None] | None = None


class DirectReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with reads straight into the destination tensors.

    ``thread_count`` threads share the reads of a file, in chunks of ``chunk_bytes``; on a
    filesystem other than the local one (fsspec, pyarrow) the reads run in order on one stream.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        thread_count: int = DEFAULT_THREADS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        if chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, got {chunk_bytes}")
        super().__init__(path)
        self.thread_count = thread_count
        self.chunk_bytes = chunk_bytes
        self.records: dict[MetadataIndex, RecordLayout | None] = {}
        # Set when the reads into the destinations begin (every rank's checks passed).
        self.started_reading = False

    # -- DCP's StorageReader hooks ---------------------------------------------------

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Reads and checks the header of every tensor record ``plan`` reads; raises (so DCP
        fails the load on every rank before any read) if one is not a readable record."""
        self.records = {}
        self.started_reading = False
        by_file: dict[str, list[MetadataIndex]] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO or item.storage_index in self.records:
                continue
            info: _StorageInfo = self.storage_data[item.storage_index]
            self.records[item.storage_index] = None
            if not info.transform_descriptors:
                by_file.setdefault(info.relative_path, []).append(item.storage_index)
        seen: dict[bytes, torch.Tensor] = {}
        for relative_path, indices in by_file.items():
            infos = [self.storage_data[i] for i in indices]
            path = self.fs.concat_path(self.path, relative_path)
            with self.fs.create_stream(path, "rb") as stream:
                for index, info in zip(indices, infos, strict=True):
                    where = f"{relative_path} byte {info.offset}"
                    view = self._slice_file(stream, info)
                    self.records[index] = parse_record(view, where, index.fqn, seen)
        return plan

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.started_reading = True
        direct: list[ReadItem] = []
        others: list[ReadItem] = []
        for r in plan.items:
            placed = r.type == LoadItemType.TENSOR and self.records.get(r.storage_index)
            (direct if placed else others).append(r)
        if others:  # byte items (pickled objects) and records this reader cannot place
            super().read_data(dataclasses.replace(plan, items=others), planner).wait()
        per_file: dict[str, list[_Piece]] = {}
        for req in direct:
            info: _StorageInfo = self.storage_data[req.storage_index]
            record = self.records[req.storage_index]
            assert record is not None
            per_file.setdefault(info.relative_path, []).append(
                self._piece(req, info, record, planner)
            )
        for relative_path, pieces in per_file.items():
            pieces.sort(key=lambda p: p.offset)
            self._read_pieces(relative_path, pieces)
            for piece in pieces:
                if piece.then is not None:
                    piece.then()
                planner.commit_tensor(piece.req, piece.destination)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- pieces ---------------------------------------------------------------------

    def _piece(
        self, req: ReadItem, info: _StorageInfo, record: RecordLayout, planner: LoadPlanner
    ) -> _Piece:
        target = planner.resolve_tensor(req).detach()
        source = narrow_tensor_by_index(record.meta, req.storage_offsets, req.lengths)
        if target.size() != source.size():
            raise AssertionError(
                f"req {req.storage_index} mismatch sizes {target.size()} vs {source.size()}"
            )
        if source.is_contiguous():
            offset = record.offset_of(source)
            if (
                target.device.type == "cpu"
                and target.dtype == source.dtype
                and target.is_contiguous()
            ):
                return _Piece(req, target, target, info.offset + offset)
            scratch = torch.empty(source.shape, dtype=source.dtype)

            def copy_scratch() -> None:
                target.copy_(scratch)

            return _Piece(req, target, scratch, info.offset + offset, copy_scratch)
        # A piece that is not one block of the saved tensor (some of its columns): its whole
        # storage, then the piece of it.
        storage = torch.empty(record.meta.untyped_storage().nbytes(), dtype=torch.uint8)
        whole = torch.empty(0, dtype=source.dtype).set_(
            storage.untyped_storage(),
            record.meta.storage_offset(),
            record.meta.shape,
            record.meta.stride(),
        )

        def copy() -> None:
            target.copy_(narrow_tensor_by_index(whole, req.storage_offsets, req.lengths))

        return _Piece(req, target, storage, info.offset + record.data_offset, copy)

    def _read_pieces(self, relative_path: str, pieces: list[_Piece]) -> None:
        path = self.fs.concat_path(self.path, relative_path)
        jobs = [
            (view[start : start + self.chunk_bytes], piece.offset + start)
            for piece in pieces
            for view in [_byte_view(piece.into)]
            for start in range(0, len(view), self.chunk_bytes)
        ]
        if not isinstance(self.fs, FileSystem):  # fsspec / pyarrow: one stream, in order
            with self.fs.create_stream(path, "rb") as stream:
                for view, offset in jobs:
                    _stream_read_into(stream, view, offset, relative_path)
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            if self.thread_count == 1 or len(jobs) == 1:
                for view, offset in jobs:
                    _pread_into(fd, view, offset, relative_path)
                return
            with ThreadPoolExecutor(self.thread_count, thread_name_prefix="dcp-read") as pool:
                futures = [pool.submit(_pread_into, fd, v, o, relative_path) for v, o in jobs]
                for f in futures:
                    f.result()
        finally:
            os.close(fd)
