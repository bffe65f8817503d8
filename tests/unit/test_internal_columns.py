"""The pipeline's internal layout: a worker converts once and writes Arrow, with no tensor; a rank
builds its batch from that Arrow, and gets bitwise what ``to_batch`` gives on the source rows."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

import raytrec.data.arrow_kjt as arrow_kjt
from raytrec.data.arrow_kjt import to_batch
from raytrec.data.preprocess import DROP, EpochLog, internal_columns_of, preprocess, take_marked
from raytrec.data.source import Batch
from raytrec.data.spec import (
    BucketizedFeature,
    CategoricalFeature,
    FeatureSpec,
    SparseFeature,
)

ROWS = 57
FEATURES = (
    SparseFeature(name="mod", column="c_mod", num_embeddings=50, id_policy="modulo", weights="w"),
    SparseFeature(name="hash", column="c_hash", num_embeddings=97, id_policy="hash"),
    CategoricalFeature(
        name="cat", column="c_cat", num_embeddings=5, encoding="vocabulary", vocabulary=("a", "b")
    ),
    BucketizedFeature(name="bucket", source_column="d0", boundaries=(-1.0, 0.0, 1.0)),
)
SPECS = {
    "weighted": FeatureSpec(dense=("d0", "d1"), sparse=FEATURES, labels=("y",), row_id="rid"),
    "unweighted, two labels": FeatureSpec(
        dense=("d1", "d0"), sparse=FEATURES[1:], labels=("y", "z"), row_id="rid"
    ),
    "no dense, no row id": FeatureSpec(dense=(), sparse=FEATURES[:2], labels=("y",)),
}


def source_rows(seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)

    def lists(hi: int) -> list[list[int] | None]:
        return [
            None if rng.random() < 0.1 else rng.integers(0, hi, int(rng.integers(0, 4))).tolist()
            for _ in range(ROWS)
        ]

    ids = lists(1000)
    return pa.table(
        {
            "d0": pa.array(rng.normal(size=ROWS), pa.float64()),
            "d1": pa.array(rng.integers(-5, 5, ROWS), pa.int32()),
            "y": pa.array(rng.integers(0, 2, ROWS), pa.int8()),
            "z": pa.array(rng.random(ROWS), pa.float32()),
            "rid": pa.array(np.arange(ROWS) + 500, pa.int64()),
            "c_mod": pa.array(ids, pa.list_(pa.int64())),
            "w": pa.array(
                [None if r is None else rng.random(len(r)).tolist() for r in ids],
                pa.list_(pa.float32()),
            ),
            "c_hash": pa.array(lists(2**40), pa.large_list(pa.int64())),
            "c_cat": pa.array(rng.choice(["a", "b", "c", "d"], ROWS).tolist(), pa.string()),
        }
    )


def as_ray_data_hands_it_over(table: pa.Table) -> pa.Table:
    """The worker's block cut and stuck together again, as batches that span blocks are, and
    one list column's items held at an offset into a longer array."""
    parts = [table.slice(0, 9), table.slice(9, 0), table.slice(9, 30), table.slice(39)]
    ids = table.column("__rt_sparse_0").combine_chunks()
    padded = pa.concat_arrays([pa.array([7, 7, 7], pa.int64()), ids.values])
    moved = pa.ListArray.from_arrays(pa.array(ids.offsets.to_numpy()), padded.slice(3))
    parts.append(
        table.set_column(table.schema.get_field_index("__rt_sparse_0"), "__rt_sparse_0", moved)
    )
    return pa.concat_tables(parts).slice(3)


def assert_same(got: Batch, want: Batch) -> None:
    a, b = got.sparse_features, want.sparse_features
    assert a.keys() == b.keys() and a.stride() == b.stride()
    # Handed in precomputed (torchrec would otherwise derive them from the lengths).
    assert a._length_per_key == b.length_per_key() and a._offset_per_key == b.offset_per_key()
    for x, y in (
        (got.dense_features, want.dense_features),
        (got.labels, want.labels),
        (a.values(), b.values()),
        (a.lengths(), b.lengths()),
    ):
        assert x.dtype == y.dtype and x.shape == y.shape and x.is_contiguous()
        assert torch.equal(x, y)
    assert (a.weights_or_none() is None) == (b.weights_or_none() is None)
    if b.weights_or_none() is not None:
        assert torch.equal(a.weights(), b.weights())


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("chunked", [False, True])
def test_a_rank_builds_bitwise_the_batch_to_batch_gives(name: str, chunked: bool) -> None:
    spec, table = SPECS[name], source_rows()
    out = preprocess(table, spec=spec, on_bad_rows="error")
    if chunked:
        out = as_ray_data_hands_it_over(out)
        table = pa.concat_tables([table.slice(0, 9), table.slice(9, 30), table.slice(39), table])
        table = table.slice(3)
    want, report = to_batch(table, spec)
    got, row_ids = internal_columns_of(spec).decode(out)
    assert_same(got, want)
    assert (row_ids is None) == (report.row_ids is None)
    if report.row_ids is not None:
        assert row_ids is not None and row_ids.tolist() == report.row_ids.tolist()
    empty, _ = internal_columns_of(spec).decode(out.slice(0, 0))
    assert empty.labels.shape[0] == 0 and empty.sparse_features.values().numel() == 0


def test_the_worker_builds_no_tensor_and_the_rank_one_kjt(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Any] = []
    real = arrow_kjt.KeyedJaggedTensor

    def counted(*args: Any, **kwargs: Any) -> Any:
        built.append(kwargs["keys"])
        return real(*args, **kwargs)

    monkeypatch.setattr(arrow_kjt, "KeyedJaggedTensor", counted)
    spec = SPECS["weighted"]
    out = preprocess(source_rows(), spec=spec, on_bad_rows="error")
    assert built == []
    assert all(name.startswith("__rt_") for name in out.column_names)  # no user column left
    internal_columns_of(spec).decode(out)
    assert built == [list(spec.sparse_names)]


def test_skipped_rows_are_marked_on_the_worker_and_counted_on_the_rank() -> None:
    spec = SPECS["weighted"]
    table = source_rows(seed=1)
    d0 = table.column("d0").to_numpy().copy()
    d0[[3, 40]] = np.nan
    table = table.set_column(0, "d0", pa.array(d0))
    want, report = to_batch(table, spec, on_bad_rows="skip")
    out = preprocess(table, spec=spec, on_bad_rows="skip")
    assert out.num_rows == ROWS and out.column(DROP).drop_null().to_pylist() == ["nan", "nan"]
    log = EpochLog(0, has_ids=True)
    layout = internal_columns_of(spec)
    got, row_ids = layout.decode(take_marked(out, log, row_id=layout.row_id))
    assert_same(got, want)
    assert log.skipped == {"nan": 2} and log.skipped_ids.merged() == ((503, 504), (540, 541))
    assert row_ids is not None and report.row_ids is not None
    assert row_ids.tolist() == report.row_ids.tolist()
