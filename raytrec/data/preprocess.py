"""The CPU stage both Parquet read modes share, and what a rank does with its output.

One conversion per row: on Ray Data's workers, :func:`preprocess` runs
:func:`~raytrec.data.arrow_kjt.convert` with the user's spec, so id policies (modulo, hash,
vocabularies, bucketizing, strict range checks) and bad-value checks (NaN or inf floats, negative
or out-of-range ids, nulls inside lists) are the same code as everywhere else, and writes its
arrays as Arrow in fixed internal columns (:class:`InternalColumns`: ``__rt_*`` columns, ids
already in range). A rank builds its batch's ``KeyedJaggedTensor`` from them
(:meth:`InternalColumns.decode`): one copy of each buffer, nothing checked again. An error raised
on a worker names the file (from the ``path`` column), the column and the row (:func:`locate`);
the rank finds the original
:class:`~raytrec.data.arrow_kjt.BadInputError` inside Ray's wrappers (:func:`find_bad_input`).

With ``on_bad_rows="skip"`` a bad row is not removed on the worker but comes out marked (a
"tombstone" in the :data:`DROP` column, keeping its ``row_id``), after the good rows of its block:
the rank that receives it drops and counts it (:func:`take_marked`), so skip counts and row ids
are known where training happens, and row counts stay what the footers say.

Each shard logs, per epoch, what it yielded (:class:`EpochLog`, frozen as
:class:`EpochConsumption`): row ids as merged ranges (:class:`RowIdRanges`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.exceptions

from raytrec.data.arrow_kjt import (
    Arrays,
    BadInputError,
    ConversionReport,
    OnBadRows,
    as_batch,
    convert,
)
from raytrec.data.source import Batch
from raytrec.data.spec import Feature, FeatureSpec, SparseFeature

__all__ = [
    "DROP",
    "FILE_ROW",
    "PADDING",
    "PATH",
    "ROW_GROUP",
    "EpochConsumption",
    "EpochLog",
    "InternalColumns",
    "RowIdRanges",
    "find_bad_input",
    "internal_columns_of",
    "locate",
    "preprocess",
    "preprocess_rows",
    "take_marked",
]

# The column of each row's file (read_parquet(include_paths=True) adds it); preprocessing drops it.
PATH = "path"
# Where a row sits in its file, when the reader knows (indexed reads): for error messages.
FILE_ROW = "__rt_file_row"
ROW_GROUP = "__rt_row_group"
# The marker column of the internal layout: null for a row to train on, else why it is dropped.
DROP = "__rt_drop"
PADDING = "padding"
# The internal layout's dense features and labels: one fixed-size list per row each.
DENSE = "__rt_dense"
LABELS = "__rt_labels"


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


class RowIdRanges:
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


class EpochLog:
    """One epoch's consumption while it is read (:meth:`freeze` gives the record)."""

    def __init__(self, epoch: int, *, has_ids: bool) -> None:
        self.epoch, self.has_ids = epoch, has_ids
        self.complete = False
        self.batches = self.rows = self.padding = self.discarded_rows = 0
        self.skipped: dict[str, int] = {}
        self.ids = RowIdRanges()
        self.skipped_ids = RowIdRanges()

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
class InternalColumns:
    """The internal Arrow layout between the pipeline and the ranks: fixed ``__rt_*`` column
    names (no user column can collide), values already checked and in range.

    Dense features and labels are one ``fixed_size_list<float32>`` column each (a row's
    ``dense_features`` and labels), feature ``k``'s ids a ``list<int64>`` column and its weights,
    when it has some, a ``list<float32>`` column; the row id an int64 column; :data:`DROP` the
    marker. A pipeline worker writes it from :func:`~raytrec.data.arrow_kjt.convert`'s arrays
    (:meth:`encode`), a rank reads it into a batch (:meth:`decode`), with no check left to do."""

    source: FeatureSpec
    sparse: tuple[str, ...]
    weights: tuple[str | None, ...]
    row_id: str | None

    @staticmethod
    def of(spec: FeatureSpec) -> InternalColumns:
        """Prefer :func:`internal_columns_of`, which caches."""
        return InternalColumns(
            source=spec,
            sparse=tuple(f"__rt_sparse_{k}" for k in range(len(spec.sparse))),
            weights=tuple(
                None if _weights_of(f) is None else f"__rt_weights_{k}"
                for k, f in enumerate(spec.sparse)
            ),
            row_id=None if spec.row_id is None else "__rt_row_id",
        )

    def encode(self, arrays: Arrays, report: ConversionReport) -> pa.Table:
        """A converted batch in this layout, no row marked (the arrays' memory, not a copy)."""
        rows = arrays.num_rows
        columns: dict[str, pa.Array] = {}
        if self.source.num_dense:
            columns[DENSE] = _rows_of(arrays.dense.reshape(-1), self.source.num_dense)
        columns[LABELS] = _rows_of(arrays.labels.reshape(-1), len(self.source.labels))
        ends = arrays.offset_per_key
        for k, (ids, weights) in enumerate(zip(self.sparse, self.weights, strict=True)):
            offsets = np.zeros(rows + 1, dtype=np.int32)
            np.cumsum(arrays.lengths[k * rows : (k + 1) * rows], out=offsets[1:])
            list_offsets = pa.array(offsets, pa.int32())
            child = pa.array(arrays.values[ends[k] : ends[k + 1]], pa.int64())
            columns[ids] = pa.ListArray.from_arrays(list_offsets, child)
            if weights is not None:
                assert arrays.weights is not None  # a weighted spec's arrays have weights
                w = pa.array(arrays.weights[ends[k] : ends[k + 1]], pa.float32())
                columns[weights] = pa.ListArray.from_arrays(list_offsets, w)
        if self.row_id is not None:
            columns[self.row_id] = pa.array(report.row_ids, pa.int64())
        columns[DROP] = pa.nulls(rows, pa.string())
        return pa.table(columns)

    def decode(self, table: pa.Table) -> tuple[Batch, np.ndarray | None]:
        """The batch of ``table`` (this layout, marked rows already taken out by
        :func:`take_marked`; any chunking) and its row ids. Each buffer is copied once, into
        the batch's own tensors."""
        spec, rows = self.source, table.num_rows
        dense = np.empty((rows, spec.num_dense), dtype=np.float32)
        if spec.num_dense:
            _flat_into(table.column(DENSE), dense.reshape(-1))
        labels = np.empty((rows, len(spec.labels)), dtype=np.float32)
        _flat_into(table.column(LABELS), labels.reshape(-1))
        lengths = np.empty(len(self.sparse) * rows, dtype=np.int32)
        ids: list[list[np.ndarray]] = []
        for k, name in enumerate(self.sparse):
            ids.append(_lists(table.column(name), lengths[k * rows : (k + 1) * rows], np.int64))
        offset_per_key = [0, *itertools.accumulate(sum(map(len, f)) for f in ids)]
        values = np.empty(offset_per_key[-1], dtype=np.int64)
        for k, parts in enumerate(ids):
            _concat_into(parts, values[offset_per_key[k] : offset_per_key[k + 1]])
        weights = None
        if spec.is_weighted:  # weight 1 for the features without a weights column
            weights = np.ones(offset_per_key[-1], dtype=np.float32)
            scratch = np.empty(rows, dtype=np.int32)  # the ids' lengths again: not needed
            for k, column in enumerate(self.weights):
                if column is not None:
                    out = weights[offset_per_key[k] : offset_per_key[k + 1]]
                    _concat_into(_lists(table.column(column), scratch, np.float32), out)
        row_ids = None
        if self.row_id is not None:
            row_ids = np.asarray(table.column(self.row_id).to_numpy(), dtype=np.int64)
        arrays = Arrays(
            keys=spec.sparse_names,
            dense=dense,
            labels=labels.reshape(rows) if len(spec.labels) == 1 else labels,
            values=values,
            lengths=lengths,
            offset_per_key=offset_per_key,
            weights=weights,
        )
        return as_batch(arrays), row_ids

    def neutral_rows(self, n: int, row_ids: pa.Array | None, drop: pa.Array) -> pa.Table:
        """``n`` rows marked ``drop``: zeros and empty lists (valid, never trained on)."""
        spec = self.source
        columns: dict[str, pa.Array] = {}
        if spec.num_dense:
            columns[DENSE] = _rows_of(np.zeros(n * spec.num_dense, np.float32), spec.num_dense)
        columns[LABELS] = _rows_of(np.zeros(n * len(spec.labels), np.float32), len(spec.labels))
        no_lists = pa.array(np.zeros(n + 1, dtype=np.int32), pa.int32())
        empty = pa.ListArray.from_arrays(no_lists, pa.array([], pa.int64()))
        no_weights = pa.ListArray.from_arrays(no_lists, pa.array([], pa.float32()))
        for ids, weights in zip(self.sparse, self.weights, strict=True):  # encode's order
            columns[ids] = empty
            if weights is not None:
                columns[weights] = no_weights
        if self.row_id is not None:
            columns[self.row_id] = row_ids if row_ids is not None else pa.nulls(n, pa.int64())
        columns[DROP] = drop
        return pa.table(columns)


