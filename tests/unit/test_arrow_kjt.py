"""to_batch against a per-row Python reference, plus every bad-input path and the spec checks."""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from raytrec.data.arrow_kjt import BadInputError, ConversionReport, to_batch, validate_schema
from raytrec.data.source import Batch
from raytrec.data.spec import (
    BucketizedFeature,
    FeatureSpec,
    SparseFeature,
    SpecError,
    criteo_spec,
)

M64 = (1 << 64) - 1
FILE = "part-7.parquet"
BOUNDS = (-1.0, 0.0, 0.5, 2.0)

SPEC = FeatureSpec(
    dense=("d_float", "d_int"),
    sparse=(
        SparseFeature(name="mod", column="c_mod", num_embeddings=50, id_policy="modulo"),
        SparseFeature(name="strict32", column="c_strict32", num_embeddings=40, id_policy="strict"),
        SparseFeature(name="hash", column="c_hash", num_embeddings=97, id_policy="hash"),
        SparseFeature(name="single", column="c_single", num_embeddings=7, id_policy="modulo"),
        BucketizedFeature(name="bucket", source_column="d_float", boundaries=BOUNDS),
    ),
    labels=("label",),
    row_id="rid",
)


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def random_lists(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[list[int] | None]:
    out: list[list[int] | None] = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.1:
            out.append(None)
        elif kind < 0.25:
            out.append([])
        else:
            out.append(rng.integers(lo, hi, int(rng.integers(1, 5))).tolist())
    return out


def make_table(rows: int = 40, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    single = [None if rng.random() < 0.2 else int(v) for v in rng.integers(0, 1000, rows)]
    return pa.table(
        {
            "d_float": pa.array(rng.normal(size=rows) * 2, pa.float64()),
            "d_int": pa.array(rng.integers(-5, 5, rows), pa.int32()),
            "label": pa.array(rng.integers(0, 2, rows), pa.int8()),
            "rid": pa.array(np.arange(rows) + 1000, pa.int64()),
            "c_mod": pa.array(random_lists(rng, rows, 0, 500), pa.list_(pa.int64())),
            "c_strict32": pa.array(random_lists(rng, rows, 0, 40), pa.list_(pa.int32())),
            "c_hash": pa.array(random_lists(rng, rows, -(2**62), 2**62), pa.large_list(pa.int64())),
            "c_single": pa.array(single, pa.int64()),
        }
    )


def reference(data: pa.Table | pa.RecordBatch, spec: FeatureSpec) -> dict[str, Any]:
    """The obvious per-row conversion, one Python value at a time."""
    rows = data.to_pylist()
    lengths: list[int] = []
    values: list[int] = []
    per_key: list[int] = []
    for f in spec.sparse:
        count = 0
        for row in rows:
            if isinstance(f, BucketizedFeature):
                x = row[f.source_column]
                ids = [] if x is None else [bisect.bisect_right(f.boundaries, x)]
            else:
                raw = row[f.source_column]
                ids = [] if raw is None else raw if isinstance(raw, list) else [raw]
                n = f.num_embeddings
                if f.id_policy == "hash":
                    ids = [splitmix64(i & M64) % n for i in ids]
                elif f.id_policy == "modulo":
                    ids = [i % n for i in ids]
            lengths.append(len(ids))
            values.extend(ids)
            count += len(ids)
        per_key.append(count)
    return {
        "dense": [[float(row[c]) for c in spec.dense] for row in rows],
        "labels": [float(row[spec.labels[0]]) for row in rows],
        "row_ids": [row[spec.row_id] for row in rows] if spec.row_id else None,
        "lengths": lengths,
        "values": values,
        "length_per_key": per_key,
        "stride": len(rows),
    }


def assert_matches(batch: Batch, report: ConversionReport, ref: dict[str, Any]) -> None:
    kjt = batch.sparse_features
    # Handed in precomputed (torchrec would otherwise derive them from lengths on first use).
    assert kjt._length_per_key == ref["length_per_key"] and kjt._offset_per_key is not None
    assert kjt.keys() == list(SPEC.sparse_names)
    assert kjt.stride() == ref["stride"]
    assert kjt.values().dtype == torch.int64 and kjt.lengths().dtype == torch.int32
    assert kjt.lengths().tolist() == ref["lengths"]
    assert kjt.values().tolist() == ref["values"]
    assert kjt.length_per_key() == ref["length_per_key"]
    assert kjt.offset_per_key() == [0, *np.cumsum(ref["length_per_key"]).tolist()]
    assert batch.dense_features.dtype == torch.float32
    expected_dense = torch.tensor(ref["dense"], dtype=torch.float32).reshape(-1, SPEC.num_dense)
    assert torch.equal(batch.dense_features, expected_dense)
    assert torch.equal(batch.labels, torch.tensor(ref["labels"], dtype=torch.float32))
    assert report.row_ids is not None and report.row_ids.tolist() == ref["row_ids"]
    assert report.rows_in == report.rows_out == ref["stride"] and report.skipped == {}


def variants() -> dict[str, pa.Table | pa.RecordBatch]:
    table = make_table()
    rb = table.to_batches()[0]
    chunked = pa.Table.from_batches([rb.slice(0, 7), rb.slice(7, 0), rb.slice(7, 20), rb.slice(27)])
    return {
        "table": table,
        "record_batch": rb,
        "sliced": rb.slice(3, 10),
        "chunked": chunked,
        "chunked_sliced": chunked.slice(5, 25),
        "empty": rb.slice(0, 0),
    }


@pytest.mark.parametrize("name", list(variants()))
def test_matches_per_row_reference(name: str) -> None:
    data = variants()[name]
    batch, report = to_batch(data, SPEC, file=FILE)
    assert_matches(batch, report, reference(data, SPEC))
    moved = batch.to(torch.device("cpu"))  # Batch stays a plain Batch
    assert torch.equal(moved.sparse_features.values(), batch.sparse_features.values())


def one_feature_spec(feature: SparseFeature | BucketizedFeature) -> FeatureSpec:
    return FeatureSpec(dense=(), sparse=(feature,), labels=("y",))


def test_bucketize_by_value() -> None:
    feature = BucketizedFeature(name="b", source_column="x", boundaries=BOUNDS)
    table = pa.table({"x": [-2.0, -1.0, 0.7, 2.0, math.inf, None], "y": [0] * 6})
    kjt = to_batch(table, one_feature_spec(feature))[0].sparse_features
    assert kjt.values().tolist() == [0, 1, 3, 4, 4] and kjt.lengths().tolist() == [1] * 5 + [0]


@pytest.mark.parametrize(
    ("policy", "n", "ids", "arrow_type", "expected"),
    [
        ("modulo", 7, [[8, 9, 10], [15, 0]], pa.int64(), [1, 2, 3, 1, 0]),
        ("modulo", 7, [[2**64 - 1], [15]], pa.uint64(), [(2**64 - 1) % 7, 1]),
        ("strict", 11, [[8, 9, 10], [0]], pa.uint64(), [8, 9, 10, 0]),
        ("strict", 11, [[8, 9, 10], [0]], pa.int32(), [8, 9, 10, 0]),
        ("hash", 1000, [[-3, 2**63 - 1], [5]], pa.int64(), [-3, 2**63 - 1, 5]),
        ("hash", 1000, [[-3, 7], [5]], pa.int32(), [-3, 7, 5]),
        ("hash", 1000, [[2**64 - 3], [5]], pa.uint64(), [-3, 5]),
    ],
)
def test_id_policies_by_value(
    policy: str, n: int, ids: list[list[int]], arrow_type: pa.DataType, expected: list[int]
) -> None:
    feature = SparseFeature(name="f", num_embeddings=n, id_policy=policy)  # type: ignore[arg-type]
    table = pa.table({"f": pa.array(ids, pa.list_(arrow_type)), "y": [0, 1]})
    if policy == "hash":  # the hash sees each id's 64-bit two's complement
        expected = [splitmix64(i & M64) % n for i in expected]
    assert to_batch(table, one_feature_spec(feature))[0].sparse_features.values().tolist() == (
        expected
    )


def test_null_inside_list_drop_policy() -> None:
    feature = SparseFeature(name="f", num_embeddings=10, null_id_policy="drop")
    spec = FeatureSpec(dense=(), sparse=(feature,), labels=("y",))
    table = pa.table({"f": [[1, None, 2], [None], None, [3]], "y": [0, 1, 0, 1]})
    kjt = to_batch(table, spec)[0].sparse_features
    assert kjt.lengths().tolist() == [2, 0, 0, 1] and kjt.values().tolist() == [1, 2, 3]
    assert kjt.length_per_key() == [3]


def test_null_list_spanning_ids_and_sliced_null_ids() -> None:
    # Arrow lets a null list span child values; they must not leak into the next row's list.
    offsets = pa.array([0, 2, 4, 5, 7], pa.int32())
    child = pa.array([1, 2, 3, 4, 5, None, 6], pa.int64())
    mask = pa.array([False, True, False, False])
    lists = pa.ListArray.from_arrays(offsets, child, mask=mask)
    feature = SparseFeature(name="f", num_embeddings=10, null_id_policy="drop")
    table = pa.table({"f": lists, "y": [0, 1, 0, 1]})
    kjt = to_batch(table, one_feature_spec(feature))[0].sparse_features
    assert kjt.lengths().tolist() == [2, 0, 1, 1] and kjt.values().tolist() == [1, 2, 5, 6]
    kjt = to_batch(table.slice(1), one_feature_spec(feature))[0].sparse_features
    assert kjt.lengths().tolist() == [0, 1, 1] and kjt.values().tolist() == [5, 6]
    strict = dataclasses.replace(feature, null_id_policy="error")
    with pytest.raises(BadInputError, match=r"column 'f', row 2: null id"):
        to_batch(table.slice(1), one_feature_spec(strict))


def test_multiple_labels_shape() -> None:
    spec = FeatureSpec(
        dense=("a",), sparse=(SparseFeature(name="f", num_embeddings=3),), labels=("y", "z")
    )
    table = pa.table({"a": [1.0, 2.0], "f": [1, 2], "y": [0.0, 1.0], "z": [1.0, 0.0]})
    labels = to_batch(table, spec)[0].labels
    assert labels.shape == (2, 2) and labels.tolist() == [[0.0, 1.0], [1.0, 0.0]]


def corrupt(table: pa.Table, column: str, row: int, value: Any) -> pa.Table:
    """``table`` with ``column[row] = value``."""
    col = table.column(column).to_pylist()
    col[row] = value
    i = table.schema.get_field_index(column)
    return table.set_column(i, table.schema.field(i), pa.array(col, table.schema.field(i).type))


BAD = {
    "nan": ("d_float", math.nan),
    "inf": ("d_float", 1e300),  # finite as float64, overflows float32
    "negative_id": ("c_mod", [4, -1]),
    "id_out_of_range": ("c_strict32", [3, 40]),
    "null_id": ("c_strict32", [1, None]),
    "null_value": ("label", None),
}


def bad_table(reason: str, row: int) -> tuple[pa.Table, str]:
    column, value = BAD[reason]
    return corrupt(make_table(rows=12, seed=1), column, row, value), column


@pytest.mark.parametrize("reason", list(BAD))
def test_bad_value_names_file_column_row(reason: str) -> None:
    table, column = bad_table(reason, row=3)
    pattern = rf"\({reason}\) in file '{FILE}', column '{column}', row 3 \(absolute row 103\)"
    with pytest.raises(BadInputError, match=pattern) as info:
        to_batch(table, SPEC, file=FILE, row_offset=100)
    err = info.value
    got = (err.reason, err.file, err.column, err.row, err.absolute_row)
    assert got == (reason, FILE, column, 3, 103)


def test_bad_value_in_sliced_batch_reports_batch_row() -> None:
    table, _ = bad_table("negative_id", row=8)
    with pytest.raises(BadInputError, match=r"column 'c_mod', row 3 \(absolute row 8\).*-1"):
        to_batch(table.to_batches()[0].slice(5, 6), SPEC, file=FILE, row_offset=5)


def test_bucketize_nan_is_bad() -> None:
    spec = FeatureSpec(
        dense=(),
        sparse=(BucketizedFeature(name="b", source_column="x", boundaries=(0.0,)),),
        labels=("y",),
    )
    table = pa.table({"x": [1.0, math.nan], "y": [0, 1]})
    with pytest.raises(BadInputError, match=r"file 'f', column 'x', row 1.*NaN"):
        to_batch(table, spec, file="f")


def test_schema_errors() -> None:
    table = make_table(rows=4)
    with pytest.raises(BadInputError, match=rf"missing_column.*'{FILE}', column 'c_hash'"):
        to_batch(table.drop_columns(["c_hash"]), SPEC, file=FILE)
    strings = table.set_column(
        table.schema.get_field_index("c_single"), "c_single", pa.array(["a", "b", "c", "d"])
    )
    pattern = rf"wrong_type.*'{FILE}', column 'c_single'.*expected list<int>.*got string"
    with pytest.raises(BadInputError, match=pattern):
        validate_schema(strings.schema, SPEC, file=FILE)
    floats = pa.array([[1.0]] * 4, pa.list_(pa.float32()))
    bad_list = table.set_column(table.schema.get_field_index("c_mod"), "c_mod", floats)
    with pytest.raises(BadInputError, match=r"column 'c_mod'.*got list<item: float>"):
        to_batch(bad_list, SPEC, file=FILE)


def test_skip_mode_counts_reasons_and_keeps_good_rows() -> None:
    table = make_table(rows=30, seed=2)
    for reason, row in (("nan", 1), ("negative_id", 4), ("id_out_of_range", 9), ("null_id", 20)):
        column, value = BAD[reason]
        table = corrupt(table, column, row, value)
    table = corrupt(table, "c_mod", 1, [-7])  # a second problem in an already bad row
    batch, report = to_batch(table, SPEC, file=FILE, on_bad_rows="skip")
    assert report.skipped == {"nan": 1, "negative_id": 1, "id_out_of_range": 1, "null_id": 1}
    assert (report.rows_in, report.rows_out) == (30, 26)
    good = table.filter(pa.array([i not in (1, 4, 9, 20) for i in range(30)]))
    kept = dataclasses.replace(report, rows_in=26, skipped={})  # as if converting `good`
    assert_matches(batch, kept, reference(good, SPEC))


def test_spec_validation_names_field() -> None:
    with pytest.raises(SpecError, match=r"SparseFeature.id_policy must be one of .*'wrap'"):
        SparseFeature(name="f", num_embeddings=3, id_policy="wrap")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"SparseFeature.num_embeddings must be an int >= 1"):
        SparseFeature(name="f", num_embeddings=0)
    with pytest.raises(SpecError, match=r"null_id_policy must be one of \('error', 'drop'\)"):
        SparseFeature(name="f", num_embeddings=3, null_id_policy="zero")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"boundaries must be .*strictly increasing"):
        BucketizedFeature(name="b", source_column="x", boundaries=(1.0, 1.0))
    f = SparseFeature(name="f", num_embeddings=3)
    with pytest.raises(SpecError, match=r"FeatureSpec.sparse must be free of duplicates"):
        FeatureSpec(dense=(), sparse=(f, f))
    with pytest.raises(SpecError, match=r"FeatureSpec.sparse .*both numeric and ids"):
        FeatureSpec(dense=("f",), sparse=(f,))
    assert f.column == "f" and f.source_column == "f"


def test_criteo_spec() -> None:
    spec = criteo_spec(num_embeddings=100)
    assert spec.num_dense == 13 and len(spec.sparse_names) == 26
    assert spec.required_columns()[:2] == ("dense_0", "dense_1")
    assert spec.required_columns()[-2:] == ("label", "row_id")
    assert spec.expected_types()["cat_3"] == "ids"
    assert spec.num_embeddings == (100,) * 26
