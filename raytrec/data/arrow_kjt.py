"""Arrow record batches to torchrec ``Batch`` values, vectorized, with errors that say where.

List columns are never walked row by row: a feature's lengths are ``diff(offsets)`` of the list
array and its ids are the slice ``[offsets[0], offsets[-1])`` of the child array, copied once into
one preallocated key-major ``values`` buffer. Id policies run in place on that buffer while it is
still in cache; the common case (all ids already in range) costs one ``max`` over it.

Bad data (a NaN feature, a negative id, a null inside a list, a weights list whose length is not
its ids list's, a non-finite weight, ...) raises :class:`BadInputError`
naming file, column and row, or with ``on_bad_rows="skip"`` drops the row and counts the reason.

:func:`convert` does all of that into NumPy :class:`Arrays`; :func:`as_batch` wraps them as
tensors, the ``KeyedJaggedTensor`` among them. A Parquet pipeline's workers stop after the first
and write Arrow; its ranks build the tensors (:mod:`raytrec.data.preprocess`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
from typing import Literal, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from raytrec.data.source import Batch
from raytrec.data.spec import (
    BucketizedFeature,
    CategoricalFeature,
    ColumnKind,
    FeatureSpec,
    SparseFeature,
)

__all__ = [
    "Arrays",
    "BadInputError",
    "ConversionReport",
    "as_batch",
    "convert",
    "to_batch",
    "validate_schema",
]

OnBadRows: TypeAlias = Literal["error", "skip"]
_U64 = np.uint64
_ALLOWED: dict[ColumnKind, str] = {
    "numeric": "an integer, floating point or boolean type",
    "integer": "an integer type",
    "ids": "list<int>, large_list<int> or an integer type",
    "categories": "a string or integer type, or a list of either",
    "weights": "list<float>, large_list<float> or a numeric type",
}


class BadInputError(ValueError):
    """Input data that cannot be converted. ``row`` is the index within the batch and
    ``absolute_row`` adds the caller's ``row_offset``; ``reason`` is a short key such as
    ``"negative_id"`` (the keys of :attr:`ConversionReport.skipped`). ``row_id``, when known, is
    the row's value in the spec's row-id column, and the message names the row by it.

    Picklable with all its fields, so it survives the hop out of a Ray task or actor."""

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        file: str | None = None,
        column: str | None = None,
        row: int | None = None,
        row_offset: int = 0,
        row_group: int | None = None,
        row_id: int | None = None,
    ) -> None:
        self.reason, self.file, self.column, self.row = reason, file, column, row
        self.row_group = row_group
        self.absolute_row = None if row is None else row + row_offset
        self.detail, self.row_offset, self.row_id = detail, row_offset, row_id
        where = [f"file {file!r}" if file is not None else "unknown file"]
        where += [f"column {column!r}"] if column is not None else []
        where += [f"row group {row_group}"] if row_group is not None else []
        if row_id is not None:  # the row's own id says more than its place in some batch
            where.append(f"row_id {row_id}")
        elif row is not None:
            where.append(
                f"row {row}" + (f" (absolute row {self.absolute_row})" if row_offset else "")
            )
        super().__init__(f"bad input ({reason}) in {', '.join(where)}: {detail}")

    def __reduce__(self) -> tuple[functools.partial[BadInputError], tuple[str, str]]:
        # The default pickles only the message, and __init__ needs the fields back.
        rebuild = functools.partial(
            type(self),
            file=self.file,
            column=self.column,
            row=self.row,
            row_offset=self.row_offset,
            row_group=self.row_group,
            row_id=self.row_id,
        )
        return rebuild, (self.reason, self.detail)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConversionReport:
    """What :func:`to_batch` did: rows in and out, skipped rows per reason (each skipped row
    counted once, under the first reason found), and the row ids of the rows kept.
    ``skipped_rows`` holds, per reason, the input row indices counted in ``skipped``."""

    rows_in: int
    rows_out: int
    skipped: dict[str, int]
    row_ids: np.ndarray | None
    skipped_rows: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def _is_category(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t))


def _type_ok(kind: ColumnKind, t: pa.DataType) -> bool:
    if kind == "categories":
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            return _is_category(t.value_type)
        return _is_category(t)
    if pa.types.is_integer(t):
        return True
    if kind == "numeric":
        return pa.types.is_floating(t) or pa.types.is_boolean(t)
    if kind == "ids" and (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return bool(pa.types.is_integer(t.value_type))
    if kind == "weights":
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            t = t.value_type
        return bool(pa.types.is_floating(t) or pa.types.is_integer(t))
    return False


def validate_schema(schema: pa.Schema, spec: FeatureSpec, *, file: str | None = None) -> None:
    """Raises :class:`BadInputError` for the first column of ``spec`` that ``schema`` lacks, holds
    twice, or types wrongly (naming the expected and the actual type)."""
    for column, kind in spec.expected_types().items():
        found = schema.get_all_field_indices(column)
        if not found:
            names = ", ".join(schema.names[:20]) + (", ..." if len(schema.names) > 20 else "")
            raise BadInputError(
                "missing_column", f"no such column (has: {names})", file=file, column=column
            )
        if len(found) > 1:
            raise BadInputError(
                "duplicate_column", "column appears twice", file=file, column=column
            )
        actual = schema.field(found[0]).type
        if not _type_ok(kind, actual):
            detail = f"expected {_ALLOWED[kind]}, got {actual}"
            raise BadInputError("wrong_type", detail, file=file, column=column)


# Schemas already validated, per spec: a stream repeats one schema, and checking ~40 columns
# costs more than converting some of them. Holding the spec keeps its id from being reused.
_VALIDATED: dict[int, tuple[FeatureSpec, pa.Schema]] = {}


def _check_schema(schema: pa.Schema, spec: FeatureSpec, file: str | None) -> None:
    hit = _VALIDATED.get(id(spec))
    if hit is not None and hit[0] is spec and hit[1].equals(schema):
        return
    validate_schema(schema, spec, file=file)
    if len(_VALIDATED) >= 64:
        _VALIDATED.clear()
    _VALIDATED[id(spec)] = (spec, schema)


class _Rows:
    """Collects bad rows: raises at the first one in "error" mode, else marks and counts."""

    def __init__(self, num_rows: int, file: str | None, row_offset: int, skip: bool) -> None:
        self.num_rows, self.file, self.row_offset, self.skip = num_rows, file, row_offset, skip
        self.bad = np.zeros(num_rows if skip else 0, dtype=bool)
        self.skipped: dict[str, int] = {}
        self.first_reason: dict[str, np.ndarray] = {}  # reason -> mask of rows counted under it

    def flag(self, reason: str, column: str, rows: np.ndarray, what: str) -> None:
        """``rows``: bool mask over the batch; ``what`` says what is wrong in the first of them."""
        if not self.skip:
            row = int(np.argmax(rows))
            raise BadInputError(
                reason, what, file=self.file, column=column, row=row, row_offset=self.row_offset
            )
        fresh = rows & ~self.bad
        new = int(np.count_nonzero(fresh))
        if new:
            self.skipped[reason] = self.skipped.get(reason, 0) + new
            if reason in self.first_reason:
                self.first_reason[reason] |= fresh
            else:
                self.first_reason[reason] = fresh
            self.bad |= rows

    def flag_values(
        self, reason: str, column: str, bad: np.ndarray, lengths: np.ndarray, what: str
    ) -> None:
        """Like :meth:`flag` for a mask over a feature's ids laid out (row-major) by ``lengths``;
        ``what`` describes the first bad id, which lies in the first bad row."""
        row_of = np.repeat(np.arange(self.num_rows), lengths)
        rows = np.zeros(self.num_rows, dtype=bool)
        rows[row_of[bad]] = True
        first = int(np.argmax(bad))
        item = first - int(lengths[: row_of[first]].sum())
        self.flag(reason, column, rows, f"{what} (item {item} of the row's list)")


def _column(data: pa.Table | pa.RecordBatch, name: str) -> pa.Array:
    col = data.column(name)
    if isinstance(col, pa.ChunkedArray):
        if col.num_chunks == 1:
            return col.chunk(0)
        return col.combine_chunks() if col.num_chunks else pa.array([], type=col.type)
    return col


def _nulls(arr: pa.Array) -> np.ndarray:
    return np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)


def _float_block(
    data: pa.Table | pa.RecordBatch, columns: tuple[str, ...], rows: _Rows
) -> np.ndarray:
    """The columns as float32 ``[len(columns), B]``: contiguous writes, one finiteness pass."""
    block = np.empty((len(columns), data.num_rows), dtype=np.float32)
    with np.errstate(over="ignore"):  # a float32 overflow becomes inf, reported below
        for j, column in enumerate(columns):
            block[j] = _numeric(data, column, rows)
    if np.isfinite(block).all():
        return block
    for column, v in zip(columns, block, strict=True):
        for reason, mask in (("nan", np.isnan(v)), ("inf", np.isinf(v))):
            if mask.any():
                value = v[int(np.argmax(mask))]  # the first bad row's, which "error" reports
                rows.flag(reason, column, mask, f"value {value} is not finite")
    return block


def _numeric(data: pa.Table | pa.RecordBatch, column: str, rows: _Rows) -> np.ndarray:
    arr = _column(data, column)
    if arr.null_count:
        rows.flag("null_value", column, _nulls(arr), "null value")
        arr = arr.fill_null(0)
    return np.asarray(arr.to_numpy(zero_copy_only=False))


def _single(arr: pa.Array, lengths: np.ndarray) -> pa.Array:
    """A one-value-per-row column as lists: length 1, or 0 (an empty list) where null."""
    if not arr.null_count:
        lengths.fill(1)
        return arr
    valid = ~_nulls(arr)
    lengths[:] = valid
    return arr.filter(pa.array(valid))


def _flat(arr: pa.Array, lengths: np.ndarray) -> pa.Array:
    """Writes a list (or one-value-per-row) column's lengths into ``lengths``, a null list
    counting as empty, and returns its items in row order (nulls inside lists kept)."""
    if not isinstance(arr, pa.ListArray | pa.LargeListArray):  # one value per row
        return _single(arr, lengths)
    # offsets respect the array's slice but are not rebased: the items are child[o[0]:o[-1]].
    offsets = arr.offsets.to_numpy()
    start, end = int(offsets[0]), int(offsets[-1])
    np.subtract(offsets[1:], offsets[:-1], out=lengths, casting="unsafe")
    child = arr.values.slice(start, end - start)
    if arr.null_count:  # a null list is empty; Arrow allows it to span items, which we drop
        null = _nulls(arr)
        if lengths[null].any():
            child = child.filter(pa.array(np.repeat(~null, lengths)))
        lengths[null] = 0
    return child


@dataclasses.dataclass(frozen=True)
class _Ids:
    """A feature's raw ids, and what ``null_id_policy="drop"`` removed: a mask over the ids
    before the drop, and the lengths before it (None when nothing was dropped)."""

    values: np.ndarray
    dropped: np.ndarray | None = None
    lengths_before_drop: np.ndarray | None = None


def _raw_ids(arr: pa.Array, f: SparseFeature, rows: _Rows, lengths: np.ndarray) -> _Ids:
    """Writes the feature's lengths into ``lengths`` and returns its ids (any int dtype, row
    order; a zero-copy view of the Arrow buffer when there are no nulls)."""
    child = _flat(arr, lengths)
    if not child.null_count:  # the common case: a zero-copy view
        return _Ids(np.asarray(child.to_numpy()))
    inner = _nulls(child)
    if f.null_id_policy == "drop":
        before = lengths.copy()
        row_of = np.repeat(np.arange(len(lengths)), lengths)
        lengths -= np.bincount(row_of[inner], minlength=len(lengths)).astype(lengths.dtype)
        return _Ids(np.asarray(child.filter(pa.array(~inner)).to_numpy()), inner, before)
    rows.flag_values("null_id", f.source_column, inner, lengths, "null id")
    child = child.fill_null(0)  # only reached when skipping: the row goes anyway
    return _Ids(np.asarray(child.to_numpy()))


def _weights(
    data: pa.Table | pa.RecordBatch, f: SparseFeature, ids: _Ids, lengths: np.ndarray, rows: _Rows
) -> np.ndarray:
    """The float32 weights of ``f``'s ids (aligned with them after any dropped null id),
    checked: as many weights as ids in every row, none null, all finite."""
    assert f.weights is not None
    column = f.weights
    have = np.empty(len(lengths), dtype=np.int32)
    child = _flat(_column(data, column), have)
    want = ids.lengths_before_drop if ids.lengths_before_drop is not None else lengths
    mismatch = have != want
    if mismatch.any():
        r = int(np.argmax(mismatch))
        what = f"{have[r]} weights for {want[r]} ids of column {f.source_column!r}"
        rows.flag("weights_length_mismatch", column, mismatch, what)
        return np.zeros(len(ids.values), dtype=np.float32)  # skipping: the rows go anyway
    if child.null_count:
        rows.flag_values("null_weight", column, _nulls(child), want, "null weight")
        child = child.fill_null(0)
    with np.errstate(over="ignore"):  # a float32 overflow becomes inf, reported below
        w = np.asarray(child.to_numpy(zero_copy_only=False), dtype=np.float32)
    bad = ~np.isfinite(w)
    if bad.any():
        what = f"weight {w[int(np.argmax(bad))]} is not finite"
        rows.flag_values("non_finite_weight", column, bad, want, what)
        w = np.where(bad, np.float32(0), w)
    return w if ids.dropped is None else w[~ids.dropped]


def _splitmix64_inplace(z: np.ndarray, tmp: np.ndarray) -> None:
    """splitmix64 over a uint64 array, in place (uint64 arithmetic wraps, as the hash wants)."""
    z += _U64(0x9E3779B97F4A7C15)
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        np.right_shift(z, _U64(shift), out=tmp)
        z ^= tmp
        z *= _U64(mult)
    np.right_shift(z, _U64(31), out=tmp)
    z ^= tmp


def _mod_inplace(out: np.ndarray, n: int) -> None:
    # x - (x // n) * n: numpy divides by a scalar with libdivide, ~4x faster than np.remainder.
    q = np.floor_divide(out, out.dtype.type(n))
    q *= out.dtype.type(n)
    out -= q


def _fill_ids(
    raw: np.ndarray, f: SparseFeature, out: np.ndarray, lengths: np.ndarray, rows: _Rows
) -> None:
    """Copies ``raw`` into ``out`` (an int64 slice of the values buffer) and applies the policy."""
    n = f.num_embeddings
    u = out.view(_U64)
    # Signed ids are sign-extended: the hash sees each id's 64-bit two's complement.
    np.copyto(u if raw.dtype == _U64 else out, raw, casting="unsafe")
    if f.id_policy == "raw":  # managed ids: mapped to rows in the model
        return
    if f.id_policy == "hash":
        _splitmix64_inplace(u, np.empty_like(u))
        _mod_inplace(u, n)
        return
    # One pass while the slice is hot: as uint64, a negative id is huge, so max < n means valid.
    if len(u) == 0 or int(np.maximum.reduce(u)) < n:
        return
    signed = raw.dtype.kind == "i"
    negative = raw < 0 if signed else np.zeros(len(raw), dtype=bool)
    policy = f"id_policy={f.id_policy!r}"
    if negative.any():
        what = f"negative id {raw[np.argmax(negative)]} ({policy})"
        rows.flag_values("negative_id", f.source_column, negative, lengths, what)
    if f.id_policy == "strict":
        high = (raw >= n) & ~negative
        if high.any():
            what = f"id {raw[np.argmax(high)]} >= num_embeddings={n} ({policy})"
            rows.flag_values("id_out_of_range", f.source_column, high, lengths, what)
        return
    if negative.any():  # skipping: the rows go anyway, keep the modulo below well defined
        out[negative] = 0
    _mod_inplace(u, n)


# Vocabulary digest -> value -> id, built once per process (a pipeline worker converts many
# blocks with one spec); a lookup then costs one dict access per distinct value of a batch.
_VOCABULARIES: dict[str, dict[str, int]] = {}


def _vocabulary_index(f: CategoricalFeature) -> dict[str, int]:
    assert f.vocabulary is not None and f.vocabulary_sha256 is not None
    index = _VOCABULARIES.get(f.vocabulary_sha256)
    if index is None:
        index = {v: i + 1 for i, v in enumerate(f.vocabulary)}
        _VOCABULARIES[f.vocabulary_sha256] = index
    return index


def category_id(value: str, f: CategoricalFeature) -> int:
    """The id of one category (its text) under ``f``'s encoding."""
    if f.encoding != "vocabulary":
        digest = hashlib.blake2b(value.encode(), digest_size=8).digest()
        if f.encoding == "hash64":  # a raw id for managed ids
            return int.from_bytes(digest, "little", signed=True)
        return int.from_bytes(digest, "little") % f.num_embeddings
    return _vocabulary_index(f).get(value, 0)


