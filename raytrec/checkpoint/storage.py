"""DCP storage for a plain local path or any fsspec / pyarrow filesystem URI.

A plain path gets DCP's local ``FileSystemWriter`` and
:class:`~raytrec.checkpoint.reader.DirectReader` (DCP's ``FileSystemReader``,
reading straight into the destination tensors). A URI is resolved by
:func:`raytrec.checkpoint.layout.filesystem` (fsspec, or pyarrow where fsspec
lacks the protocol's package) and DCP's fsspec file access runs over that
filesystem; DCP's own ``FsspecWriter`` would resolve the URI with fsspec alone.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecFileSystem
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from raytrec.checkpoint.layout import filesystem
from raytrec.checkpoint.reader import DirectReader

__all__ = ["storage_reader", "storage_writer"]


class _OpenedFilesystem(_FsspecFileSystem):
    """DCP's fsspec file access over a filesystem already resolved by :func:`filesystem`."""

    def __init__(self, fs: Any) -> None:
        super().__init__()
        self.fs = fs

    def init_path(self, path: Any, **kwargs: Any) -> Any:
        return path


class _UriWriter(FileSystemWriter):
    def __init__(self, uri: str) -> None:
        fs, path = filesystem(uri)
        super().__init__(path)
        # DCP uses ``fs`` only through its FileSystemBase interface, which this implements.
        self.fs = _OpenedFilesystem(fs)  # type: ignore[assignment]
        self.path = path


class _UriReader(DirectReader):
    def __init__(self, uri: str) -> None:
        fs, path = filesystem(uri)
        super().__init__(path)
        self.fs = _OpenedFilesystem(fs)  # type: ignore[assignment]
        self.path = path


def storage_writer(uri: str) -> StorageWriter:
    """DCP's local writer for a plain path; for a URI (``file://``, ``s3://``) DCP's fsspec
    file access over the URI's fsspec or pyarrow filesystem."""
    return _UriWriter(uri) if "://" in uri else FileSystemWriter(uri)


def storage_reader(uri: str) -> StorageReader:
    """:class:`~raytrec.checkpoint.reader.DirectReader` for a plain path; for a URI, the same
    over the URI's fsspec or pyarrow filesystem."""
    return _UriReader(uri) if "://" in uri else DirectReader(uri)
