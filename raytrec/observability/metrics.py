"""Per-interval training metrics, aggregated from the ranks' reports.

Pure code: the coordinator collects one report per rank per interval and
turns them into one :class:`IntervalMetrics` row of the job's history.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from raytrec.elastic.report import RankReport

__all__ = ["CoordinatorTime", "IntervalMetrics", "aggregate_interval"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorTime:
    """The coordinator loop's time from one history row to the next: wall-clock ``loop_s``, of
    which it sat ``waited_s`` blocked on the ranks' reports, and its thread's ``cpu_s``."""

    loop_s: float
    waited_s: float
    cpu_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class IntervalMetrics:
    """One row of the metrics history: the steps ``(step - steps, step]``."""

    step: int
    steps: int
    loss: float  # mean training loss over every rank and step of the interval
    samples_per_s: float  # rows trained by the whole job per wall-clock second
    seconds: float  # wall-clock time of the interval
    data_wait_fraction: float  # share of rank time spent waiting for batches
    sync_fraction: float  # share of rank time spent in replica-group syncs
    generation: int
    gangs: int
    elapsed_s: float  # since training started
    auc: float | None = None  # progressive-validation AUC over the interval's rows (all ranks)
    ne: float | None = None  # normalized entropy over the same rows
    at: float = 0.0  # the coordinator's clock at the interval's end (the clock of the events)
    # The step the job ends at, as known now: num_steps, or where a re-shared source's rows end
    # (later after a gang was lost, sooner after one joined).
    end_step: int | None = None
    # The slowest rank's seconds in its ``train`` call: the training loop and preparing the
    # next batches (the ranks' own clock).
    train_s: float | None = None
    # The longest any rank sat idle between its previous interval and this one, waiting for
    # the coordinator: Ray's dispatch of ``train`` and the return of the reports, and whatever
    # ran at the boundary (bookkeeping, a checkpoint, a join). Near zero when the interval was
    # queued on the ranks while the one before it ran.
    idle_s: float | None = None
    rows: int = 0  # rows the ranks trained in the interval (replayed ones included)
    # The coordinator's own work since the previous row: its loop's wall-clock time from the
    # previous row's end to this one's, less the time it sat blocked waiting for the ranks'
    # reports (booking, dispatching, boundary work, recoveries and joins included).
    coordinator_s: float | None = None
    # The CPU time of the coordinator loop's thread over the same span (Ray's own threads
    # sending the calls not included): unlike the wall-clock time, not stretched by other
    # processes taking the cores.
    coordinator_cpu_s: float | None = None
    # That loop's wall-clock time: from the previous row's end (or training's start) to this
    # one's; the interval's ``seconds`` starts later when nothing was queued behind the last.
    loop_s: float | None = None
    # Held-out evaluation at the interval's end (TrainConfig.eval), None when none ran: AUC,
    # NE and log loss over every held-out row scored, and their number.
    eval_auc: float | None = None
    eval_ne: float | None = None
    eval_log_loss: float | None = None
    eval_rows: int | None = None

    @property
    def control_fraction(self) -> float | None:
        """The share of the interval's wall-clock time the ranks waited for the coordinator."""
        if self.idle_s is None or self.seconds <= 0:
            return None
        return min(1.0, self.idle_s / self.seconds)

    @property
    def coordinator_fraction(self) -> float | None:
        """The share of the loop's wall-clock time since the previous row the coordinator spent
        in its own work rather than waiting for the ranks' reports."""
        if self.coordinator_s is None or not self.loop_s:
            return None
        return min(1.0, max(0.0, self.coordinator_s / self.loop_s))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def aggregate_interval(
    reports: Sequence[RankReport],
    *,
    wall_s: float,
    generation: int,
    gangs: int,
    elapsed_s: float,
    auc: float | None = None,
    ne: float | None = None,
    at: float = 0.0,
    coordinator: CoordinatorTime | None = None,
) -> IntervalMetrics:
    """Folds the ranks' ``train`` reports for one interval into one history row;
    ``coordinator``: the loop's time since the previous row (the part not spent waiting for
    the reports is its own work, ``coordinator_s``)."""
    if not reports:
        raise ValueError("aggregate_interval needs at least one rank report")
    steps = {len(r.losses) for r in reports}
    if len(steps) != 1:
        raise ValueError(f"ranks trained different numbers of steps in one interval: {steps}")
    losses = [loss for r in reports for loss in r.losses]
    rank_s = sum(r.seconds for r in reports) or 1e-12
    c = coordinator
    return IntervalMetrics(
        step=max(r.step for r in reports),
        steps=steps.pop(),
        loss=sum(losses) / len(losses),
        samples_per_s=sum(r.rows for r in reports) / max(wall_s, 1e-12),
        seconds=wall_s,
        data_wait_fraction=sum(r.data_wait_s for r in reports) / rank_s,
        sync_fraction=sum(r.sync_s for r in reports) / rank_s,
        generation=generation,
        gangs=gangs,
        elapsed_s=elapsed_s,
        auc=auc,
        ne=ne,
        at=at,
        train_s=max(r.seconds for r in reports),
        idle_s=max((r.idle_s for r in reports if r.idle_s is not None), default=None),
        rows=sum(r.rows for r in reports),
        coordinator_s=None if c is None else max(0.0, c.loop_s - c.waited_s),
        coordinator_cpu_s=None if c is None else c.cpu_s,
        loop_s=None if c is None else c.loop_s,
    )
