"""The Ray control-plane benchmark's own arithmetic: the coordinator's share of the steady
intervals, and when it asks the job to stop (benchmarks/control_plane_ray.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.control_plane_ray import StopAfterJoin, boundary_rows, steady_share
from raytrec.elastic.drain_policy import stop_requested
from raytrec.observability.metrics import IntervalMetrics


def row(step: int, *, gangs: int = 4, loop: float = 0.1, busy: float = 0.02) -> IntervalMetrics:
    return IntervalMetrics(
        step=step, steps=1, loss=0.5, samples_per_s=1.0, seconds=loop, data_wait_fraction=0.0,
        sync_fraction=0.0, generation=0, gangs=gangs, elapsed_s=float(step), idle_s=busy / 2,
        coordinator_s=busy, loop_s=loop,
    )  # fmt: skip


def test_the_share_is_a_ratio_of_sums_over_the_steady_rows_only() -> None:
    rows = [row(1, loop=5.0, busy=5.0), row(2, loop=0.1, busy=0.01), row(3, loop=0.3, busy=0.09)]
    rows.append(row(4, loop=9.0, busy=9.0))  # a recovery's row, outside the steady ones
    busy, idle = steady_share(rows, first=2, last=3)
    assert busy == pytest.approx(0.1 / 0.4)
    assert idle == pytest.approx(0.05 / 0.4)
    with pytest.raises(ValueError, match="no timed rows"):
        steady_share(rows, first=10, last=12)


def test_the_stop_is_asked_once_the_full_job_trained_after_a_loss(tmp_path: Path) -> None:
    run_dir = tmp_path / "scale-20261129-000000"
    run_dir.mkdir()
    watch = StopAfterJoin(str(tmp_path), gangs=4, after=2)
    for r in [row(1), row(2), row(3, gangs=3), row(4, gangs=3), row(5)]:
        watch(r)  # full at the start: not a join; one full row after the loss: too few
    assert not stop_requested(str(run_dir))
    watch(row(6))
    assert stop_requested(str(run_dir))


def test_the_loss_and_join_rows_are_the_first_without_and_again_with_every_gang() -> None:
    rows = [row(1), row(2, gangs=3), row(3, gangs=3), row(4), row(5)]
    loss, join = boundary_rows(rows, 4)
    assert (loss.step, join and join.step) == (2, 4)
    assert boundary_rows(rows[:3], 4)[1] is None  # no join within the run
    with pytest.raises(ValueError, match="no loss"):
        boundary_rows([row(1)], 4)
