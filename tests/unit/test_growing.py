"""A growing Parquet source's pure parts (raytrec/data/growing.py): which files of a listing
are new, when the rows found can be shared among the ranks with none left over (checked against
the re-share's own cut), when a job that has trained every row ends; the day partitions'
lander; the config's rules; and a resume's data check, which allows files added."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import pyarrow.parquet as pq
import pytest

from raytrec.config import ConfigError
from raytrec.data.config import DataConfig, GrowingConfig
from raytrec.data.fingerprint import data_changes
from raytrec.data.growing import first_batch_from, growth_decision, new_files, shareable
from raytrec.data.parquet import ParquetSource
from raytrec.data.parquet_recut import recut
from raytrec.data.partitions import stage_days
from raytrec.data.spec import criteo_spec


def test_new_files_are_the_listed_ones_not_known_sorted_and_capped() -> None:
    known = ["/d/day=1/a.parquet", "/d/day=2/a.parquet"]
    listing = ["/d/day=3/a.parquet", *known, "/d/day=0/late.parquet"]
    landed = new_files(listing, known, max_files=None)
    assert landed.added == ("/d/day=0/late.parquet", "/d/day=3/a.parquet")  # after the known
    assert landed.missing == ()
    assert new_files(listing, known, max_files=3).added == ("/d/day=0/late.parquet",)
    assert new_files(listing, known, max_files=2).added == ()
    assert new_files(known[1:], known, max_files=None).missing == (known[0],)


@pytest.mark.parametrize("batch_size", [1, 2, 3, 16])
@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_shareable_says_exactly_when_the_recut_leaves_no_row_over(
    ranks: int, batch_size: int
) -> None:
    for rows in range(1, 200):
        shared = recut({0: [(0, rows)]}, queued=[0] * ranks, batch_size=batch_size)
        fits = shared.left_over == 0 and all(s for s in shared.streams)
        assert shareable(rows, ranks=ranks, batch_size=batch_size) == fits, rows


def test_a_job_that_trained_every_row_ends_on_max_files_or_idle_else_waits() -> None:
    wait = growth_decision(files=3, max_files=None, idle_s=1e6, idle_stop_s=None)
    assert wait is None
    assert growth_decision(files=3, max_files=4, idle_s=5.0, idle_stop_s=10.0) is None
    stop = growth_decision(files=4, max_files=4, idle_s=0.0, idle_stop_s=None)
    assert stop is not None and stop.cause == "files" and "4 files" in stop.reason
    idle = growth_decision(files=3, max_files=4, idle_s=10.0, idle_stop_s=10.0)
    assert idle is not None and idle.cause == "idle" and "no new file for 10 s" in idle.reason


def test_days_land_whole_as_partitions_the_listing_finds(tmp_path: pathlib.Path) -> None:
    lander, data = stage_days(str(tmp_path), days=3, rows_per_day=40, num_embeddings=50)
    source = ParquetSource(paths=str(tmp_path), spec=criteo_spec(50))
    with pytest.raises(Exception, match=r"no \.parquet files"):
        source.list_files()  # staged days are not data yet
    lander.land(0)
    lander.land(1)
    _, files = source.list_files()
    assert files == lander.landed() and len(files) == 2
    assert files[1].endswith(os.path.join("day=2026-11-28", "part-0.parquet"))
    ids = [pq.read_table(f, columns=["row_id"])["row_id"].to_pylist() for f in files]
    assert ids == [list(range(40)), list(range(40, 80))]
    assert data.rows == 120 and not os.path.exists(data.paths[0])


def test_the_growing_config_needs_an_indexed_unshuffled_single_epoch_parquet_source() -> None:
    ok = DataConfig(source="parquet", path="/d", growing=GrowingConfig(poll_s=1, max_files=5))
    assert ok.growing is not None and ok.growing.poll_s == 1.0
    for bad in ({"epochs": 2}, {"shuffle_seed": 3}, {"source": "generated"}):
        fields: dict[str, Any] = {"source": "parquet", "path": "/d", **bad}
        with pytest.raises(ConfigError, match=r"data\.growing needs") as e:
            DataConfig(growing=GrowingConfig(), **fields)
        assert f"data.{next(iter(bad))}=" in str(e.value)
    with pytest.raises(ConfigError, match="poll_s"):
        GrowingConfig(poll_s=0)


def test_streaming_parquet_reads_are_refused_with_the_reason_they_were_retired() -> None:
    with pytest.raises(ConfigError, match=r"data\.parquet_read='streaming' was retired") as e:
        DataConfig(source="parquet", path="/d", parquet_read="streaming")  # type: ignore[arg-type]
    assert "3.3x" in str(e.value) and "delete the key" in str(e.value)
    assert DataConfig(parquet_read="indexed").parquet_read == "indexed"


def test_a_resume_of_a_growing_source_allows_files_added_not_changed() -> None:
    saved = {"kind": "parquet", "files": [{"path": "/d/a", "size": 1, "mtime_ns": 1}]}
    now = {
        "kind": "parquet",
        "files": [
            {"path": "/d/a", "size": 1, "mtime_ns": 1},
            {"path": "/d/b", "size": 2, "mtime_ns": 2},
        ],
    }
    assert data_changes(saved, now) == ["file added: /d/b"]
    assert data_changes(saved, now, growing=True) == []
    changed = {"kind": "parquet", "files": [{"path": "/d/a", "size": 5, "mtime_ns": 1}]}
    assert data_changes(saved, changed, growing=True) == [
        "file changed: /d/a (size 1 bytes, now 5)"
    ]


def test_the_first_batch_holding_a_new_row_is_found_in_each_stream() -> None:
    # 100 rows left and 50 new ones after them, cut among 2 ranks in batches of at most 10:
    # 8 batches each: rank 0 takes rows 0..74, rank 1 rows 75..149, whose batches start at
    # 75 + (0, 9, 18, 28, ...): row 100 is in its batch 2.
    streams = recut({0: [(0, 100), (100, 150)]}, queued=[0, 0], batch_size=10).streams
    assert [first_batch_from(s, 100) for s in streams] == [None, 2]
    assert first_batch_from(streams[1], 75) == 0 and first_batch_from(streams[0], 74) == 7
    # Rows in two runs (a lost rank's rows and the new ones): places count across the runs.
    (stream,) = recut({0: [(0, 5), (50, 70)]}, queued=[0], batch_size=5).streams
    assert [first_batch_from(stream, r) for r in (0, 5, 50, 60, 70)] == [0, 1, 1, 3, None]
