"""Parquet read by index: batch ids, replay and exact resumes.

Most tests read in process (``in_process=True``: the same read and preprocessing functions
without a Ray Data pipeline), in milliseconds; those marked ``cluster`` check on a local Ray
(127.0.0.1) that the Ray Data pipeline yields the very same batches and errors.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import threading
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import ray
from ray import cloudpickle

from raytrec.config import ScalingConfig, TrainConfig
from raytrec.data import parquet_indexed
from raytrec.data.arrow_kjt import BadInputError
from raytrec.data.executor_pace import PacedLoop
from raytrec.data.feed import BatchFeed, DataExhausted
from raytrec.data.generate import write_synthetic_parquet
from raytrec.data.parquet import IndexedParquetShard, ParquetSource
from raytrec.data.parquet_recut import take_over
from raytrec.data.parquet_streams import remaining_rows, stream_length
from raytrec.data.source import Batch
from raytrec.data.spec import FeatureSpec, criteo_spec
from raytrec.data.synthetic import batch_id, split_batch_id
from raytrec.errors import ConfigError
from raytrec.preflight import indexed_resume_shards

ROWS, FILES, GROUPS, VOCAB = 2003, 4, 3, 500
SPEC = criteo_spec(VOCAB)
B = 64


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("indexed")
    write_synthetic_parquet(
        out, rows=ROWS, files=FILES, row_groups_per_file=GROUPS, seed=5, num_embeddings=VOCAB
    )
    return out


def split(
    path: pathlib.Path | str, n: int, *, in_process: bool = True, **kw: Any
) -> list[IndexedParquetShard]:
    """The source's shards, pickled and back (as they travel to the ranks)."""
    source = ParquetSource(paths=str(path), spec=kw.pop("spec", SPEC), read_mode="indexed", **kw)
    shards = []
    for s in source.split(n):
        assert isinstance(s, IndexedParquetShard) and s.replayable
        shards.append(
            cloudpickle.loads(cloudpickle.dumps(dataclasses.replace(s, in_process=in_process)))
        )
    return shards


def as_bytes(b: Batch) -> tuple[Any, ...]:
    kjt = b.sparse_features
    return (
        b.dense_features.numpy().tobytes(),
        b.labels.numpy().tobytes(),
        tuple(kjt.keys()),
        kjt.values().numpy().tobytes(),
        kjt.lengths().numpy().tobytes(),
        kjt.stride(),
    )


def read_all(shard: IndexedParquetShard, start: int = 0) -> list[tuple[int, Any, np.ndarray]]:
    """(id, batch bytes, row ids) of every batch from ``start`` on."""
    out = []
    for i, batch in shard.identified_batches(B, start_step=start):
        assert i is not None and shard.last_row_ids is not None
        out.append((i, as_bytes(batch), shard.last_row_ids.copy()))
    return out


def rewrite(path: pathlib.Path, change: Callable[[pa.Table], pa.Table]) -> None:
    """Rewrites a Parquet file through ``change``, keeping its row groups."""
    meta = pq.ParquetFile(path).metadata
    table = change(pq.read_table(path))
    with pq.ParquetWriter(path, table.schema) as w:
        at = 0
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            w.write_table(table.slice(at, n), row_group_size=n)
            at += n


def with_nan(table: pa.Table, rows: list[int], column: str = "dense_4") -> pa.Table:
    values = table.column(column).to_numpy().copy()
    values[rows] = math.nan
    return table.set_column(table.schema.get_field_index(column), column, pa.array(values))


