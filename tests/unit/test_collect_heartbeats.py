"""Collecting an interval reads the ranks' heartbeats only when a hang check is due, not once per
report (:meth:`actors.recovery.FailureRecovery.collect`), and still finds a hung rank."""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import pytest

from actors.job import Dispatched
from actors.recovery import FailureRecovery
from raytrec.config import ScalingConfig, TrainConfig
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.membership import Membership
from raytrec.elastic.report import RankReport
from simulation.doubles.fake_faults import ManualClock

GANGS = 64


class OneAtATime:
    """Answers one rank's report per wait, as Ray's wait with ``num_returns=1`` can, each
    ``gap_s`` after the last; the ranks in ``silent`` never answer. Counts heartbeat reads."""

    def __init__(self, clock: ManualClock, *, gap_s: float, silent: frozenset[int] = frozenset()):
        self.clock, self.gap_s, self.silent = clock, gap_s, silent
        self.heartbeat_reads = 0

    def wait(self, futures: Sequence[Any], *, num_returns: int, timeout: float) -> list[Any]:
        due = [f for f in futures if f not in self.silent]
        if not due or self.gap_s > timeout:
            self.clock.advance_to(self.clock.now + timeout)
            return []
        self.clock.advance_to(self.clock.now + self.gap_s)
        return due[:1]

    def result(self, future: int) -> RankReport:
        return RankReport(rank=future, step=1)

    def progress(self, ranks: Sequence[int]) -> dict[int, int]:
        self.heartbeat_reads += 1
        return dict.fromkeys(ranks, 0)  # no rank finished a step yet


def collect(group: Any, clock: ManualClock, elastic: ElasticConfig, **kw: Any) -> Any:
    config = TrainConfig(scaling=ScalingConfig(num_workers=GANGS, gang_size=1), elastic=elastic)
    membership = Membership.initial(config.scaling.topology())
    ranks = list(range(GANGS))
    job = types.SimpleNamespace(
        clock=clock, step=lambda: 0, live_ranks=lambda: ranks,
        view=types.SimpleNamespace(membership=membership),
    )  # fmt: skip
    recovery = FailureRecovery(
        job,  # type: ignore[arg-type]  # the ports collect reads
        elastic=config.elastic, sync=config.sync, group=group,  # type: ignore[arg-type]
        placement=None, nodes=None, streams=None,  # type: ignore[arg-type]
        request_growth=lambda: None,
    )  # fmt: skip
    recovery.quiet_since(ranks, clock.now)
    sent = Dispatched(n=1, end=1, seq=1, refs={r: r for r in ranks}, t0=0.0, started=clock.now)
    return recovery.collect(sent, **kw)


def test_reports_coming_one_by_one_read_the_heartbeats_once_per_poll() -> None:
    clock = ManualClock()
    group = OneAtATime(clock, gap_s=0.05)
    elastic = ElasticConfig(poll_s=1.0, step_timeout_s=30.0, collective_timeout_s=10.0)
    out = collect(group, clock, elastic)
    assert sorted(out.reports) == list(range(GANGS)) and not out.failed
    # 64 reports over 3.2 s: the heartbeats are read at each poll (3 of them), not 63 times.
    assert group.heartbeat_reads == 3
    # All of the collect's time was spent waiting (the clock moves only in the stub's wait).
    assert out.waited_s == pytest.approx(clock.now) and clock.now >= GANGS * 0.05


def test_a_rank_that_never_answers_is_still_found_hung_after_the_step_timeout() -> None:
    clock = ManualClock()
    group = OneAtATime(clock, gap_s=0.05, silent=frozenset({7}))
    elastic = ElasticConfig(poll_s=1.0, step_timeout_s=5.0, collective_timeout_s=2.0)
    out = collect(group, clock, elastic)
    assert out.hung == [7] and len(out.reports) == GANGS - 1
    assert elastic.step_timeout_s <= clock.now <= elastic.step_timeout_s + elastic.poll_s


class AllAt:
    """Every rank reports at ``at`` (a long interval)."""

    def __init__(self, clock: ManualClock, at: float) -> None:
        self.clock, self.at = clock, at

    def wait(self, futures: Sequence[Any], *, num_returns: int, timeout: float) -> list[Any]:
        self.clock.advance_to(min(self.clock.now + timeout, self.at))
        return list(futures) if self.clock.now >= self.at else []

    def result(self, future: int) -> RankReport:
        return RankReport(rank=future, step=1)

    def progress(self, ranks: Sequence[int]) -> dict[int, int]:
        return dict.fromkeys(ranks, 0)


def test_a_long_interval_calls_meanwhile_every_poll() -> None:
    """The coordinator starts building a gang whose placement became ready within ``poll_s``
    while a long interval runs, not at its end."""
    clock = ManualClock()
    elastic = ElasticConfig(poll_s=1.0, step_timeout_s=30.0, collective_timeout_s=10.0)
    looked: list[float] = []
    out = collect(AllAt(clock, at=20.0), clock, elastic, meanwhile=lambda: looked.append(clock.now))
    assert sorted(out.reports) == list(range(GANGS)) and not out.failed
    assert looked == pytest.approx([float(t) for t in range(1, 20)])
    assert clock.now == 20.0
