"""Interval metrics aggregate the ranks' reports."""

from __future__ import annotations

import pytest

from raytrec.elastic.report import RankReport
from raytrec.observability.metrics import aggregate_interval


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


def test_ranks_that_disagree_on_steps_are_an_error() -> None:
    with pytest.raises(ValueError, match="different numbers of steps"):
        aggregate_interval(
            [report([1.0], 1, 1.0), report([1.0, 2.0], 1, 1.0)],
            wall_s=1.0,
            generation=0,
            gangs=1,
            elapsed_s=1.0,
        )
