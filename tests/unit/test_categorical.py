"""A user's own Parquet columns: categories (strings, or integers used as categories) turned into
ids by a vocabulary or by hashing, the column mapping of ``data.columns``, and the model spec
that carries a vocabulary to serving. Pure: no Ray, no model."""

from __future__ import annotations

import collections
import hashlib
import pathlib

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from raytrec.config import (
    ColumnsConfig,
    ConfigError,
    DataConfig,
    ModelConfig,
    TableConfig,
    TrainConfig,
)
from raytrec.data.arrow_kjt import BadInputError, to_batch
from raytrec.data.from_config import parquet_spec
from raytrec.data.spec import (
    CategoricalFeature,
    FeatureSpec,
    SparseFeature,
    SpecError,
    fit_vocabulary,
)
from raytrec.data.vocabulary import count_categories
from raytrec.serving.model_spec import ModelSpec


def ids(table: pa.Table, *features: CategoricalFeature) -> dict[str, tuple[list[int], list[int]]]:
    spec = FeatureSpec(dense=(), sparse=features, labels=("y",))
    kjt = to_batch(table, spec)[0].sparse_features
    keys = kjt.keys()  # a KeyedJaggedTensor, not a dict
    return {k: (kjt[k].values().tolist(), kjt[k].lengths().tolist()) for k in keys}


def test_a_vocabulary_gives_ids_from_one_and_zero_to_unknown_values() -> None:
    table = pa.table({"u": ["b", "a", None, "zz", "a"], "y": [0, 1, 0, 1, 0]})
    user = CategoricalFeature(
        name="user", column="u", num_embeddings=3, encoding="vocabulary", vocabulary=("a", "b")
    )
    assert ids(table, user) == {"user": ([2, 1, 0, 1], [1, 1, 0, 1, 1])}  # null: empty list


def test_lists_of_categories_and_integer_categories() -> None:
    table = pa.table(
        {
            "tags": [["x", "y"], None, ["y", None, "q"], []],
            "n": pa.array([5, 7, None, 5], pa.int32()),
            "y": [0, 1, 0, 1],
        }
    )
    tags = CategoricalFeature(
        name="tags", num_embeddings=4, encoding="vocabulary", vocabulary=("y", "x")
    )
    n = CategoricalFeature(name="n", num_embeddings=3, encoding="vocabulary", vocabulary=("5",))
    # A null list is empty; a null inside a list is left out of it.
    assert ids(table, tags, n) == {
        "tags": ([2, 1, 1, 0], [2, 0, 2, 0]),
        "n": ([1, 0, 1], [1, 1, 0, 1]),
    }


def test_hashing_is_blake2b_of_the_text_modulo_the_rows() -> None:
    table = pa.table(
        {"c": pa.array(["alpha", "beta", "alpha"]).dictionary_encode(), "y": [0, 1, 0]}
    )
    feature = CategoricalFeature(name="c", num_embeddings=1000)

    def expected(text: str) -> int:
        return (
            int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % 1000
        )

    assert ids(table, feature)["c"][0] == [expected("alpha"), expected("beta"), expected("alpha")]


def test_a_column_of_another_type_is_named() -> None:
    table = pa.table({"c": [1.5, 2.5], "y": [0, 1]})
    with pytest.raises(BadInputError, match=r"column 'c'.*string or integer type"):
        ids(table, CategoricalFeature(name="c", num_embeddings=10))


def test_the_vocabulary_keeps_the_most_frequent_values_deterministically() -> None:
    counts = {"a": 5, "b": 9, "c": 5, "d": 1}
    assert fit_vocabulary(counts, size=3) == ("b", "a", "c")  # ties in text order
    assert fit_vocabulary(counts, size=10, min_count=2) == ("b", "a", "c")
    with pytest.raises(SpecError, match=r"at most num_embeddings - 1 = 2 values"):
        CategoricalFeature(
            name="f", num_embeddings=3, encoding="vocabulary", vocabulary=("a", "b", "c")
        )


