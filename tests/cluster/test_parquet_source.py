"""Synthetic Parquet generation and ParquetSource on a local Ray cluster (127.0.0.1), read with
``read_mode="streaming"`` (the indexed mode: tests/cluster/test_parquet_indexed.py): every row
exactly once per epoch across ranks, bad inputs named by file, column and row, skip mode."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import ray
import torch
from ray import cloudpickle
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from jobs.make_data import main as make_data
from raytrec.data.arrow_kjt import BadInputError
from raytrec.data.generate import auc, write_synthetic_parquet
from raytrec.data.parquet import EpochConsumption, ParquetShard, ParquetSource
from raytrec.data.preprocess import preprocess
from raytrec.data.source import Batch
from raytrec.data.spec import SparseFeature, criteo_spec

pytestmark = pytest.mark.cluster

ROWS, FILES, GROUPS, VOCAB = 6003, 8, 2, 1000  # 6003 = 4 * 1500 + 3: needs one padding row
SPEC = criteo_spec(VOCAB)
TIMEOUT_S = 120
STREAM = "streaming"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("criteo")
    write_synthetic_parquet(
        out, rows=ROWS, files=FILES, row_groups_per_file=GROUPS, seed=3, num_embeddings=VOCAB
    )
    return out


def consume(shards: list[ParquetShard], batch_size: int) -> list[Any]:
    """Drains all shards at once (streaming_split needs every split read concurrently), one
    thread each; returns per shard its (epoch, row ids, batch) list, or the exception it hit."""
    results: list[Any] = [None] * len(shards)

    def run(rank: int) -> None:
        shard = shards[rank]
        seen: list[tuple[int, np.ndarray, Batch]] = []
        try:
            for batch in shard.batches(batch_size):
                assert shard.last_row_ids is not None
                seen.append((shard.current_epoch, shard.last_row_ids, batch))
            results[rank] = seen
        except Exception as e:
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
        assert not t.is_alive(), "a shard did not finish in time"
    return results


def first_error(results: list[Any]) -> BaseException:
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors, "expected a failure"
    return errors[0]


def expand(ranges: tuple[tuple[int, int], ...] | None) -> np.ndarray:
    assert ranges is not None
    return np.concatenate([np.arange(a, b) for a, b in ranges] or [np.zeros(0, np.int64)])


# -- generator -------------------------------------------------------------------------------


def test_generator_layout_ids_and_oracle(data_dir: pathlib.Path) -> None:
    files = sorted(data_dir.glob("*.parquet"))
    assert len(files) == FILES
    metas = [pq.ParquetFile(f).metadata for f in files]
    assert all(m.num_row_groups == GROUPS for m in metas)
    assert sum(m.num_rows for m in metas) == ROWS
    assert all(m.row_group(g).num_rows > 0 for m in metas for g in range(GROUPS))
    table = pq.read_table(files)
    schema = table.schema
    assert all(schema.field(f"dense_{j}").type == pa.float32() for j in range(13))
    assert all(schema.field(f"cat_{k}").type == pa.list_(pa.int64()) for k in range(26))
    assert schema.field("label").type == pa.float32()
    assert schema.field("row_id").type == pa.int64()
    assert (table.column("row_id").to_numpy() == np.arange(ROWS)).all()  # file order
    lengths = pa.compute.list_value_length(table.column("cat_0")).to_numpy()
    assert lengths.min() == 0 and lengths.max() > 1  # variable length, empty lists included
    ids = pa.compute.list_flatten(table.column("cat_7")).to_numpy()
    assert ids.min() >= 0 and ids.max() < VOCAB
    prob = table.column("click_prob").to_numpy()
    label = table.column("label").to_numpy()
    assert ((prob > 0) & (prob < 1)).all() and set(np.unique(label)) == {0.0, 1.0}
    # AUC recomputed another way: for each positive, the negatives scored lower (ties: half).
    neg = np.sort(prob[label == 0])
    pos = prob[label == 1]
    lower = np.searchsorted(neg, pos, side="left")
    ties = np.searchsorted(neg, pos, side="right") - lower
    expected = float((lower + 0.5 * ties).sum() / (len(pos) * len(neg)))
    meta = json.loads((data_dir / "_meta.json").read_text())
    assert meta["rows"] == ROWS and meta["oracle_auc"] == pytest.approx(expected, abs=1e-12)
    assert auc(prob, label) == pytest.approx(expected, abs=1e-12)
    assert 0.7 < expected < 0.95


def test_generator_cli_and_argument_checks(tmp_path: pathlib.Path) -> None:
    argv = ["--out", str(tmp_path), "--rows", "50", "--files", "2", "--row-groups-per-file", "5"]
    assert make_data([*argv, "--seed", "1", "--num-embeddings", "20"]) == 0
    metas = [pq.ParquetFile(f).metadata for f in sorted(tmp_path.glob("*.parquet"))]
    assert [(m.num_rows, m.num_row_groups) for m in metas] == [(25, 5), (25, 5)]
    assert make_data(["--out", str(tmp_path / "tiny"), "--rows", "2", "--files", "2"]) == 0
    assert json.loads((tmp_path / "tiny" / "_meta.json").read_text())["oracle_auc"] is None
    with pytest.raises(ValueError, match="cannot fill"):
        write_synthetic_parquet(tmp_path, rows=5, files=2, row_groups_per_file=3)


# -- exactly once --------------------------------------------------------------------------------


def test_every_row_exactly_once_per_epoch_across_ranks(
    local_ray: None, data_dir: pathlib.Path
) -> None:
    source = ParquetSource(
        paths=str(data_dir), spec=SPEC, epochs=2, shuffle_seed=11, read_mode=STREAM
    )
    shards = source.split(4)
    assert [s.rows_per_epoch for s in shards] == [1501] * 4  # (6003 + 1 padding row) / 4
    # Shards travel pickled, as to the rank actors; all are drained at once.
    shards = [cloudpickle.loads(cloudpickle.dumps(s)) for s in shards]
    seen = consume(shards, 256)
    assert not any(isinstance(r, BaseException) for r in seen), seen
    for epoch in range(2):
        # The row ids of the batches yielded, over all ranks: each row once.
        ids = np.concatenate([ids for rank in seen for e, ids, _ in rank if e == epoch])
        assert (np.sort(ids) == np.arange(ROWS)).all()
        # The shards' own logs say the same.
        logs: list[EpochConsumption] = [s.consumed()[epoch] for s in shards]
        assert all(c.epoch == epoch and c.complete for c in logs)
        logged = np.concatenate([expand(c.row_ids) for c in logs])
        assert (np.sort(logged) == np.arange(ROWS)).all()
        assert sum(c.rows for c in logs) == ROWS and sum(c.padding for c in logs) == 1
        assert all(c.rows + c.padding == 1501 and c.skipped == {} for c in logs)
        # Same number of batches on every rank (the padding row does not empty a batch here).
        assert {c.batches for c in logs} == {math.ceil(1501 / 256)}
    # The seeded file shuffle is reseeded per epoch: ranks see other rows, in another order.
    orders = [
        [[int(ids[0]) for e, ids, _ in rank if e == epoch] for epoch in (0, 1)] for rank in seen
    ]
    assert all(len(first) == len(second) == 6 for first, second in orders)
    assert any(first != second for first, second in orders)


# -- bad inputs ----------------------------------------------------------------------------------


def small_table(data_dir: pathlib.Path, rows: int = 200) -> pa.Table:
    return pq.read_table(sorted(data_dir.glob("*.parquet"))[0]).slice(0, rows)


def set_value(table: pa.Table, column: str, row: int, value: Any) -> pa.Table:
    """``table`` with ``column`` at ``row`` set: a float, or the first id of a list."""
    i = table.schema.get_field_index(column)
    col = table.column(column).combine_chunks()
    if pa.types.is_list(col.type):
        offsets = col.offsets.to_numpy()
        ids = col.values.to_numpy().copy()
        mask = np.zeros(len(ids), dtype=bool)
        if value is None:
            mask[offsets[row]] = True
        else:
            ids[offsets[row]] = value
        new = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids, mask=mask))
    else:
        values = col.to_numpy().copy()
        values[row] = value
        new = pa.array(values, col.type)
    return table.set_column(i, column, new)


def non_empty_row(table: pa.Table, column: str, start: int) -> int:
    lengths = pa.compute.list_value_length(table.column(column)).to_numpy()
    return start + int(np.argmax(lengths[start:] > 0))


def bad_dir(root: pathlib.Path, data_dir: pathlib.Path, write_bad: Callable[[str], None]) -> str:
    """A directory with one good file (rows of another file) and ``bad.parquet``, written by
    ``write_bad``."""
    root.mkdir()
    good = pq.read_table(sorted(data_dir.glob("*.parquet"))[1]).slice(0, 100)
    pq.write_table(good, root / "a_good.parquet")
    write_bad(str(root / "bad.parquet"))
    return str(root)


STRICT = dataclasses.replace(
    SPEC,
    sparse=tuple(
        dataclasses.replace(f, id_policy="strict") if f.name == "cat_9" else f
        for f in SPEC.sparse
        if isinstance(f, SparseFeature)
    ),
)


BAD_VALUES = {  # reason -> (column, value, spec)
    "nan": ("dense_4", math.nan, SPEC),
    "inf": ("dense_7", -math.inf, SPEC),
    "negative_id": ("cat_3", -5, SPEC),
    "id_out_of_range": ("cat_9", VOCAB, STRICT),
}


def with_bad_value(table: pa.Table, reason: str) -> tuple[pa.Table, int]:
    """``table`` with the bad value of ``reason`` in one row; returns it and that row's row_id."""
    column, value, _ = BAD_VALUES[reason]
    row = non_empty_row(table, column, 37) if column.startswith("cat") else 37
    return set_value(table, column, row, value), int(table.column("row_id")[row].as_py())