def _weights_of(f: Feature) -> str | None:
    return f.weights if isinstance(f, SparseFeature) else None


def _rows_of(flat: np.ndarray, width: int) -> pa.FixedSizeListArray:
    """``flat`` (row-major ``[n, width]`` float32) as ``n`` lists of ``width`` values."""
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), width)


def _flat_into(column: pa.ChunkedArray, out: np.ndarray) -> None:
    """A fixed-size-list column's values, row after row, copied into ``out``."""
    _concat_into([np.asarray(c.flatten().to_numpy()) for c in column.chunks], out)


def _lists(column: pa.ChunkedArray, lengths: np.ndarray, dtype: type) -> list[np.ndarray]:
    """Writes a list column's lengths into ``lengths`` and returns its items, chunk by chunk, as
    views of the Arrow buffers (the layout has no nulls). Read from the buffers: a rank does this
    for every feature of every batch, and pyarrow's accessors cost more than the copy."""
    parts: list[np.ndarray] = []
    at = 0
    for chunk in column.chunks:
        n = len(chunk)
        if not n:
            continue
        if not isinstance(chunk, pa.ListArray):  # 32-bit offsets, as encode writes them
            raise TypeError(f"expected list<...> with int32 offsets, got {chunk.type}")
        # The chunk's offsets, from its slice's first row on (not rebased to 0).
        offsets = np.frombuffer(chunk.buffers()[1], np.int32, n + 1, chunk.offset * 4)
        np.subtract(offsets[1:], offsets[:-1], out=lengths[at : at + n])
        at += n
        start, stop = int(offsets[0]), int(offsets[-1])
        items = chunk.values  # the whole child (its own offset kept), not the chunk's slice of it
        size = np.dtype(dtype).itemsize
        parts.append(
            np.frombuffer(items.buffers()[1], dtype, stop - start, (items.offset + start) * size)
        )
    return parts