def _categories(
    data: pa.Table | pa.RecordBatch, f: CategoricalFeature, lengths: np.ndarray
) -> np.ndarray:
    """Writes the feature's lengths into ``lengths`` and returns its ids: each distinct value of
    the batch is encoded once. A null value, or a null list, is an empty list; a null inside a
    list is left out of it."""
    arr = _column(data, f.source_column)
    if isinstance(arr, pa.ListArray | pa.LargeListArray):
        lengths[:] = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
        values = pc.list_flatten(arr)  # the items of non-null lists, in row order
        if values.null_count:
            inner = _nulls(values)
            row_of = np.repeat(np.arange(len(lengths)), lengths)
            lengths -= np.bincount(row_of[inner], minlength=len(lengths)).astype(lengths.dtype)
            values = values.filter(pa.array(~inner))
    else:
        values = _single(arr, lengths)
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        values = values.cast(pa.string())  # integers as categories: their decimal text
    encoded = pc.dictionary_encode(values)
    uniques = encoded.dictionary.to_pylist()
    ids = np.fromiter((category_id(u, f) for u in uniques), dtype=np.int64, count=len(uniques))
    return ids[encoded.indices.to_numpy(zero_copy_only=False)]


def _bucketize(
    data: pa.Table | pa.RecordBatch, f: BucketizedFeature, rows: _Rows, lengths: np.ndarray
) -> np.ndarray:
    arr = _column(data, f.source_column)
    x = np.asarray(_single(arr, lengths).to_numpy(zero_copy_only=False), dtype=np.float64)
    nan = np.isnan(x)
    if nan.any():
        what = f"NaN cannot be bucketized (feature {f.name!r})"
        rows.flag_values("nan", f.source_column, nan, lengths, what)
    return np.searchsorted(np.asarray(f.boundaries), x, side="right")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Arrays:
    """A converted batch as NumPy arrays, before any tensor: what :func:`as_batch` wraps.

    ``dense`` float32 ``[B, num_dense]``; ``labels`` float32 ``[B]`` (or ``[B, n]``); ``values``
    int64 and ``lengths`` int32, key-major (feature ``k``'s ids are
    ``values[offset_per_key[k]:offset_per_key[k + 1]]``, its lengths
    ``lengths[k * B:(k + 1) * B]``); ``weights`` float32 aligned with ``values``, or None."""

    keys: tuple[str, ...]
    dense: np.ndarray
    labels: np.ndarray
    values: np.ndarray
    lengths: np.ndarray
    offset_per_key: list[int]
    weights: np.ndarray | None

    @property
    def num_rows(self) -> int:
        return int(self.dense.shape[0])


