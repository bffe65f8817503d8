"""Parquet files as a :class:`~raytrec.data.source.BatchSource`, read by Ray Data in one of two
modes (``read_mode``), in both of which every row reaches exactly one rank once per epoch.

- ``"indexed"`` (:mod:`raytrec.data.parquet_indexed`): every batch has a fixed place in the
  data, worked out from the footers (:mod:`raytrec.data.parquet_plan`), so a batch id names its
  rows: each rank reads its own batches with a Ray Data pipeline of its own, any batch can be
  read again (:meth:`~raytrec.data.source.BatchShard.replay`, which elastic recovery uses to
  hand a lost gang's uncommitted batches to the survivors), and a stream can start at any step
  (an exact resume from a checkpoint).
- ``"streaming"`` (:class:`ParquetShard`, this module): one Ray Data pipeline for the whole job,
  cut among the ranks by ``streaming_split``. Which rows a rank gets depends on the pipeline's
  timing, so a batch cannot be named or read again.

The work is split by cost. On the driver, :meth:`ParquetSource.split` lists the files and reads
every footer (in threads: one small read per file), so a corrupt file, an empty file or a missing
or wrongly typed column fails the job before anything starts, naming the file and column. In the
streaming mode it then builds one pipeline for the whole job::

    read_parquet(files, include_paths=True)   # + a seeded file shuffle, reseeded every epoch
      -> map_batches(preprocess)              # CPU workers: all checks, all id policies
      -> union(padding rows)                  # see "Exactly once" below
      -> streaming_split(n, equal=True)       # one DataIterator per rank

``preprocess`` (:mod:`raytrec.data.preprocess`, shared by both modes) checks and converts on the
workers and writes a fixed internal layout from which a rank builds its batches' tensors, the
``KeyedJaggedTensor`` among them, with one copy and no check; an error names the file,
column and row (by its ``row_id`` when the spec has one, else by its index in the block), and the
rank re-raises it as the original :class:`~raytrec.data.arrow_kjt.BadInputError`.

Exactly once (streaming). ``streaming_split(n, equal=True)`` gives every rank the same number of
rows, which keeps ranks in step (same number of batches per epoch), but it drops the last
``N mod n`` rows of the stream to get there. ``equal=False`` drops nothing, but then shares differ
by up to a block, and ranks that train in lockstep would run out at different steps. This module
keeps ``equal=True`` and makes ``N`` a multiple of ``n``: the driver knows ``N`` from the footers
and appends ``(-N) mod n`` padding rows, marked in an ``__rt_drop`` column, which the ranks
remove. For ``N`` to stay known, rows skipped under ``on_bad_rows="skip"`` are marked rather than
removed too. So per epoch every rank receives exactly ``(N + padding) / n`` rows, every input row
reaches exactly one rank, and skip counts and row ids are known where training happens.

Epochs and shuffling (streaming): each pass of a rank's ``DataIterator`` is one epoch, and all
``n`` shards must be consumed concurrently (a ``SplitCoordinator`` actor drives one execution per
epoch for all of them). With ``shuffle_seed`` set, the read shuffles the file order with
``FileShuffleConfig(seed, reseed_after_execution=True)``: a different, reproducible order per
epoch, which streams (``randomize_block_order`` would be an all-to-all barrier that materializes
the whole dataset before the first batch). Rows within a file keep their order, unless
``shuffle_window_rows`` is set: then each rank shuffles its rows in Ray Data's local shuffle
buffer of that many rows (``iter_batches(local_shuffle_buffer_size=...)``), seeded from
``shuffle_seed``, the epoch and the rank.

Consumption accounting: a shard logs, per epoch, the row ids it yielded and the ones it dropped
as bad, as merged ranges (a file's row ids are usually contiguous, so this is small), and keeps
the ids of the batch it yielded last in ``last_row_ids``; see :meth:`ParquetShard.consumed`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray
import ray.data
import ray.exceptions

from raytrec.data.arrow_kjt import BadInputError, OnBadRows
from raytrec.data.arrow_kjt import validate_schema as _validate_schema
from raytrec.data.executor_pace import pace
from raytrec.data.parquet_indexed import IndexedParquetShard
from raytrec.data.preprocess import (
    PADDING,
    PATH,
    EpochConsumption,
    EpochLog,
    internal_columns_of,
    take_marked,
)
from raytrec.data.preprocess import (
    find_bad_input as _find_bad_input,  # under this name: the coordinator imports it from here
)
from raytrec.data.source import Batch, BatchShard, BatchSource
from raytrec.data.spec import FeatureSpec

__all__ = [
    "EpochConsumption",
    "IndexedParquetShard",
    "ParquetFileInfo",
    "ParquetShard",
    "ParquetSource",
    "ReadMode",
]

#: How ranks read: each its own batches by index (replayable), or cut from one stream.
ReadMode = Literal["indexed", "streaming"]
_DATA_SUFFIX = ".parquet"
_FOOTER_THREADS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParquetFileInfo:
    """One input file as its footer describes it."""

    path: str
    rows: int
    row_groups: int
    row_group_rows: tuple[int, ...] = ()  # rows of each row group


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParquetSource(BatchSource):
    """Parquet files read with Ray Data and split among ranks; see the module doc.

    ``paths``: one path or several, each a file or a directory (searched recursively for
    ``*.parquet``, skipping names that start with ``_`` or ``.``, such as ``_meta.json``), local
    paths or URIs pyarrow understands (``s3://bucket/prefix``), all on one filesystem; or paths
    within ``filesystem`` when that is given. ``epochs``: passes over the data; a shard's batch
    iterator ends after the last. ``shuffle_seed``: None reads files in sorted order, else files
    (streaming) or row groups (indexed) in a seeded order that changes every epoch.
    ``on_bad_rows``: ``"error"`` stops at the first bad value; ``"skip"`` drops rows holding
    one and counts them. File-level problems (corrupt, empty, wrong schema) are errors either
    way. ``prefetch_batches``: batches each rank keeps
    in flight (streaming mode). ``read_mode``: ``"indexed"`` or ``"streaming"`` (module doc).
    ``read_concurrency``: in the indexed mode, the Ray Data read tasks each rank keeps running
    (how far it reads ahead, in pieces of row groups). ``shuffle_window_rows`` (needs
    ``shuffle_seed``): rows are shuffled within windows of this many rows too (indexed:
    :mod:`raytrec.data.parquet_gather`; streaming: a local shuffle buffer in each rank).
    """

    paths: str | Sequence[str]
    spec: FeatureSpec
    filesystem: pafs.FileSystem | None = None
    epochs: int = 1
    shuffle_seed: int | None = None
    on_bad_rows: OnBadRows = "error"
    prefetch_batches: int = 2
    read_mode: ReadMode = "indexed"
    read_concurrency: int = 2
    shuffle_window_rows: int | None = None

    def __post_init__(self) -> None:
        paths = (self.paths,) if isinstance(self.paths, str | os.PathLike) else tuple(self.paths)
        paths = tuple(os.fspath(p) for p in paths)
        if not paths or not all(paths):
            raise ValueError(f"ParquetSource.paths must name at least one path, got {self.paths!r}")
        object.__setattr__(self, "paths", paths)  # frozen: normalize once, here
        if not isinstance(self.spec, FeatureSpec):
            raise TypeError(f"ParquetSource.spec must be a FeatureSpec, got {self.spec!r}")
        if self.epochs < 1:
            raise ValueError(f"ParquetSource.epochs must be >= 1, got {self.epochs!r}")
        if self.on_bad_rows not in ("error", "skip"):
            raise ValueError(
                f"ParquetSource.on_bad_rows must be 'error' or 'skip', got {self.on_bad_rows!r}"
            )
        if self.prefetch_batches < 0:
            raise ValueError(
                f"ParquetSource.prefetch_batches must be >= 0, got {self.prefetch_batches!r}"
            )
        if self.read_mode not in ("indexed", "streaming"):
            raise ValueError(
                f"ParquetSource.read_mode must be 'indexed' or 'streaming', got {self.read_mode!r}"
            )
        if self.read_concurrency < 1:
            raise ValueError(
                f"ParquetSource.read_concurrency must be >= 1, got {self.read_concurrency!r}"
            )
        if PATH in self.spec.expected_types():
            raise ValueError(
                f"ParquetSource cannot read a column named {PATH!r}: the reader adds one "
                "(the file of each row) for error messages"
            )
        if self.shuffle_seed is not None and self.shuffle_seed < 0:
            raise ValueError(
                f"ParquetSource.shuffle_seed must be None or >= 0, got {self.shuffle_seed!r}"
            )
        window = self.shuffle_window_rows
        if window is not None and (window < 1 or self.shuffle_seed is None):
            raise ValueError(
                f"ParquetSource.shuffle_window_rows must be None, or >= 1 with a shuffle_seed, "
                f"got {window!r} (shuffle_seed={self.shuffle_seed!r})"
            )

    @property
    def dense_features(self) -> int:
        return self.spec.num_dense

    @property
    def sparse_features(self) -> tuple[str, ...]:
        return self.spec.sparse_names

    def list_files(self) -> tuple[pafs.FileSystem, list[str]]:
        """The filesystem and the input files, in sorted order within each directory."""
        fs, roots = self._resolve()
        files: list[str] = []
        for root, info in zip(roots, fs.get_file_info(roots), strict=True):
            if info.type == pafs.FileType.NotFound:
                raise BadInputError("missing_file", "no such file or directory", file=root)
            if info.type == pafs.FileType.Directory:
                found = fs.get_file_info(pafs.FileSelector(root, recursive=True))
                files += sorted(
                    f.path
                    for f in found
                    if f.type == pafs.FileType.File and _is_data_file(f.path, root)
                )
            else:
                files.append(root)
        if not files:
            detail = f"no {_DATA_SUFFIX} files under {', '.join(roots)}"
            raise BadInputError("no_files", detail, file=roots[0])
        return fs, files

    def dataset(self) -> Any:
        """The spec's columns of every file as one Ray Data dataset (with each row's file in a
        ``path`` column), read in file order."""
        return self._read(*self.list_files())

    def inspect(self) -> list[ParquetFileInfo]:
        """Reads every file's footer and checks it: a readable Parquet file, with rows, and every
        column the spec needs, of the right type. Raises :class:`BadInputError` naming the first
        bad file (in listing order) and, for schema problems, the column."""
        return _check_files(*self.list_files(), self.spec)

    def footers(self, files: list[str]) -> list[ParquetFileInfo]:
        """:meth:`inspect` for ``files`` (paths within the source's filesystem) alone."""
        return _check_files(self._resolve()[0], files, self.spec) if files else []

    def split(self, num_shards: int) -> list[BatchShard]:
        """Checks the files and returns one shard per rank: :class:`IndexedParquetShard` in the
        indexed mode, :class:`ParquetShard` (after building the job's pipeline) in the streaming
        one.

        Call once per job, on the driver, with a Ray connection (``raytrec.cluster.connect``).
        """
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards!r}")
        fs, files = self.list_files()
        infos = _check_files(fs, files, self.spec)
        if self.read_mode == "indexed":
            return self._indexed(fs, infos, num_shards)
        total = sum(i.rows for i in infos)
        padding = -total % num_shards
        layout = internal_columns_of(self.spec)
        spec, on_bad_rows = self.spec, self.on_bad_rows

        def preprocess(table: pa.Table) -> pa.Table:
            # A nested function, so cloudpickle sends it by value, and the import runs only where
            # it is called: the SplitCoordinator unpickles the pipeline too, and importing this
            # module there (torch, torchrec) would add seconds to every split.
            from raytrec.data.preprocess import preprocess

            return preprocess(table, spec=spec, on_bad_rows=on_bad_rows)

        ds = self._read(fs, files).map_batches(
            preprocess,
            batch_format="pyarrow",
            batch_size=None,  # whole blocks: the conversion is vectorized, bigger is cheaper
            zero_copy_batch=True,
        )
        if padding:
            drop = pa.array([PADDING] * padding, pa.string())
            ds = ds.union(ray.data.from_arrow(layout.neutral_rows(padding, None, drop)))
        # Let a BadInputError leave the map task as itself: the default wrapper
        # (UserCodeException) keeps only its text once it has crossed the SplitCoordinator.
        ds.context.raise_original_map_exception = True
        # The job prints its own progress; Ray Data's per-operator bars would
        # interleave with it on the driver's console.
        ds.context.enable_progress_bars = False
        ds.context.enable_operator_progress_bars = False
        pace(ds.context)  # the split's executor runs in its coordinator actor: paced there
        iterators = ds.streaming_split(num_shards, equal=True)
        return [
            ParquetShard(
                iterator=it,
                index=rank,
                num_shards=num_shards,
                spec=self.spec,
                epochs=self.epochs,
                on_bad_rows=self.on_bad_rows,
                prefetch_batches=self.prefetch_batches,
                rows_per_epoch=(total + padding) // num_shards,
                shuffle_seed=self.shuffle_seed,
                shuffle_window_rows=self.shuffle_window_rows,
            )
            for rank, it in enumerate(iterators)
        ]

    def _indexed(
        self, fs: pafs.FileSystem, infos: list[ParquetFileInfo], num_shards: int
    ) -> list[BatchShard]:
        rows = sum(i.rows for i in infos)
        if rows < num_shards:
            raise ValueError(f"the data has {rows} rows, fewer than the {num_shards} ranks")
        return [
            IndexedParquetShard(
                index=rank,
                num_shards=num_shards,
                filesystem=fs,
                paths=tuple(i.path for i in infos),
                row_groups=tuple(i.row_group_rows for i in infos),
                source_spec=self.spec,
                epochs=self.epochs,
                shuffle_seed=self.shuffle_seed,
                shuffle_window_rows=self.shuffle_window_rows,
                on_bad_rows=self.on_bad_rows,
                read_concurrency=self.read_concurrency,
            )
            for rank in range(num_shards)
        ]

    def _resolve(self) -> tuple[pafs.FileSystem, list[str]]:
        paths = list(self.paths)
        if self.filesystem is not None:
            return self.filesystem, paths
        fs: pafs.FileSystem | None = None
        resolved: list[str] = []
        for path in paths:
            if "://" in path:
                path_fs, inner = pafs.FileSystem.from_uri(path)
            else:
                path_fs, inner = pafs.LocalFileSystem(), os.path.abspath(path)
            if fs is None:
                fs = path_fs
            elif not fs.equals(path_fs):
                raise ValueError(
                    f"ParquetSource.paths must all be on one filesystem: {paths[0]!r} is on "
                    f"{fs.type_name}, {path!r} on {path_fs.type_name}; pass `filesystem`"
                )
            resolved.append(inner)
        assert fs is not None  # paths is non-empty (checked in __post_init__)
        return fs, resolved

    def _read(self, fs: pafs.FileSystem, files: list[str]) -> Any:
        shuffle = None
        if self.shuffle_seed is not None:
            shuffle = ray.data.FileShuffleConfig(
                seed=self.shuffle_seed, reseed_after_execution=True
            )
        # Ray Data 2.60's V2 Parquet reader is not used: it maps files back to fragments by a
        # path key that a SubTreeFileSystem's relative paths do not match (KeyError on
        # "/part-00003.parquet"), and with fsspec but no aiohttp its concurrent path checks can
        # fail at random. The V1 reader streams the same files with none of that.
        ctx = ray.data.DataContext.get_current()
        use_v2 = ctx.use_datasource_v2
        ctx.use_datasource_v2 = False
        try:
            return ray.data.read_parquet(
                files,
                filesystem=fs,
                columns=list(self.spec.required_columns()),
                include_paths=True,
                shuffle=shuffle,
            )
        finally:
            ctx.use_datasource_v2 = use_v2


