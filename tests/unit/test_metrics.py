"""Interval metrics aggregate the ranks' reports."""

from __future__ import annotations

import pytest

from actors.job_training import LoopTimer
from raytrec.elastic.report import RankReport
from raytrec.observability.metrics import CoordinatorTime, aggregate_interval


def report(
    losses: list[float], rows: int, seconds: float, data: float = 0.0, idle: float = 0.0
) -> RankReport:
    return RankReport(
        rank=0,
        idle_s=idle,
        step=len(losses),
        losses=tuple(losses),
        rows=rows,
        seconds=seconds,
        data_wait_s=data,
        sync_s=0.1,
    )


def test_aggregate_interval() -> None:
    row = aggregate_interval(
        [report([1.0, 0.5], 512, 2.0, 0.2, 0.5), report([0.7, 0.2], 512, 1.5, 0.0, 0.1)],
        wall_s=2.5,
        generation=3,
        gangs=2,
        elapsed_s=10.0,
    )
    assert row.loss == pytest.approx(0.6)
    assert row.samples_per_s == pytest.approx(1024 / 2.5)
    assert row.data_wait_fraction == pytest.approx(0.2 / 3.5)
    assert row.sync_fraction == pytest.approx(0.2 / 3.5)
    assert (row.step, row.steps, row.generation, row.gangs) == (2, 2, 3, 2)
    # The slowest rank trained for 2.0 s; one rank sat idle for 0.5 s of the interval's 2.5
    # waiting for the coordinator: the control loop took 20%.
    assert row.train_s == pytest.approx(2.0)
    assert row.idle_s == pytest.approx(0.5)
    assert row.control_fraction == pytest.approx(0.2)
    # Without the loop's timing, the coordinator's own work is unknown.
    assert row.coordinator_s is None and row.coordinator_fraction is None


def test_the_coordinators_own_work_is_its_loop_time_less_its_wait_for_the_reports() -> None:
    reports = [report([1.0], 64, 0.5)]
    took = CoordinatorTime(loop_s=0.8, waited_s=0.6, cpu_s=0.05)
    row = aggregate_interval(
        reports, wall_s=0.5, generation=0, gangs=1, elapsed_s=1.0, coordinator=took
    )
    assert row.loop_s == pytest.approx(0.8)
    assert row.coordinator_s == pytest.approx(0.2)
    assert row.coordinator_cpu_s == pytest.approx(0.05)
    assert row.coordinator_fraction == pytest.approx(0.25)
    # A wait measured a hair longer than the loop (two reads of the clock) is no negative work.
    took = CoordinatorTime(loop_s=0.5, waited_s=0.51, cpu_s=0.0)
    row = aggregate_interval(
        reports, wall_s=0.5, generation=0, gangs=1, elapsed_s=1.0, coordinator=took
    )
    assert row.coordinator_s == 0.0 and row.coordinator_fraction == 0.0


def test_the_loop_timer_laps_from_row_to_row() -> None:
    cpu = iter([1.0, 1.25, 1.5])
    timer = LoopTimer(since=10.0, cpu=lambda: next(cpu))
    assert timer.lap(10.5, waited_s=0.25) == CoordinatorTime(loop_s=0.5, waited_s=0.25, cpu_s=0.25)
    # The next lap starts where the last ended, on both clocks.
    assert timer.lap(11.5, waited_s=0.75) == CoordinatorTime(loop_s=1.0, waited_s=0.75, cpu_s=0.25)


def test_ranks_that_disagree_on_steps_are_an_error() -> None:
    with pytest.raises(ValueError, match="different numbers of steps"):
        aggregate_interval(
            [report([1.0], 1, 1.0), report([1.0, 2.0], 1, 1.0)],
            wall_s=1.0,
            generation=0,
            gangs=1,
            elapsed_s=1.0,
        )