def error_pattern(reason: str, row_id: int) -> str:
    column = BAD_VALUES[reason][0]
    return rf"\({reason}\) in file '.*bad\.parquet', column '{column}', row_id {row_id}: "


@pytest.mark.parametrize("reason", list(BAD_VALUES))
def test_pipeline_stage_names_file_column_and_row_id(data_dir: pathlib.Path, reason: str) -> None:
    # The map_batches stage on its own: a block of rows from two files, as Ray Data reads it.
    table, row_id = with_bad_value(small_table(data_dir), reason)
    files = ["/d/a_good.parquet"] * 30 + ["/d/bad.parquet"] * (table.num_rows - 30)
    block = table.append_column("path", pa.array(files))
    spec = BAD_VALUES[reason][2]
    with pytest.raises(BadInputError, match=error_pattern(reason, row_id)) as info:
        preprocess(block, spec=spec, on_bad_rows="error")
    err = info.value
    assert (err.reason, err.file, err.column, err.row_id) == (
        reason,
        "/d/bad.parquet",
        BAD_VALUES[reason][0],
        row_id,
    )
    out = preprocess(block, spec=spec, on_bad_rows="skip")  # a marked row, not a missing one
    assert out.num_rows == block.num_rows
    assert out.column("__rt_drop").drop_null().to_pylist() == [reason]
    assert preprocess(block.slice(0, 0), spec=spec, on_bad_rows="error").num_rows == 0
    # Without a row-id column the row is named by its index in the block.
    row = int(np.flatnonzero(table.column("row_id").to_numpy() == row_id)[0])
    column = BAD_VALUES[reason][0]
    pattern = rf"\({reason}\) in file '/d/bad\.parquet', column '{column}', row {row}: "
    with pytest.raises(BadInputError, match=pattern):
        preprocess(block, spec=dataclasses.replace(spec, row_id=None), on_bad_rows="error")


