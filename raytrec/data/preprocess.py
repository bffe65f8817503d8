"""The CPU stage both Parquet read modes share, and what a rank does with its output.

On Ray Data's workers, :func:`preprocess` runs :func:`~raytrec.data.arrow_kjt.to_batch` with the
user's spec, so id policies (modulo, hash, bucketizing, strict range checks) and bad-value checks
(NaN or inf floats, negative or out-of-range ids, nulls inside lists) are the same code as
everywhere else, and writes the result back as Arrow in fixed columns (:class:`InternalColumns`:
``__rt_*`` columns, ids already in range). A rank then converts with a *strict* spec, whose check
is one ``max`` per feature: the cheap path. An error raised on a worker names the file (from the
``path`` column), the column and the row (:func:`locate`); the rank finds the original
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

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.exceptions

from raytrec.data.arrow_kjt import BadInputError, ConversionReport, OnBadRows, to_batch
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
    """The internal Arrow layout between the pipeline and the ranks (fixed column names, so no
    user column can collide), and the strict spec that converts it."""

    source: FeatureSpec
    rank_spec: FeatureSpec

    @staticmethod
    def of(spec: FeatureSpec) -> InternalColumns:
        """Prefer :func:`internal_columns_of`, which caches."""
        rank_spec = FeatureSpec(
            dense=tuple(f"__rt_dense_{j}" for j in range(spec.num_dense)),
            sparse=tuple(
                SparseFeature(
                    name=f.name,
                    column=f"__rt_sparse_{k}",
                    num_embeddings=f.num_embeddings,
                    id_policy="strict",  # ids are in range already: one max check per feature
                    weights=None if _weights_of(f) is None else f"__rt_weights_{k}",
                )
                for k, f in enumerate(spec.sparse)
            ),
            labels=tuple(f"__rt_label_{j}" for j in range(len(spec.labels))),
            row_id=None if spec.row_id is None else "__rt_row_id",
        )
        return InternalColumns(source=spec, rank_spec=rank_spec)

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
            weights = _weights_of(f)
            if weights is not None:
                w = kjt.weights().numpy()[offset_per_key[k] : offset_per_key[k + 1]]
                columns[weights] = pa.ListArray.from_arrays(
                    pa.array(offsets, pa.int32()), pa.array(w, pa.float32())
                )
        labels = batch.labels.numpy().reshape(rows, len(spec.labels)).T
        for j, name in enumerate(spec.labels):
            columns[name] = pa.array(np.ascontiguousarray(labels[j]), pa.float32())
        if spec.row_id is not None:
            columns[spec.row_id] = pa.array(report.row_ids, pa.int64())
        columns[DROP] = pa.nulls(rows, pa.string())
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
        no_weights = pa.ListArray.from_arrays(
            pa.array(np.zeros(n + 1, dtype=np.int32), pa.int32()), pa.array([], pa.float32())
        )
        columns.update((w, no_weights) for w in map(_weights_of, spec.sparse) if w is not None)
        columns.update(dict.fromkeys(spec.labels, zeros))
        if spec.row_id is not None:
            columns[spec.row_id] = row_ids if row_ids is not None else pa.nulls(n, pa.int64())
        columns[DROP] = drop
        return pa.table(columns)


def _weights_of(f: Feature) -> str | None:
    return f.weights if isinstance(f, SparseFeature) else None


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
        batch, report = to_batch(table, spec, on_bad_rows=on_bad_rows)
    except BadInputError as e:
        raise locate(e, table, spec) from None
    out = layout.to_arrow(batch, report)
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