def as_batch(arrays: Arrays) -> Batch:
    """The ``Batch`` of ``arrays``, sharing their memory: the one place a KJT is built."""
    offsets = arrays.offset_per_key
    kjt = KeyedJaggedTensor(
        keys=list(arrays.keys),
        values=torch.from_numpy(arrays.values),
        weights=None if arrays.weights is None else torch.from_numpy(arrays.weights),
        lengths=torch.from_numpy(arrays.lengths),
        stride=arrays.num_rows,
        length_per_key=[b - a for a, b in itertools.pairwise(offsets)],
        offset_per_key=offsets,
    )
    return Batch(torch.from_numpy(arrays.dense), kjt, torch.from_numpy(arrays.labels))


def to_batch(
    data: pa.Table | pa.RecordBatch,
    spec: FeatureSpec,
    *,
    file: str | None = None,
    row_offset: int = 0,
    on_bad_rows: OnBadRows = "error",
) -> tuple[Batch, ConversionReport]:
    """Converts ``data`` (any chunking or slicing) to a ``Batch`` laid out by ``spec``.

    Dense features are float32 ``[B, num_dense]`` (``[B, 0]`` without dense columns), labels
    float32 ``[B]`` (or ``[B, n]`` for several label columns), sparse features a key-major
    ``KeyedJaggedTensor`` (int64 values, int32 lengths, ``length_per_key`` / ``offset_per_key``
    precomputed; float32 ``weights`` when any feature has a weights column, 1 for the others).
    ``row_offset`` is the absolute index of ``data``'s first row, for error messages. Raises
    :class:`BadInputError`, or with ``on_bad_rows="skip"`` drops rows holding a bad value and
    counts them in the report. :func:`convert` and then :func:`as_batch`.
    """
    arrays, report = convert(data, spec, file=file, row_offset=row_offset, on_bad_rows=on_bad_rows)
    return as_batch(arrays), report


