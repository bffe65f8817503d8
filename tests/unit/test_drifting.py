"""The drifting planted teacher (raytrec.data.drifting): raw large ids, a live population that
turns over at the configured rate, per-id weights that carry the signal, determinism by seed,
and day partitions that today's Parquet reader lists in time order."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pyarrow.parquet as pq
import pytest

from jobs.make_data import main as make_data
from raytrec.data.drifting import DriftingTeacher, day_dir, write_drifting_parquet
from raytrec.data.generate import auc
from raytrec.data.parquet import ParquetSource
from raytrec.data.spec import FeatureSpec, SparseFeature

LIVE, TURNOVER, ROWS = 200, 0.5, 20_000
TEACHER = DriftingTeacher(num_sparse=3, live_ids=LIVE, turnover=TURNOVER, seed=5)


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list[list[set[int]]]]:
    """Five days written at once; per day, per feature, the set of ids its rows carry."""
    out = tmp_path_factory.mktemp("drift")
    write_drifting_parquet(out, teacher=TEACHER, days=5, rows_per_day=ROWS, files_per_day=2)
    sets = []
    for d in range(5):
        table = pq.read_table(out / day_dir("2026-01-01", d))
        sets.append(
            [
                set(table.column(f).combine_chunks().flatten().to_pylist())
                for f in ["cat_0", "cat_1", "cat_2"]
            ]
        )
    return out, sets


def test_ids_are_raw_large_int64(days: tuple[pathlib.Path, list[list[set[int]]]]) -> None:
    out, _ = days
    table = pq.read_table(out / "day=2026-01-02" / "part-00000.parquet")
    ids = table.column("cat_1").combine_chunks().flatten().to_numpy()
    assert str(table.schema.field("cat_1").type) == "list<element: int64>"
    assert ids.dtype == np.int64 and ids.min() >= 0
    # Hashed 63-bit values: essentially none below 2**40, the largest near 2**63.
    assert np.mean(ids < 2**40) < 0.001 and ids.max() > 2**60
    assert set(table.column_names) >= {"label", "row_id", "click_prob", "dense_12"}


def test_the_live_population_turns_over(days: tuple[pathlib.Path, list[list[set[int]]]]) -> None:
    _, sets = days
    for f in range(3):
        overlap = [len(sets[0][f] & sets[d][f]) / len(sets[0][f]) for d in range(5)]
        # Falls day by day; an id lives 1 / turnover = 2 days, so day 0's are gone by day 3.
        assert overlap[0] == 1.0 > overlap[1] > overlap[2] and overlap[3] == overlap[4] == 0.0
        # A day sees at most the ids alive in it: live + turnover * live.
        assert all(len(s[f]) <= LIVE * (1 + TURNOVER) for s in sets)
        ever = set().union(*(s[f] for s in sets))
        assert LIVE * 2 < len(ever) <= TEACHER.ids_seen(5) == LIVE * (1 + 5 * TURNOVER)


def test_no_turnover_keeps_the_population() -> None:
    still = DriftingTeacher(num_sparse=1, live_ids=50, turnover=0.0)
    rng = np.random.default_rng(0)
    _, early, _, _ = still.rows(np.full(5_000, 0.1), rng)
    _, late, _, _ = still.rows(np.full(5_000, 9.9), rng)
    assert set(early[0]) == set(late[0]) and len(set(early[0])) == 50


def test_the_signal_is_in_the_per_id_weights() -> None:
    times = np.linspace(0, 1, 40_000, endpoint=False)
    rng = np.random.default_rng(1)
    _, _, labels, prob = TEACHER.rows(times, rng)
    no_ids = DriftingTeacher(num_sparse=3, live_ids=LIVE, seed=5, sparse_logit_std=0.0)
    _, _, labels0, prob0 = no_ids.rows(times, np.random.default_rng(1))
    assert auc(prob, labels) > 0.8 > 0.7 > auc(prob0, labels0)
    assert 0.15 < labels.mean() < 0.35  # calibrated near a 25% click rate


def test_deterministic_by_seed_and_day(
    days: tuple[pathlib.Path, list[list[set[int]]]], tmp_path: pathlib.Path
) -> None:
    out, _ = days
    # Day 3 written alone, later, holds the same rows (row ids included) as in the 5-day write.
    alone = write_drifting_parquet(
        tmp_path / "d3", teacher=TEACHER, days=1, first_day=3, rows_per_day=ROWS, files_per_day=2
    )
    assert [pathlib.Path(p).parent.name for p in alone.paths] == ["day=2026-01-04"] * 2
    again = pq.read_table(tmp_path / "d3" / "day=2026-01-04")
    assert again.equals(pq.read_table(out / "day=2026-01-04"))
    assert again.column("row_id").to_pylist() == list(range(3 * ROWS, 4 * ROWS))
    other = DriftingTeacher(num_sparse=3, live_ids=LIVE, turnover=TURNOVER, seed=6)
    write_drifting_parquet(tmp_path / "s6", teacher=other, days=1, first_day=3, rows_per_day=ROWS)
    ids6 = pq.read_table(tmp_path / "s6").column("cat_0").combine_chunks().flatten().to_numpy()
    ids5 = again.column("cat_0").combine_chunks().flatten().to_numpy()
    assert not set(ids6) & set(ids5)
    meta = json.loads((tmp_path / "d3" / "_meta.json").read_text())
    assert meta["first_day"] == 3 and meta["ids_seen"] == list(alone.ids_seen)


def test_todays_reader_lists_the_days_in_time_order(
    days: tuple[pathlib.Path, list[list[set[int]]]],
) -> None:
    out, _ = days
    spec = FeatureSpec(
        dense=tuple(f"dense_{j}" for j in range(13)),
        sparse=tuple(
            SparseFeature(name=f"cat_{f}", num_embeddings=100, id_policy="modulo") for f in range(3)
        ),
        labels=("label",),
        row_id="row_id",
    )
    source = ParquetSource(paths=str(out), spec=spec)
    _, files = source.list_files()  # recursive; _meta.json is not data
    assert [pathlib.Path(f).relative_to(out).as_posix() for f in files] == [
        f"day=2026-01-0{d + 1}/part-0000{k}.parquet" for d in range(5) for k in range(2)
    ]
    infos = source.inspect()  # every footer holds the columns the spec needs, typed right
    assert sum(i.rows for i in infos) == 5 * ROWS


def test_make_data_writes_drifting_days(tmp_path: pathlib.Path) -> None:
    argv = ["--out", str(tmp_path), "--days", "2", "--rows-per-day", "500", "--live-ids", "20"]
    assert make_data([*argv, "--features", "2", "--start-date", "2025-12-31"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "_meta.json",
        "day=2025-12-31",
        "day=2026-01-01",
    ]
    with pytest.raises(SystemExit):
        make_data(["--out", str(tmp_path)])  # neither --rows nor --days


def test_bad_settings_are_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"DriftingTeacher.turnover must be in \[0, 1\], got 1.5"):
        DriftingTeacher(turnover=1.5)
    with pytest.raises(ValueError, match=r"DriftingTeacher.live_ids must be >= 1, got 0"):
        DriftingTeacher(live_ids=0)
    with pytest.raises(ValueError, match="rows_per_day=3 cannot fill 2 files x 2 row groups"):
        write_drifting_parquet(
            tmp_path,
            teacher=TEACHER,
            days=1,
            rows_per_day=3,
            files_per_day=2,
            row_groups_per_file=2,
        )
    with pytest.raises(ValueError, match="days must be >= 1"):
        write_drifting_parquet(tmp_path, teacher=TEACHER, days=0, rows_per_day=3)