@pytest.mark.parametrize("reason", ["nan", "id_out_of_range"])
def test_bad_value_reaches_the_rank_named_by_file_column_and_row_id(
    local_ray: None,
    data_dir: pathlib.Path,
    tmp_path: pathlib.Path,
    reason: str,
) -> None:
    table, row_id = with_bad_value(small_table(data_dir), reason)
    root = bad_dir(tmp_path / "d", data_dir, lambda p: pq.write_table(table, p))
    shards = ParquetSource(paths=root, spec=BAD_VALUES[reason][2], read_mode=STREAM).split(2)
    err = first_error(consume(shards, 64))
    # The rank gets the pipeline's BadInputError itself, not the Ray wrappers around it.
    assert type(err) is BadInputError, repr(err)
    assert (err.reason, err.row_id, err.column) == (reason, row_id, BAD_VALUES[reason][0])
    assert err.file is not None and err.file.endswith("bad.parquet")
    with pytest.raises(BadInputError, match=error_pattern(reason, row_id)):
        raise err


def write_bytes(data: bytes) -> Callable[[str], None]:
    return lambda path: pathlib.Path(path).write_bytes(data)


@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        ("missing", r"\(missing_column\) in file '.*bad\.parquet', column 'cat_5': no such col"),
        ("wrong_type", r"\(wrong_type\) in file '.*bad\.parquet', column 'dense_2': .*got string"),
        ("empty", r"\(empty_file\) in file '.*bad\.parquet': empty file"),
        ("corrupt", r"\(corrupt_file\) in file '.*bad\.parquet': not a readable Parquet file"),
    ],
)
def test_bad_file_fails_on_the_driver(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, case: str, pattern: str
) -> None:
    table = small_table(data_dir)
    writers: dict[str, Callable[[str], None]] = {
        "missing": lambda p: pq.write_table(table.drop_columns(["cat_5"]), p),
        "wrong_type": lambda p: pq.write_table(
            table.set_column(2, "dense_2", table.column("dense_2").cast(pa.string())), p
        ),
        "empty": lambda p: pq.write_table(table.slice(0, 0), p),
        "corrupt": write_bytes(b"PAR1 this is not parquet " * 20),
    }
    source = ParquetSource(paths=bad_dir(tmp_path / "d", data_dir, writers[case]), spec=SPEC)
    # No cluster needed: split() checks every footer before it builds the pipeline.
    with pytest.raises(BadInputError, match=pattern):
        source.split(2)