def test_categories_are_counted_over_every_file_and_row_group(tmp_path: pathlib.Path) -> None:
    paths = []
    for k, rows in enumerate([["a", "b", "a"], ["b", "b", None]]):
        paths.append(str(tmp_path / f"{k}.parquet"))
        table = pa.table({"u": rows, "tags": [["x"], [], ["x", "y"]]})
        pq.write_table(table, paths[-1], row_group_size=2)
    counts = count_categories(pafs.LocalFileSystem(), paths, {"user": "u", "tags": "tags"})
    assert counts == {
        "user": collections.Counter({"b": 3, "a": 2}),
        "tags": collections.Counter({"x": 4, "y": 2}),
    }
    with pytest.raises(BadInputError, match=r"column 'missing'"):
        count_categories(pafs.LocalFileSystem(), paths, {"f": "missing"})


CONFIG = TrainConfig(
    model=ModelConfig(
        tables=(
            TableConfig(name="t_user", num_embeddings=10, embedding_dim=4, features=("user",)),
            TableConfig(name="t_item", num_embeddings=20, embedding_dim=4, features=("item",)),
        ),
        dense_arch_layers=(8, 4),
    ),
    data=DataConfig(
        columns=ColumnsConfig(
            label="clicked",
            row_id=None,
            dense=("age", "price"),
            features={"item": "item_id"},
            categorical={"user": "vocabulary"},
        )
    ),
)


def test_the_column_mapping_makes_the_row_layout() -> None:
    spec = parquet_spec(CONFIG, {"user": ("u1", "u2")})
    assert (spec.dense, spec.labels, spec.row_id) == (("age", "price"), ("clicked",), None)
    user, item = spec.sparse
    assert user == CategoricalFeature(
        name="user", num_embeddings=10, encoding="vocabulary", vocabulary=("u1", "u2")
    )
    assert item == SparseFeature(
        name="item", column="item_id", num_embeddings=20, id_policy="strict"
    )
    assert CONFIG.data.num_dense == 2
    with pytest.raises(ConfigError, match="fitted on the training data"):
        parquet_spec(CONFIG)


def test_the_model_spec_carries_the_vocabulary() -> None:
    spec = ModelSpec(
        model=CONFIG.model, num_dense=2, features=parquet_spec(CONFIG, {"user": ("u1",)})
    )
    again = ModelSpec.from_dict(spec.to_dict(), where="here")
    assert again == spec and again.features.sparse[0].vocabulary == ("u1",)


@pytest.mark.parametrize(
    ("data", "columns", "message"),
    [
        ({"num_dense": 3}, {"dense": ("a",)}, "leave num_dense out"),
        ({}, {"categorical": {"f": "onehot"}}, r"categorical.f='onehot': must be 'vocabulary'"),
        ({}, {"label": ""}, "data.columns.label='': must have at least 1 character"),
    ],
)
def test_bad_column_settings_are_named(
    data: dict[str, object], columns: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        DataConfig(columns=ColumnsConfig(**columns), **data)  # type: ignore[arg-type]


def test_a_feature_no_table_serves_is_named() -> None:
    data = DataConfig(columns=ColumnsConfig(features={"nope": "x"}))
    with pytest.raises(ConfigError, match=r"features \['nope'\] that no table"):
        parquet_spec(CONFIG.replace(data=data))


def test_out_of_range_ids_are_bad_input_by_default() -> None:
    assert DataConfig().id_policy == "strict"
    spec = parquet_spec(CONFIG, {"user": ("u1",)})
    table = pa.table(
        {"age": [1.0], "price": [2.0], "user": ["u1"], "item_id": [20], "clicked": [1]}
    )
    with pytest.raises(BadInputError, match=r"id 20 >= num_embeddings=20"):
        to_batch(table, spec)


def test_a_resumed_job_takes_the_vocabularies_of_its_checkpoint(tmp_path: pathlib.Path) -> None:
    from raytrec.preflight import vocabularies_of
    from raytrec.serving.model_spec import write_model_spec

    spec = ModelSpec(
        model=CONFIG.model, num_dense=2, features=parquet_spec(CONFIG, {"user": ("u9", "u1")})
    )
    write_model_spec(str(tmp_path), spec)
    assert vocabularies_of(str(tmp_path)) == {"user": ("u9", "u1")}
    assert vocabularies_of(None) is None