def _concat_into(parts: list[np.ndarray], out: np.ndarray) -> None:
    if len(parts) == 1:
        np.copyto(out, parts[0])
    elif parts:
        np.concatenate(parts, out=out)


@functools.lru_cache(maxsize=16)
def internal_columns_of(spec: FeatureSpec) -> InternalColumns:
    return InternalColumns.of(spec)


def preprocess(table: pa.Table, *, spec: FeatureSpec, on_bad_rows: OnBadRows) -> pa.Table:
    """The pipeline's CPU stage: checks and id policies of the user's spec, the internal layout
    out. In skip mode, bad rows come out as marked rows after the good ones (module doc)."""
    return preprocess_rows(table, spec=spec, on_bad_rows=on_bad_rows)[0]


def preprocess_rows(
    table: pa.Table, *, spec: FeatureSpec, on_bad_rows: OnBadRows
) -> tuple[pa.Table, np.ndarray | None]:
    """:func:`preprocess`, and which input row each output row came from (None: the same row,
    as when no row was bad)."""
    layout = internal_columns_of(spec)
    try:
        arrays, report = convert(table, spec, on_bad_rows=on_bad_rows)
    except BadInputError as e:
        raise locate(e, table, spec) from None
    out = layout.encode(arrays, report)
    if not report.skipped_rows:
        return out, None
    index = np.concatenate(list(report.skipped_rows.values()))
    reasons = np.repeat(list(report.skipped_rows), [len(v) for v in report.skipped_rows.values()])
    row_ids = None
    if spec.row_id is not None:
        row_ids = table.column(spec.row_id).take(pa.array(index)).cast(pa.int64(), safe=False)
    tombstones = layout.neutral_rows(len(index), row_ids, pa.array(reasons.tolist(), pa.string()))
    kept = np.ones(table.num_rows, dtype=bool)
    kept[index] = False
    return pa.concat_tables([out, tombstones]), np.concatenate([np.flatnonzero(kept), index])


def locate(e: BadInputError, table: pa.Table, spec: FeatureSpec) -> BadInputError:
    """``e`` with the row's file (from the ``path`` column), ``row_id`` and, where the reader
    recorded them, its row group and its index in the file filled in."""
    row, file, row_id, row_group = e.row, e.file, None, e.row_group
    if table.num_rows and PATH in table.column_names:
        at = row if row is not None and 0 <= row < table.num_rows else 0
        file = table.column(PATH)[at].as_py()
        if row is not None and spec.row_id is not None:
            value = table.column(spec.row_id)[at].as_py()
            row_id = None if value is None else int(value)
        if row is not None and FILE_ROW in table.column_names:
            row = int(table.column(FILE_ROW)[at].as_py())
            row_group = int(table.column(ROW_GROUP)[at].as_py())
    return BadInputError(
        e.reason,
        e.detail,
        file=file,
        column=e.column,
        row=row,
        row_group=row_group,
        row_id=row_id,
    )


def take_marked(table: pa.Table, log: EpochLog, *, row_id: str | None) -> pa.Table:
    """The rows of ``table`` (internal layout) to train on; marked rows are counted in ``log``
    (padding apart, bad rows by reason with their row ids when ``row_id`` names the column)."""
    drop = table.column(DROP)
    if drop.null_count == table.num_rows:
        return table
    marked = table.filter(drop.is_valid())
    for item in pc.value_counts(marked.column(DROP)).to_pylist():
        reason, count = item["values"], item["counts"]
        if reason == PADDING:
            log.padding += count
        else:
            log.skipped[reason] = log.skipped.get(reason, 0) + count
    if row_id is not None:
        ids = marked.filter(pc.not_equal(marked.column(DROP), PADDING))
        log.skipped_ids.add(ids.column(row_id).drop_null().to_numpy())
    return table.filter(drop.is_null())


def find_bad_input(e: BaseException) -> BadInputError | None:
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