def test_paths_that_name_nothing(tmp_path: pathlib.Path) -> None:
    with pytest.raises(BadInputError, match=r"\(missing_file\) in file '.*nope'"):
        ParquetSource(paths=str(tmp_path / "nope"), spec=SPEC).split(1)
    (tmp_path / "_meta.json").write_text("{}")
    with pytest.raises(BadInputError, match=r"\(no_files\).*no \.parquet files"):
        ParquetSource(paths=str(tmp_path), spec=SPEC).split(1)
    with pytest.raises(ValueError, match="epochs"):
        ParquetSource(paths=str(tmp_path), spec=SPEC, epochs=0)


# -- skip mode -----------------------------------------------------------------------------------


def test_skip_mode_counts_by_reason_and_trains_on_the_rest(
    local_ray: None, data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    files = sorted(data_dir.glob("*.parquet"))[:2]
    tables = [pq.read_table(f) for f in files]
    bad = {  # reason -> (file, column, row, value)
        "nan": (0, "dense_0", 5, math.nan),
        "inf": (1, "label", 9, math.inf),
        "negative_id": (0, "cat_1", non_empty_row(tables[0], "cat_1", 50), -3),
        "id_out_of_range": (1, "cat_9", non_empty_row(tables[1], "cat_9", 70), VOCAB + 5),
        "null_id": (1, "cat_4", non_empty_row(tables[1], "cat_4", 90), None),
    }
    bad_ids = []
    for i, column, row, value in bad.values():
        bad_ids.append(int(tables[i].column("row_id")[row].as_py()))
        tables[i] = set_value(tables[i], column, row, value)
    (tmp_path / "skip").mkdir()
    for f, t in zip(files, tables, strict=True):
        pq.write_table(t, tmp_path / "skip" / f.name)
    rows = sum(t.num_rows for t in tables)

    source = ParquetSource(
        paths=str(tmp_path / "skip"), spec=STRICT, on_bad_rows="skip", read_mode=STREAM
    )
    shards = source.split(2)
    results = consume(shards, 128)
    assert not any(isinstance(r, BaseException) for r in results), results
    logs = [s.consumed()[0] for s in shards]
    skipped: dict[str, int] = {}
    for log in logs:
        for reason, n in log.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + n
    assert skipped == dict.fromkeys(bad, 1)
    assert sorted(np.concatenate([expand(c.skipped_row_ids) for c in logs])) == sorted(bad_ids)
    kept = np.concatenate([expand(c.row_ids) for c in logs])
    assert len(kept) == rows - len(bad) and not set(kept.tolist()) & set(bad_ids)
    assert len(np.unique(kept)) == len(kept)

    # The rest trains: a tiny model over the kept batches, its loss finite and falling.
    batches = [b for seen in results for _, _, b in seen]
    assert sum(b.labels.shape[0] for b in batches) == rows - len(bad)
    assert all(bool(torch.isfinite(b.dense_features).all()) for b in batches)
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=f"t_{name}", embedding_dim=4, num_embeddings=VOCAB, feature_names=[name]
            )
            for name in STRICT.sparse_names
        ]
    )
    head = torch.nn.Linear(13 + 4 * 26, 1)
    opt = torch.optim.Adagrad([*ebc.parameters(), *head.parameters()], lr=0.1)
    losses = []
    for b in batches * 2:
        emb = ebc(b.sparse_features).values()
        logits = head(torch.cat([b.dense_features, emb], dim=1)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert np.mean(losses[-5:]) < np.mean(losses[:5])


# -- filesystems ---------------------------------------------------------------------------------


def test_explicit_filesystem_and_well_formed_batches(
    local_ray: None, data_dir: pathlib.Path
) -> None:
    fs = pafs.SubTreeFileSystem(str(data_dir), pafs.LocalFileSystem())
    names = [p.name for p in sorted(data_dir.glob("*.parquet"))[2:4]]
    source = ParquetSource(
        paths=[names[0], f"/{names[1]}"], spec=SPEC, filesystem=fs, read_mode=STREAM
    )
    assert [i.row_groups for i in source.inspect()] == [GROUPS] * 2
    assert len(ParquetSource(paths="/", spec=SPEC, filesystem=fs).list_files()[1]) == FILES
    (shard,) = source.split(1)
    # The pipeline's own settings stay with it.
    assert not ray.data.DataContext.get_current().raise_original_map_exception
    with pytest.raises(ValueError, match="batch_size"):
        shard.batches(0)
    stream = shard.batches(300)
    batches = list(stream)
    with pytest.raises(StopIteration):  # one epoch, then the stream ends
        next(stream)
    tables = [pq.read_table(data_dir / n) for n in names]
    rows = sum(t.num_rows for t in tables)
    assert [b.labels.shape[0] for b in batches] == [300] * (rows // 300) + [rows % 300]
    b = batches[0]
    assert b.dense_features.shape == (300, 13) and b.dense_features.dtype == torch.float32
    assert b.sparse_features.keys() == list(SPEC.sparse_names)
    assert int(b.sparse_features.values().max()) < VOCAB
    # Row for row the values of the file (no shuffle: one file after the other, in order).
    first = tables[0].slice(0, 300)
    assert np.array_equal(b.dense_features[:, 4].numpy(), first.column("dense_4").to_numpy())
    assert np.array_equal(b.labels.numpy(), first.column("label").to_numpy())
    cat = b.sparse_features["cat_2"]
    assert cat.lengths().tolist() == pa.compute.list_value_length(first["cat_2"]).to_pylist()
    assert cat.values().tolist() == pa.compute.list_flatten(first["cat_2"]).to_pylist()
    (log,) = shard.consumed()
    expected = sorted(np.concatenate([t.column("row_id").to_numpy() for t in tables]).tolist())
    assert log.complete and log.rows == rows and expand(log.row_ids).tolist() == expected