@dataclasses.dataclass(eq=False, kw_only=True)
class ParquetShard(BatchShard):
    """One rank's share of a :class:`ParquetSource`: a picklable wrapper of the rank's
    ``DataIterator`` from ``streaming_split``, built by :meth:`ParquetSource.split`.

    ``spec`` is the source's (the pipeline applied it); ``rows_per_epoch`` counts every
    row this shard receives per epoch, padding and bad rows included: the same for every shard.
    Not replayable: its batches have no ids (``read_mode="indexed"`` gives them ids).
    """

    iterator: Any  # ray.data.DataIterator
    index: int
    num_shards: int
    spec: FeatureSpec
    epochs: int
    on_bad_rows: OnBadRows
    prefetch_batches: int
    rows_per_epoch: int
    shuffle_seed: int | None = None
    shuffle_window_rows: int | None = None  # a local shuffle buffer of this many rows
    last_row_ids: np.ndarray | None = dataclasses.field(default=None, init=False)
    current_epoch: int = dataclasses.field(default=-1, init=False)
    _log: list[EpochLog] = dataclasses.field(default_factory=list, init=False, repr=False)

    def batches(self, batch_size: int, *, start_step: int = 0) -> Iterator[Batch]:
        """Yields ``epochs`` epochs of this shard's batches, then ends (``StopIteration``).

        Each rank receives ``ceil(rows_per_epoch / batch_size)`` Arrow batches per epoch (the
        last one short, never dropped); padding and bad rows are removed from them, so a batch can
        be smaller than ``batch_size``, and one left with no rows is not yielded. Call once per
        shard, and iterate all shards of a split concurrently (see the module doc).

        ``start_step > 0`` passes over that many batches without converting them (they are
        counted in :attr:`EpochConsumption.discarded_rows`). The stream is not replayable, so
        these are not necessarily the batches an earlier run trained on: an exact resume needs
        :meth:`consumed`.
        """
        # Validate eagerly (a generator body would only run on the first next()).
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step!r}")
        return self._stream(batch_size, start_step)

    def consumed(self) -> tuple[EpochConsumption, ...]:
        """Per epoch started so far, what this shard received; see :class:`EpochConsumption`."""
        return tuple(log.freeze() for log in self._log)

    def _stream(self, batch_size: int, start_step: int) -> Iterator[Batch]:
        discard = start_step
        for epoch in range(self.epochs):
            log = EpochLog(epoch, has_ids=self.spec.row_id is not None)
            self._log.append(log)
            self.current_epoch = epoch
            shuffle: dict[str, Any] = {}
            if self.shuffle_window_rows is not None:
                assert self.shuffle_seed is not None  # ParquetSource checks it
                seed = np.random.SeedSequence([self.shuffle_seed, epoch, self.index])
                shuffle = {
                    "local_shuffle_buffer_size": self.shuffle_window_rows,
                    "local_shuffle_seed": int(seed.generate_state(1)[0]),
                }
            tables = self.iterator.iter_batches(
                batch_size=batch_size,
                batch_format="pyarrow",
                prefetch_batches=self.prefetch_batches,
                drop_last=False,  # every row once per epoch: keep the short last batch
                **shuffle,
            )
            try:
                for table in tables:
                    if discard:
                        discard -= 1
                        log.discarded_rows += table.num_rows
                        continue
                    batch = self._convert(table, log)
                    if batch is not None:
                        yield batch
            except ray.exceptions.RayError as e:
                bad = _find_bad_input(e)
                if bad is None:
                    raise
                raise bad from e
            log.complete = True

    def _convert(self, table: pa.Table, log: EpochLog) -> Batch | None:
        layout = internal_columns_of(self.spec)
        table = take_marked(table, log, row_id=layout.row_id)
        if table.num_rows == 0:
            return None
        batch, row_ids = layout.decode(table)  # checked in the pipeline: nothing can be bad
        log.batches += 1
        log.rows += table.num_rows
        self.last_row_ids = row_ids
        if row_ids is not None:
            log.ids.add(row_ids)
        return batch