def copy_data(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    dst.mkdir()
    for f in sorted(src.glob("*.parquet")):
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def where(shard: IndexedParquetShard, file: str, file_row: int) -> tuple[int, int, int]:
    """(rank, step, row group) of the batch holding row ``file_row`` of ``file`` in epoch 0."""
    plan = shard.plan(B)
    for rank in range(shard.num_shards):
        for p in plan.pieces(rank, 0, plan.steps_per_epoch):
            if p.path.endswith(file) and p.file_row <= file_row < p.file_row + p.rows:
                at = p.file_row
                for k, count in enumerate(p.counts):
                    if file_row < at + count:
                        return rank, p.step + k, p.row_group
                    at += count
    raise AssertionError("row not found")


# -- ids, epochs, replay, resume (in process) ----------------------------------------------------


def test_every_row_once_per_epoch_with_unique_ids(data_dir: pathlib.Path) -> None:
    shards = split(data_dir, 3, epochs=2, shuffle_seed=4)
    plan = shards[0].plan(B)
    m = plan.steps_per_epoch
    assert m == math.ceil(math.ceil(ROWS / 3) / B)
    seen = [read_all(s) for s in shards]
    for rank, batches in enumerate(seen):
        # Every rank the same number of steps; ids are (rank, step), so unique in the job.
        assert [i for i, _, _ in batches] == [batch_id(rank, s) for s in range(2 * m)]
        assert all(len(ids) == plan.batch_size_of(rank, s) for s, (_, _, ids) in enumerate(batches))
    for epoch in range(2):
        ids = np.concatenate([b[2] for rank in seen for b in rank[epoch * m : (epoch + 1) * m]])
        assert (np.sort(ids) == np.arange(ROWS)).all()
        logs = [s.consumed()[epoch] for s in shards]
        assert all(c.epoch == epoch and c.complete and c.batches == m for c in logs)
        assert sum(c.rows for c in logs) == ROWS and all(c.padding == 0 for c in logs)
    # A shuffled order, drawn again for the second epoch: rank 0 starts elsewhere.
    assert seen[0][0][2][0] != seen[0][m][2][0]


def test_replay_gives_back_each_batch_bitwise_from_any_rank(data_dir: pathlib.Path) -> None:
    shards = split(data_dir, 3, epochs=2, shuffle_seed=4)
    first = {i: data for s in shards for i, data, _ in read_all(s)}
    other = split(data_dir, 3, epochs=2, shuffle_seed=4)[1]  # a fresh copy, as a survivor holds
    for i, data in first.items():
        assert as_bytes(other.replay(i, B)) == data, split_batch_id(i)
    assert other.consumed() == ()  # replays are not this rank's reads
    with pytest.raises(ValueError, match=r"stream 3 is not one of this job's: ranks 0..2"):
        other.replay(batch_id(3, 0), B)
    with pytest.raises(ValueError, match=r"\(stream 0, batch 64\) is not one of this job's"):
        other.replay(batch_id(0, 64), B)


@pytest.mark.parametrize("window", [None, 300])
def test_consecutive_replays_are_read_in_one_pass_bitwise(
    data_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    shards = split(data_dir, 3, epochs=2, shuffle_seed=4, shuffle_window_rows=window)
    first = {i: data for s in shards for i, data, _ in read_all(s)}
    other = split(data_dir, 3, epochs=2, shuffle_seed=4, shuffle_window_rows=window)[1]
    # Out of order, three streams, runs of consecutive steps and a repeated id.
    ids = [batch_id(0, 5), batch_id(0, 3), batch_id(0, 4), batch_id(2, 7), batch_id(1, 0)]
    ids += [batch_id(2, 8), batch_id(0, 4)]
    reads: list[object] = []
    real = parquet_indexed.read

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(parquet_indexed, "read", counted)
    assert [as_bytes(b) for b in other.replay_many(ids, B)] == [first[i] for i in ids]
    together, reads[:] = len(reads), []
    for i in ids:
        other.replay(i, B)
    assert together < len(reads), (together, len(reads))
    assert other.consumed() == ()
    with pytest.raises(ValueError, match=r"\(stream 0, batch 64\) is not one of this job's"):
        other.replay_many([batch_id(0, 62), batch_id(0, 63), batch_id(0, 64)], B)


def test_a_shuffle_window_mixes_rows_and_replays_and_resumes_bitwise(
    data_dir: pathlib.Path,
) -> None:
    # 12 row groups of ~167 rows; windows of 500 rows mix three or four of them.
    shards = split(data_dir, 3, epochs=2, shuffle_seed=4, shuffle_window_rows=500)
    plain = split(data_dir, 3, epochs=2, shuffle_seed=4)
    m = shards[0].plan(B).steps_per_epoch
    seen = [read_all(s) for s in shards]
    for epoch in range(2):  # every row once per epoch
        ids = np.concatenate([b[2] for rank in seen for b in rank[epoch * m : (epoch + 1) * m]])
        assert (np.sort(ids) == np.arange(ROWS)).all()
    first = seen[0][0][2]  # row ids are row numbers: a batch's ids show where its rows came from
    assert (np.diff(first) != 1).any()  # not a run of consecutive rows
    assert len({int(i) // 167 for i in first}) >= 3  # rows of several row groups
    assert sorted(first.tolist()) != sorted(read_all(plain[0])[0][2].tolist())
    # Replays (any rank's batch, from a fresh copy) and a resume read exactly the same batches.
    other = split(data_dir, 3, epochs=2, shuffle_seed=4, shuffle_window_rows=500)[2]
    for i, data, _ in [b for rank in seen for b in rank][::7]:
        assert as_bytes(other.replay(i, B)) == data, split_batch_id(i)
    (later,) = split(data_dir, 3, epochs=2, shuffle_seed=4, shuffle_window_rows=500)[1:2]
    resumed = read_all(later, m - 1)
    assert [(i, d) for i, d, _ in resumed] == [(i, d) for i, d, _ in seen[1][m - 1 :]]


@pytest.mark.parametrize("start", [1, 31, 32, 33, 63, 64])
def test_start_step_continues_on_the_same_rows(data_dir: pathlib.Path, start: int) -> None:
    (shard,) = split(data_dir, 1, epochs=2, shuffle_seed=8)
    m = shard.plan(B).steps_per_epoch
    assert m == 32  # ceil(2003 / 64): starts on both sides of the epoch boundary
    full = read_all(shard)
    (later,) = split(data_dir, 1, epochs=2, shuffle_seed=8)
    resumed = read_all(later, start)
    assert [(i, d) for i, d, _ in resumed] == [(i, d) for i, d, _ in full[start:]]
    assert [c.epoch for c in later.consumed()] == sorted({s // m for s in range(start, 2 * m)})


def test_a_stream_past_its_end_is_empty_and_arguments_are_checked(data_dir: pathlib.Path) -> None:
    (shard,) = split(data_dir, 1)
    assert list(shard.batches(B, start_step=shard.plan(B).num_steps + 5)) == []
    with pytest.raises(ValueError, match="batch_size"):
        shard.batches(0)
    with pytest.raises(ValueError, match="start_step"):
        shard.batches(B, start_step=-1)
    with pytest.raises(ValueError, match="read_mode must be 'indexed' or 'streaming'"):
        ParquetSource(paths=str(data_dir), spec=SPEC, read_mode="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fewer than the 3000 ranks"):
        split(data_dir, 3000)


def test_values_row_for_row_through_an_explicit_filesystem(data_dir: pathlib.Path) -> None:
    fs = pafs.SubTreeFileSystem(str(data_dir), pafs.LocalFileSystem())
    names = [p.name for p in sorted(data_dir.glob("*.parquet"))[:2]]
    source = ParquetSource(paths=[names[0], f"/{names[1]}"], spec=SPEC, filesystem=fs)
    assert source.read_mode == "indexed"  # the default
    (shard,) = source.split(1)
    assert isinstance(shard, IndexedParquetShard)
    batches = list(dataclasses.replace(shard, in_process=True).batches(300))
    tables = [pq.read_table(data_dir / n) for n in names]
    assert sum(b.labels.shape[0] for b in batches) == sum(t.num_rows for t in tables)
    # Unshuffled: the first file's rows, in order, with their values.
    b = batches[0]
    first = tables[0].slice(0, b.labels.shape[0])
    assert np.array_equal(b.labels.numpy(), first.column("label").to_numpy())
    assert np.array_equal(b.dense_features[:, 4].numpy(), first.column("dense_4").to_numpy())
    cat = b.sparse_features["cat_2"]
    assert cat.lengths().tolist() == pa.compute.list_value_length(first["cat_2"]).to_pylist()
    assert cat.values().tolist() == pa.compute.list_flatten(first["cat_2"]).to_pylist()


def test_a_resume_is_planned_on_the_saved_job_s_split(
    data_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import raytrec.checkpoint.layout as layout

    # A checkpoint of a 3-rank job that lost rank 1: shards 0 and 2 live, 1 retired.
    streams = {"live": [[0, 5, []], [2, 5, [batch_id(1, 4)]]], "retired": [[1, 4]]}
    accounting: dict[str, Any] = {"streams": streams}
    manifest = types.SimpleNamespace(extra={"step": 5, "accounting": accounting})
    monkeypatch.setattr(layout, "read_manifest", lambda uri: manifest)
    source = ParquetSource(paths=str(data_dir), spec=SPEC)
    three = TrainConfig(scaling=ScalingConfig(num_workers=3, gang_size=1))
    four = TrainConfig(scaling=ScalingConfig(num_workers=4, gang_size=2))
    # Saved with its table of re-shared streams: any number of ranks, on the saved split.
    accounting["streams_table"] = {"num_shards": 3, "next_id": 3, "made": {}}
    assert indexed_resume_shards("ckpt", four, source) == 3
    # Saved without one: only on the number of ranks the data was split for.
    del accounting["streams_table"]
    assert indexed_resume_shards("ckpt", three, source) == 3
    pattern = r"ckpt was trained on Parquet read by index in 3 shards.*num_workers=3 \(not 4\)"
    with pytest.raises(ConfigError, match=pattern):
        indexed_resume_shards("ckpt", four, source)
    # Streamed Parquet restarts at the checkpoint's step on any number of ranks.
    assert (
        indexed_resume_shards("ckpt", four, dataclasses.replace(source, read_mode="streaming"))
        is None
    )


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("row_id", ["row_id", None])
def test_bad_input_in_a_replayed_batch_names_file_column_and_row(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, row_id: str | None
) -> None:
    root = copy_data(data_dir, tmp_path / "bad")
    target = sorted(root.glob("*.parquet"))[2]
    groups = [pq.ParquetFile(target).metadata.row_group(g).num_rows for g in range(GROUPS)]
    bad_row = groups[0] + 17  # in the second row group
    rewrite(target, lambda t: with_nan(t, [bad_row]))
    row_id_value = int(pq.read_table(target).column("row_id")[bad_row].as_py())
    spec: FeatureSpec = dataclasses.replace(SPEC, row_id=row_id)
    shards = split(root, 2, spec=spec)
    rank, step, group = where(shards[0], target.name, bad_row)
    assert group == 1
    with pytest.raises(BadInputError) as info:
        shards[0].replay(batch_id(rank, step), B)
    err = info.value
    assert (err.reason, err.column, err.row, err.row_group) == ("nan", "dense_4", bad_row, 1)
    assert err.file is not None and err.file.endswith(target.name)
    named = f"row_id {row_id_value}" if row_id else f"row {bad_row}"
    assert f"in file '{err.file}', column 'dense_4', row group 1, {named}: " in str(err)
    # Reading the stream stops at the same batch with the same error.
    stream = shards[rank].identified_batches(B)
    ids = []
    with pytest.raises(BadInputError) as again:
        for i, _ in stream:
            ids.append(i)
    assert str(again.value) == str(err)
    assert ids == [batch_id(rank, s) for s in range(step)]


def test_skipped_rows_replay_alike_and_a_batch_of_only_bad_rows_stops(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    root = copy_data(data_dir, tmp_path / "skip")
    files = sorted(root.glob("*.parquet"))
    rewrite(files[0], lambda t: with_nan(t, [3, 40]))
    shards = split(root, 2, on_bad_rows="skip")
    batches = {i: (data, ids) for s in shards for i, data, ids in read_all(s)}
    skipped = sum(c.skipped.get("nan", 0) for s in shards for c in s.consumed())
    assert skipped == 2
    bad_ids = {int(v) for v in pq.read_table(files[0]).column("row_id").to_numpy()[[3, 40]]}
    kept = np.concatenate([ids for _, ids in batches.values()])
    assert len(kept) == ROWS - 2 and not bad_ids & set(kept.tolist())
    rank, step, _ = where(shards[0], files[0].name, 40)
    assert as_bytes(shards[1].replay(batch_id(rank, step), B)) == batches[batch_id(rank, step)][0]

    # Every row of one batch bad: that step cannot train, and says which rows it had.
    plan = shards[0].plan(B)
    (piece,) = plan.pieces(0, 1, 2)
    assert piece.path.endswith(files[0].name)
    rewrite(
        files[0], lambda t: with_nan(t, list(range(piece.file_row, piece.file_row + piece.rows)))
    )
    (fresh, _) = split(root, 2, on_bad_rows="skip")
    pattern = (
        rf"\(no_rows_left\).*batch 1 of stream 0 has no rows left: all {piece.rows} were skipped"
    )
    with pytest.raises(BadInputError, match=pattern):
        list(fresh.batches(B))
    with pytest.raises(BadInputError, match=pattern):
        fresh.replay(batch_id(0, 1), B)


# -- through Ray Data ------------------------------------------------------------------------------


@pytest.mark.cluster
def test_ray_data_reads_the_same_batches_as_in_process(
    local_ray: None, data_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = []  # the pipelines' scheduling loop steps, each seen by the pacing callback
    paced = PacedLoop.on_execution_step
    monkeypatch.setattr(PacedLoop, "on_execution_step", lambda s, e: (steps.append(e), paced(s, e)))
    local = split(data_dir, 2, epochs=2, shuffle_seed=3)
    remote = split(data_dir, 2, epochs=2, shuffle_seed=3, in_process=False, read_concurrency=2)
    for a, b in zip(local, remote, strict=True):
        expected = read_all(a)
        assert [(i, d) for i, d, _ in read_all(b)] == [(i, d) for i, d, _ in expected]
        assert [(i, d) for i, d, _ in read_all(b, 7)] == [(i, d) for i, d, _ in expected[7:]]
        assert [c.rows for c in a.consumed()] == [c.rows for c in b.consumed()[:2]]
    # The pipeline's settings (order kept, original errors, a paced loop) stay with its own
    # dataset.
    ctx = ray.data.DataContext.get_current()
    assert not ctx.raise_original_map_exception and not ctx.execution_options.preserve_order
    assert steps and PacedLoop not in ctx.custom_execution_callback_classes


@pytest.mark.cluster
def test_a_survivor_reads_on_into_rows_taken_over_through_a_pipeline_started_ahead(
    local_ray: None, data_dir: pathlib.Path
) -> None:
    """Rank 2 of 3 is lost 5 batches into a 2-epoch job: the survivors read on to the end of
    their first epoch's part with the pipeline they have, and the rows after it (their second
    epoch and the lost rank's rows of both) come from a pipeline started at the loss. The
    batches are those of the longer stream read in process from the survivor's position."""
    remote = split(data_dir, 3, epochs=2, shuffle_seed=3, in_process=False, read_concurrency=2)
    at = 5
    orphaned = remaining_rows(remote[2].stream(B), at)
    plan = take_over([(s.stream(B), at, 0) for s in remote[:2]], orphaned, batch_size=B)
    assert plan is not None and plan.keep[0] < stream_length(plan.streams[0])  # epoch 2 after
    longer = remote[0].with_stream(0, {0: plan.streams[0]})
    expected = read_all(dataclasses.replace(longer, in_process=True), at)

    def before_keep(item: tuple[int | None, Batch]) -> bool:
        return item[0] is not None and split_batch_id(item[0])[1] < plan.keep[0]

    feed = BatchFeed(remote[0].identified_batches(B, start_step=at), prefetch=2)
    feed.prepare(3, timeout_s=120)
    feed.continue_with(
        before_keep, lambda: longer.identified_batches(B, start_step=plan.keep[0], ahead=True)
    )
    feed.prepare(len(expected), timeout_s=120)
    got = [feed.take() for _ in expected]
    assert [(i, as_bytes(b)) for i, b in got] == [(i, d) for i, d, _ in expected]
    with pytest.raises(DataExhausted):
        feed.prepare(1, timeout_s=120)
    feed.close()
    # Both pipelines are shut down: the one closed at the point and the one read to its end.
    for thread in threading.enumerate():
        if thread.name == "raytrec-pipeline-start":
            thread.join(timeout=60)
            assert not thread.is_alive()


@pytest.mark.cluster
def test_bad_input_through_ray_data_reaches_the_rank_as_itself(
    local_ray: None, data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    root = copy_data(data_dir, tmp_path / "bad")
    target = sorted(root.glob("*.parquet"))[1]
    rewrite(target, lambda t: with_nan(t, [70]))
    (shard,) = split(root, 1, in_process=False)
    with pytest.raises(BadInputError) as info:
        list(shard.batches(B))
    err = info.value
    assert type(err) is BadInputError, repr(err)
    assert (err.reason, err.column, err.row) == ("nan", "dense_4", 70)
    assert err.file is not None and err.file.endswith(target.name)