def convert(
    data: pa.Table | pa.RecordBatch,
    spec: FeatureSpec,
    *,
    file: str | None = None,
    row_offset: int = 0,
    on_bad_rows: OnBadRows = "error",
) -> tuple[Arrays, ConversionReport]:
    """:func:`to_batch`'s checks and id policies, with the result as NumPy :class:`Arrays`."""
    if on_bad_rows not in ("error", "skip"):
        raise ValueError(f"on_bad_rows must be 'error' or 'skip', got {on_bad_rows!r}")
    if row_offset < 0:
        raise ValueError(f"row_offset must be >= 0, got {row_offset!r}")
    _check_schema(data.schema, spec, file)
    num_rows = data.num_rows
    rows = _Rows(num_rows, file, row_offset, on_bad_rows == "skip")

    # Columns are read into [n, B] blocks and transposed once: faster than strided writes.
    dense = np.ascontiguousarray(_float_block(data, spec.dense, rows).T)
    labels = _float_block(data, spec.labels, rows)
    labels = labels[0] if len(spec.labels) == 1 else np.ascontiguousarray(labels.T)
    row_ids = None
    if spec.row_id is not None:
        row_ids = np.array(_numeric(data, spec.row_id, rows), dtype=np.int64)

    # Pass 1: lengths straight into their key-major slots, and each feature's raw ids (views).
    num_keys = len(spec.sparse)
    lengths = np.empty(num_keys * num_rows, dtype=np.int32)
    raws: list[np.ndarray] = []
    weights: dict[int, np.ndarray] = {}  # feature index -> its ids' weights
    for k, f in enumerate(spec.sparse):
        slot = lengths[k * num_rows : (k + 1) * num_rows]
        if isinstance(f, SparseFeature):
            ids = _raw_ids(_column(data, f.source_column), f, rows, slot)
            raws.append(ids.values)
            if f.weights is not None:
                weights[k] = _weights(data, f, ids, slot, rows)
        elif isinstance(f, CategoricalFeature):
            raws.append(_categories(data, f, slot))
        else:
            raws.append(_bucketize(data, f, rows, slot))
    # Pass 2: one values buffer, filled feature by feature, each slice checked while hot.
    length_per_key = [len(r) for r in raws]
    offset_per_key = [0, *itertools.accumulate(length_per_key)]
    values = np.empty(offset_per_key[-1], dtype=np.int64)
    for k, (f, raw) in enumerate(zip(spec.sparse, raws, strict=True)):
        out = values[offset_per_key[k] : offset_per_key[k + 1]]
        if isinstance(f, SparseFeature):
            _fill_ids(raw, f, out, lengths[k * num_rows : (k + 1) * num_rows], rows)
        else:
            out[:] = raw

    if rows.skip and rows.skipped:  # rare: convert the good rows again, which cannot fail
        arrays, kept = convert(data.filter(pa.array(~rows.bad)), spec, file=file)
        where = {reason: np.flatnonzero(mask) for reason, mask in rows.first_reason.items()}
        report = dataclasses.replace(
            kept, rows_in=num_rows, skipped=dict(rows.skipped), skipped_rows=where
        )
        return arrays, report
    all_weights = None
    if spec.is_weighted:  # one weight per id; 1 for the features without a weights column
        all_weights = np.ones(offset_per_key[-1], dtype=np.float32)
        for k, fw in weights.items():
            all_weights[offset_per_key[k] : offset_per_key[k + 1]] = fw
    arrays = Arrays(
        keys=spec.sparse_names,
        dense=dense,
        labels=labels,
        values=values,
        lengths=lengths,
        offset_per_key=offset_per_key,
        weights=all_weights,
    )
    report = ConversionReport(rows_in=num_rows, rows_out=num_rows, skipped={}, row_ids=row_ids)
    return arrays, report
