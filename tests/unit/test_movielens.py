"""MovieLens-100k to Parquet splits (raytrec.data.movielens, jobs.movielens): the files are read
as RecBole writes them, the label is rating >= 4, the split is a seeded 80/10/10 cut of every
row, ids and side features are strings. The real data comes from RecBole's wheel (pinned in
requirements/dev.lock) or $RAYTREC_ML100K_DIR; the tests that need it skip where neither is
there."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs import movielens as job
from raytrec.data.movielens import (
    FEATURES,
    SPLITS,
    find_ml100k,
    read_ml100k,
    split_indices,
    write_ml100k_splits,
)

INTER = """user_id:token\titem_id:token\trating:float\ttimestamp:float
196\t242\t3\t881250949
186\t302\t4\t891717742
196\t302\t5\t881250950
22\t242\t1\t878887116
"""
USER = """user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token
22\t25\tM\twriter\t40206
186\t39\tF\texecutive\t00000
196\t49\tM\twriter\tT8H1N
"""
ITEM = """item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq
242\tKolya\t1996\tComedy
302\tL.A. Confidential\t\tCrime Film-Noir Mystery Thriller
"""


EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "movielens"


def atomic_files(folder: pathlib.Path, inter: str = INTER) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for suffix, text in (("inter", inter), ("user", USER), ("item", ITEM)):
        (folder / f"ml-100k.{suffix}").write_text(text)
    return str(folder)


def test_atomic_files_become_rows_of_string_ids_with_label_rating_at_least_4(
    tmp_path: pathlib.Path,
) -> None:
    table = read_ml100k(atomic_files(tmp_path))
    assert table.column_names == [
        "row_id",
        *FEATURES,
        "rating",
        "timestamp",
        "label",
    ]
    for f in FEATURES:
        kind = table.schema.field(f).type
        assert kind == (pa.list_(pa.string()) if f == "genres" else pa.string()), f
    rows = table.to_pylist()
    assert [r["row_id"] for r in rows] == [0, 1, 2, 3]
    assert [r["rating"] for r in rows] == [3, 4, 5, 1]
    assert [r["label"] for r in rows] == [0, 1, 1, 0]
    assert rows[1] == {
        "row_id": 1,
        "user_id": "186",
        "item_id": "302",
        "age": "39",
        "gender": "F",
        "occupation": "executive",
        "zip_prefix": "000",  # leading zeros kept: ids are text
        "release_year": None,  # unknown in the item file
        "genres": ["Crime", "Film-Noir", "Mystery", "Thriller"],
        "rating": 4,
        "timestamp": 891717742,
        "label": 1,
    }
    assert rows[2]["zip_prefix"] == "T8H" and rows[0]["genres"] == ["Comedy"]


def test_the_split_is_a_seeded_80_10_10_cut_of_every_row() -> None:
    parts = split_indices(1003, seed=7)
    assert [len(p) for p in parts] == [803, 100, 100]  # RecBole's counts: the rest to train
    assert sorted(np.concatenate(parts).tolist()) == list(range(1003))
    again = split_indices(1003, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = split_indices(1003, seed=8)
    assert not np.array_equal(parts[1], other[1])


def test_missing_files_are_named(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ml-100k.inter").write_text(INTER)
    with pytest.raises(FileNotFoundError, match=r"lacks \['ml-100k.user', 'ml-100k.item'\]"):
        find_ml100k(str(tmp_path))
    monkeypatch.setenv("RAYTREC_ML100K_DIR", str(tmp_path))
    assert job.main(["--out", str(tmp_path / "out")]) == 2


def real_data() -> str:
    try:
        return find_ml100k()
    except FileNotFoundError as e:
        pytest.skip(f"{e} (the tests of the real data need RecBole's wheel)")


def test_a_slice_of_the_real_data_writes_deterministic_splits(tmp_path: pathlib.Path) -> None:
    source = pathlib.Path(real_data())
    with open(source / "ml-100k.inter") as f:
        head = "".join(next(f) for _ in range(2001))  # the header and 2,000 ratings
    users, items = (source / f"ml-100k.{s}" for s in ("user", "item"))
    folder = tmp_path / "slice"
    folder.mkdir()
    (folder / "ml-100k.inter").write_text(head)
    for path in (users, items):
        os.symlink(path, folder / path.name)

    first = write_ml100k_splits(str(tmp_path / "a"), source=str(folder), seed=3, files=2)
    assert first.rows == {"train": 1600, "validation": 200, "test": 200}
    tables = {s: pq.read_table(first.paths[s]) for s in SPLITS}
    ids = [set(tables[s]["row_id"].to_pylist()) for s in SPLITS]
    assert set().union(*ids) == set(range(2000)) and sum(map(len, ids)) == 2000
    assert job.main(["--out", str(tmp_path / "b"), "--source", str(folder), "--seed", "3"]) == 0
    for s in SPLITS:
        # The same seed writes the same rows in the same order, the job's command line too.
        assert pq.read_table(os.path.join(tmp_path, "b", s)).equals(tables[s])
        rows = tables[s]
        labels = (rows["rating"].to_numpy() >= 4).astype(np.int8)
        assert np.array_equal(rows["label"].to_numpy(), labels)
        assert rows.schema.field("user_id").type == pa.string()
    # Ratings keep their users and movies: the first rating of the file is user 196 on movie 242.
    train = tables["train"].to_pylist() + tables["validation"].to_pylist()
    first_row = [r for r in train + tables["test"].to_pylist() if r["row_id"] == 0]
    assert first_row[0]["user_id"] == "196" and first_row[0]["item_id"] == "242"
    assert first_row[0]["genres"] == ["Comedy"] and first_row[0]["release_year"] == "1996"


def test_the_example_config_has_a_table_row_for_every_value_of_the_data() -> None:
    """examples/movielens/deepfm.yaml loads, and each table holds every value of its feature in
    the user and movie files (vocabulary ids 1..N) plus row 0 for values never trained on."""
    from raytrec.config.file import load_config
    from raytrec.data.movielens import _atomic

    config = load_config(os.path.join(EXAMPLE, "deepfm.yaml"))
    assert config.model.arch == "deepfm" and config.data.columns.dense == ()
    assert set(config.data.columns.categorical) == set(config.model.features)
    source = pathlib.Path(real_data())
    user, item = (_atomic(str(source / f"ml-100k.{s}")) for s in ("user", "item"))
    genres = {g for row in item["class"].to_pylist() for g in (row or "").split()}
    values = {
        "user_id": set(user["user_id"].to_pylist()),
        "item_id": set(item["item_id"].to_pylist()),
        "age": set(user["age"].to_pylist()),
        "gender": set(user["gender"].to_pylist()),
        "occupation": set(user["occupation"].to_pylist()),
        "release_year": set(item["release_year"].to_pylist()) - {None},
        "genres": genres,
    }
    for table in config.model.tables:
        [feature] = table.features
        assert table.num_embeddings == len(values[feature]) + 1, feature
