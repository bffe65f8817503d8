"""Parquet files as a :class:`~raytrec.data.source.BatchSource`: a Ray Data pipeline, streamed to
the ranks with ``streaming_split``, in which every row reaches exactly one rank once per epoch.

The work is split by cost. On the driver, :meth:`ParquetSource.split` lists the files and reads
every footer (in threads: one small read per file), so a corrupt file, an empty file or a missing
or wrongly typed column fails the job before anything starts, naming the file and column. Then it
builds one pipeline for the whole job::

    read_parquet(files, include_paths=True)   # + a seeded file shuffle, reseeded every epoch
      -> map_batches(_preprocess)             # CPU workers: all checks, all id policies
      -> union(padding rows)                  # see "Exactly once" below
      -> streaming_split(n, equal=True)       # one DataIterator per rank

``_preprocess`` runs :func:`~raytrec.data.arrow_kjt.to_batch` with the user's spec, so id policies
(modulo, hash, bucketizing, strict range checks) and bad-value checks (NaN or inf floats, negative
or out-of-range ids, nulls inside lists) are the same code as everywhere else, and writes the
result back as Arrow in a fixed internal layout (``__rt_*`` columns, ids already in range). A rank
then converts with a *strict* spec, whose check is one ``max`` per feature: the cheap path. An
error raised there names the file (from the ``path`` column that ``include_paths`` adds), the
column and the row (by its ``row_id`` when the spec has one, else by its index in the block); the
rank re-raises it as the original :class:`~raytrec.data.arrow_kjt.BadInputError`, not Ray's
wrapper.

Exactly once. ``streaming_split(n, equal=True)`` gives every rank the same number of rows, which
keeps ranks in step (same number of batches per epoch), but it drops the last ``N mod n`` rows of
the stream to get there. ``equal=False`` drops nothing, but then shares differ by up to a block,
and ranks that train in lockstep would run out at different steps. This module keeps ``equal=True``
and makes ``N`` a multiple of ``n``: the driver knows ``N`` from the footers and appends
``(-N) mod n`` padding rows, marked in an ``__rt_drop`` column, which the ranks remove. For ``N`` to
stay known, rows skipped under ``on_bad_rows="skip"`` are not removed in the pipeline either: they
become marked rows too ("tombstones", keeping their ``row_id``), and the rank that receives one
drops and counts it. So per epoch every rank receives exactly ``(N + padding) / n`` rows, every
input row reaches exactly one rank, and skip counts and row ids are known where training happens.

Epochs and shuffling: each pass of a rank's ``DataIterator`` is one epoch, and all ``n`` shards
must be consumed concurrently (a ``SplitCoordinator`` actor drives one execution per epoch for all
of them). With ``shuffle_seed`` set, the read shuffles the file order with
``FileShuffleConfig(seed, reseed_after_execution=True)``: a different, reproducible order per
epoch, which streams (``randomize_block_order`` would be an all-to-all barrier that materializes
the whole dataset before the first batch). Rows within a file keep their order.

Consumption accounting: a :class:`ParquetShard` logs, per epoch, the row ids it yielded and the
ones it dropped as bad, as merged ranges (a file's row ids are usually contiguous, so this is
small), and keeps the ids of the batch it yielded last in :attr:`ParquetShard.last_row_ids`; see
:meth:`ParquetShard.consumed`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray
import ray.data
import ray.exceptions

from raytrec.data.arrow_kjt import BadInputError, ConversionReport, OnBadRows, to_batch
from raytrec.data.arrow_kjt import validate_schema as _validate_schema
from raytrec.data.source import Batch, BatchShard, BatchSource
from raytrec.data.spec import FeatureSpec, SparseFeature

__all__ = ["EpochConsumption", "ParquetFileInfo", "ParquetShard", "ParquetSource"]

# The column read_parquet(include_paths=True) adds; the preprocessing drops it.
_PATH = "path"
# The marker column of the internal layout: null for a row to train on, else why it is dropped.
_DROP = "__rt_drop"
_PADDING = "padding"
_DATA_SUFFIX = ".parquet"
_FOOTER_THREADS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParquetFileInfo:
    """One input file as its footer describes it."""

    path: str
    rows: int
    row_groups: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpochConsumption:
    """What one shard consumed in one epoch.

    ``row_ids`` are the row ids yielded in batches and ``skipped_row_ids`` those dropped as bad
    (``on_bad_rows="skip"``), both as sorted, merged half-open ranges ``(start, stop)`` (so a row
    yielded twice shows only as ``rows`` exceeding the ranges' total length), or None
    when the spec has no row-id column (a bad row whose row id is itself null is counted in
    ``skipped`` but has no id to log). ``skipped`` counts dropped rows per reason, ``padding`` the
    padding rows received, ``discarded_rows`` the rows passed over for ``start_step``.
    ``complete`` is False while the epoch is still being read (or was abandoned).
    """

    epoch: int
    complete: bool
    batches: int
    rows: int
    skipped: dict[str, int]
    padding: int
    discarded_rows: int
    row_ids: tuple[tuple[int, int], ...] | None
    skipped_row_ids: tuple[tuple[int, int], ...] | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParquetSource(BatchSource):
    """Parquet files read with Ray Data and split among ranks; see the module doc.

    ``paths``: one path or several, each a file or a directory (searched recursively for
    ``*.parquet``, skipping names that start with ``_`` or ``.``, such as ``_meta.json``), local
    paths or URIs pyarrow understands (``s3://bucket/prefix``), all on one filesystem; or paths
    within ``filesystem`` when that is given. ``epochs``: passes over the data; a shard's batch
    iterator ends after the last. ``shuffle_seed``: None reads files in sorted order, else in a
    seeded order that changes every epoch. ``on_bad_rows``: ``"error"`` stops at the first bad
    value; ``"skip"`` drops rows holding one and counts them. File-level problems (corrupt,
    empty, wrong schema) are errors in both modes. ``prefetch_batches``: batches each rank keeps
    in flight.
    """

    paths: str | Sequence[str]
    spec: FeatureSpec
    filesystem: pafs.FileSystem | None = None
    epochs: int = 1
    shuffle_seed: int | None = None
    on_bad_rows: OnBadRows = "error"
    prefetch_batches: int = 2

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
        if _PATH in self.spec.expected_types():
            raise ValueError(
                f"ParquetSource cannot read a column named {_PATH!r}: the reader adds one "
                "(the file of each row) for error messages"
            )
        if self.shuffle_seed is not None and self.shuffle_seed < 0:
            raise ValueError(
                f"ParquetSource.shuffle_seed must be None or >= 0, got {self.shuffle_seed!r}"
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

    def inspect(self) -> list[ParquetFileInfo]:
        """Reads every file's footer and checks it: a readable Parquet file, with rows, and every
        column the spec needs, of the right type. Raises :class:`BadInputError` naming the first
        bad file (in listing order) and, for schema problems, the column."""
        return _check_files(*self.list_files(), self.spec)

    def split(self, num_shards: int) -> list[BatchShard]:
        """Checks the files, builds the pipeline and returns one :class:`ParquetShard` per rank.

        Call once per job, on the driver, with a Ray connection (``raytrec.cluster.connect``).
        """
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards!r}")
        fs, files = self.list_files()
        total = sum(i.rows for i in _check_files(fs, files, self.spec))
        padding = -total % num_shards
        layout = _layout(self.spec)
        spec, on_bad_rows = self.spec, self.on_bad_rows

        def preprocess(table: pa.Table) -> pa.Table:
            # A nested function, so cloudpickle sends it by value, and the import runs only where
            # it is called: the SplitCoordinator unpickles the pipeline too, and importing this
            # module there (torch, torchrec) would add seconds to every split.
            from raytrec.data.parquet import _preprocess

            return _preprocess(table, spec=spec, on_bad_rows=on_bad_rows)

        ds = self._read(fs, files).map_batches(
            preprocess,
            batch_format="pyarrow",
            batch_size=None,  # whole blocks: the conversion is vectorized, bigger is cheaper
            zero_copy_batch=True,
        )
        if padding:
            drop = pa.array([_PADDING] * padding, pa.string())
            ds = ds.union(ray.data.from_arrow(layout.neutral_rows(padding, None, drop)))
        # Let a BadInputError leave the map task as itself: the default wrapper
        # (UserCodeException) keeps only its text once it has crossed the SplitCoordinator.
        ds.context.raise_original_map_exception = True
        # The job prints its own progress; Ray Data's per-operator bars would
        # interleave with it on the driver's console.
        ds.context.enable_progress_bars = False
        ds.context.enable_operator_progress_bars = False
        iterators = ds.streaming_split(num_shards, equal=True)
        return [
            ParquetShard(
                iterator=it,
                index=rank,
                num_shards=num_shards,
                spec=layout.rank_spec,
                epochs=self.epochs,
                on_bad_rows=self.on_bad_rows,
                prefetch_batches=self.prefetch_batches,
                rows_per_epoch=(total + padding) // num_shards,
            )
            for rank, it in enumerate(iterators)
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

    ``spec`` is the internal layout's (strict, already in range); ``rows_per_epoch`` counts every
    row this shard receives per epoch, padding and bad rows included: the same for every shard.
    """

    iterator: Any  # ray.data.DataIterator
    index: int
    num_shards: int
    spec: FeatureSpec
    epochs: int
    on_bad_rows: OnBadRows
    prefetch_batches: int
    rows_per_epoch: int
    last_row_ids: np.ndarray | None = dataclasses.field(default=None, init=False)
    current_epoch: int = dataclasses.field(default=-1, init=False)
    _log: list[_EpochLog] = dataclasses.field(default_factory=list, init=False, repr=False)

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
            log = _EpochLog(epoch, has_ids=self.spec.row_id is not None)
            self._log.append(log)
            self.current_epoch = epoch
            tables = self.iterator.iter_batches(
                batch_size=batch_size,
                batch_format="pyarrow",
                prefetch_batches=self.prefetch_batches,
                drop_last=False,  # every row once per epoch: keep the short last batch
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

    def _convert(self, table: pa.Table, log: _EpochLog) -> Batch | None:
        drop = table.column(_DROP)
        if drop.null_count < table.num_rows:
            marked = table.filter(drop.is_valid())
            counts = pc.value_counts(marked.column(_DROP)).to_pylist()
            for item in counts:
                reason, count = item["values"], item["counts"]
                if reason == _PADDING:
                    log.padding += count
                else:
                    log.skipped[reason] = log.skipped.get(reason, 0) + count
            if self.spec.row_id is not None:
                ids = marked.filter(pc.not_equal(marked.column(_DROP), _PADDING))
                log.skipped_ids.add(ids.column(self.spec.row_id).drop_null().to_numpy())
            table = table.filter(drop.is_null())
        if table.num_rows == 0:
            return None
        batch, report = to_batch(table, self.spec, on_bad_rows=self.on_bad_rows)
        for reason, count in report.skipped.items():  # never, as the pipeline checked: but count
            log.skipped[reason] = log.skipped.get(reason, 0) + count
        log.batches += 1
        log.rows += report.rows_out
        self.last_row_ids = report.row_ids
        if report.row_ids is not None:
            log.ids.add(report.row_ids)
        return batch


class _Ranges:
    """Row ids as runs of consecutive values: O(runs) memory, not O(rows). A file's row ids are
    usually contiguous, so an epoch costs a few runs per batch, merged every ``_COMPACT`` adds."""

    _COMPACT = 256

    def __init__(self) -> None:
        self.starts: list[np.ndarray] = []
        self.stops: list[np.ndarray] = []

    def add(self, ids: np.ndarray) -> None:
        if len(ids) == 0:
            return
        ids = np.asarray(ids, dtype=np.int64)
        breaks = np.flatnonzero(np.diff(ids) != 1)
        self.starts.append(ids[np.r_[0, breaks + 1]])
        self.stops.append(ids[np.r_[breaks, len(ids) - 1]] + 1)
        if len(self.starts) >= self._COMPACT:
            starts, stops = self._merge()
            self.starts, self.stops = [starts], [stops]

    def merged(self) -> tuple[tuple[int, int], ...]:
        """Sorted half-open ranges; overlapping or touching runs merged."""
        starts, stops = self._merge()
        return tuple(zip(starts.tolist(), stops.tolist(), strict=True))

    def _merge(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.starts:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        starts, stops = np.concatenate(self.starts), np.concatenate(self.stops)
        order = np.argsort(starts, kind="stable")
        starts, stops = starts[order], stops[order]
        reach = np.maximum.accumulate(stops)
        # A run opens a new range unless it starts at or before the reach of those before it.
        first = np.flatnonzero(np.r_[True, starts[1:] > reach[:-1]])
        return starts[first], reach[np.r_[first[1:] - 1, len(starts) - 1]]


class _EpochLog:
    def __init__(self, epoch: int, *, has_ids: bool) -> None:
        self.epoch, self.has_ids = epoch, has_ids
        self.complete = False
        self.batches = self.rows = self.padding = self.discarded_rows = 0
        self.skipped: dict[str, int] = {}
        self.ids = _Ranges()
        self.skipped_ids = _Ranges()

    def freeze(self) -> EpochConsumption:
        return EpochConsumption(
            epoch=self.epoch,
            complete=self.complete,
            batches=self.batches,
            rows=self.rows,
            skipped=dict(self.skipped),
            padding=self.padding,
            discarded_rows=self.discarded_rows,
            row_ids=self.ids.merged() if self.has_ids else None,
            skipped_row_ids=self.skipped_ids.merged() if self.has_ids else None,
        )


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The internal Arrow layout between the pipeline and the ranks (fixed column names, so no
    user column can collide), and the strict spec that converts it."""

    source: FeatureSpec
    rank_spec: FeatureSpec

    @staticmethod
    def of(spec: FeatureSpec) -> _Layout:
        """Prefer :func:`_layout`, which caches."""
        rank_spec = FeatureSpec(
            dense=tuple(f"__rt_dense_{j}" for j in range(spec.num_dense)),
            sparse=tuple(
                SparseFeature(
                    name=f.name,
                    column=f"__rt_sparse_{k}",
                    num_embeddings=f.num_embeddings,
                    id_policy="strict",  # ids are in range already: one max check per feature
                )
                for k, f in enumerate(spec.sparse)
            ),
            labels=tuple(f"__rt_label_{j}" for j in range(len(spec.labels))),
            row_id=None if spec.row_id is None else "__rt_row_id",
        )
        return _Layout(source=spec, rank_spec=rank_spec)

    def to_arrow(self, batch: Batch, report: ConversionReport) -> pa.Table:
        """A converted batch in the internal layout, no row marked."""
        spec = self.rank_spec
        rows = batch.dense_features.shape[0]
        # Transposed once, so each column is one contiguous row: pa.array without a copy.
        dense = np.ascontiguousarray(batch.dense_features.numpy().T)
        columns: dict[str, pa.Array] = {
            name: pa.array(dense[j], pa.float32()) for j, name in enumerate(spec.dense)
        }
        kjt = batch.sparse_features
        values, lengths = kjt.values().numpy(), kjt.lengths().numpy()
        offset_per_key = kjt.offset_per_key()
        for k, f in enumerate(spec.sparse):
            offsets = np.zeros(rows + 1, dtype=np.int32)
            np.cumsum(lengths[k * rows : (k + 1) * rows], out=offsets[1:])
            child = values[offset_per_key[k] : offset_per_key[k + 1]]
            columns[f.source_column] = pa.ListArray.from_arrays(
                pa.array(offsets, pa.int32()), pa.array(child, pa.int64())
            )
        labels = batch.labels.numpy().reshape(rows, len(spec.labels)).T
        for j, name in enumerate(spec.labels):
            columns[name] = pa.array(np.ascontiguousarray(labels[j]), pa.float32())
        if spec.row_id is not None:
            columns[spec.row_id] = pa.array(report.row_ids, pa.int64())
        columns[_DROP] = pa.nulls(rows, pa.string())
        return pa.table(columns)

    def neutral_rows(self, n: int, row_ids: pa.Array | None, drop: pa.Array) -> pa.Table:
        """``n`` rows marked ``drop``: zeros and empty lists (valid, never trained on)."""
        spec = self.rank_spec
        zeros = pa.array(np.zeros(n, dtype=np.float32), pa.float32())
        empty = pa.ListArray.from_arrays(
            pa.array(np.zeros(n + 1, dtype=np.int32), pa.int32()), pa.array([], pa.int64())
        )
        columns: dict[str, pa.Array] = dict.fromkeys(spec.dense, zeros)
        columns.update((f.source_column, empty) for f in spec.sparse)
        columns.update(dict.fromkeys(spec.labels, zeros))
        if spec.row_id is not None:
            columns[spec.row_id] = row_ids if row_ids is not None else pa.nulls(n, pa.int64())
        columns[_DROP] = drop
        return pa.table(columns)


@functools.lru_cache(maxsize=16)
def _layout(spec: FeatureSpec) -> _Layout:
    return _Layout.of(spec)


def _preprocess(table: pa.Table, *, spec: FeatureSpec, on_bad_rows: OnBadRows) -> pa.Table:
    """The pipeline's CPU stage: checks and id policies of the user's spec, the internal layout
    out. In skip mode, bad rows come out as marked rows (see the module doc)."""
    layout = _layout(spec)
    try:
        batch, report = to_batch(table, spec, on_bad_rows=on_bad_rows)
    except BadInputError as e:
        raise _locate(e, table, spec) from None
    out = layout.to_arrow(batch, report)
    if not report.skipped_rows:
        return out
    index = np.concatenate(list(report.skipped_rows.values()))
    reasons = np.repeat(list(report.skipped_rows), [len(v) for v in report.skipped_rows.values()])
    row_ids = None
    if spec.row_id is not None:
        row_ids = table.column(spec.row_id).take(pa.array(index)).cast(pa.int64(), safe=False)
    tombstones = layout.neutral_rows(len(index), row_ids, pa.array(reasons.tolist(), pa.string()))
    return pa.concat_tables([out, tombstones])


def _locate(e: BadInputError, table: pa.Table, spec: FeatureSpec) -> BadInputError:
    """``e`` with the row's file (from the ``path`` column) and ``row_id`` filled in."""
    row, file, row_id = e.row, e.file, None
    if table.num_rows and _PATH in table.column_names:
        at = row if row is not None and 0 <= row < table.num_rows else 0
        file = table.column(_PATH)[at].as_py()
        if row is not None and spec.row_id is not None:
            value = table.column(spec.row_id)[at].as_py()
            row_id = None if value is None else int(value)
    return BadInputError(
        e.reason,
        e.detail,
        file=file,
        column=e.column,
        row=row,
        row_group=e.row_group,
        row_id=row_id,
    )


def _find_bad_input(e: BaseException) -> BadInputError | None:
    """The BadInputError inside Ray's wrappers (a map task's, then the SplitCoordinator's)."""
    seen: set[int] = set()
    current: BaseException | None = e
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        # Ray's wrapper subclasses the cause's class but lacks its fields: take the cause itself.
        if isinstance(current, BadInputError) and not isinstance(current, ray.exceptions.RayError):
            return current
        cause = getattr(current, "cause", None)
        current = cause if isinstance(cause, BaseException) else current.__cause__
    return None


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
    return ParquetFileInfo(path=path, rows=metadata.num_rows, row_groups=metadata.num_row_groups)


def _is_data_file(path: str, root: str) -> bool:
    # Hive and Spark conventions: "_SUCCESS", "_meta.json", ".crc" files are not data.
    relative = path[len(root) :] if path.startswith(root) else os.path.basename(path)
    parts = relative.replace("\\", "/").strip("/").split("/")
    return path.endswith(_DATA_SUFFIX) and not any(p.startswith(("_", ".")) for p in parts)