def _check_files(fs: pafs.FileSystem, files: list[str], spec: FeatureSpec) -> list[ParquetFileInfo]:
    check = functools.partial(_inspect_file, fs, spec=spec)
    with ThreadPoolExecutor(max_workers=min(_FOOTER_THREADS, len(files))) as pool:
        return list(pool.map(check, files))  # re-raises the first failure in file order


def _inspect_file(fs: pafs.FileSystem, path: str, *, spec: FeatureSpec) -> ParquetFileInfo:
    try:
        with fs.open_input_file(path) as f:
            parquet = pq.ParquetFile(f)
            metadata, schema = parquet.metadata, parquet.schema_arrow
    except (pa.ArrowException, OSError) as e:
        detail = f"not a readable Parquet file ({type(e).__name__}: {e})"
        raise BadInputError("corrupt_file", detail, file=path) from e
    if metadata.num_rows == 0:
        raise BadInputError("empty_file", "empty file: the footer lists no rows", file=path)
    _validate_schema(schema, spec, file=path)
    groups = tuple(metadata.row_group(i).num_rows for i in range(metadata.num_row_groups))
    return ParquetFileInfo(
        path=path, rows=metadata.num_rows, row_groups=len(groups), row_group_rows=groups
    )


def _is_data_file(path: str, root: str) -> bool:
    # Hive and Spark conventions: "_SUCCESS", "_meta.json", ".crc" files are not data.
    relative = path[len(root) :] if path.startswith(root) else os.path.basename(path)
    parts = relative.replace("\\", "/").strip("/").split("/")
    return path.endswith(_DATA_SUFFIX) and not any(p.startswith(("_", ".")) for p in parts)
