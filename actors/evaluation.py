"""The coordinator's part that runs held-out evaluations (raytrec.eval_plan): when one is due
(an :class:`~raytrec.elastic.decisions.Evaluate` of :func:`~raytrec.elastic.boundary.decide`),
after a job-wide sync, the live ranks score the held-out batches (each rank keeps those it
scored before: ``keep_eval_batches``) and the coordinator merges their metric states. It keeps
the score of each evaluation, which early stopping is decided on. After the job starts and after
each membership change, each live rank reads ahead, in the background, the batches it will score
at the next evaluation and does not hold yet (:meth:`JobEvaluation.read_ahead`), so that no
evaluation waits on a rank's first read. It sees the job through the ports it calls only
(:class:`EvaluationPorts`)."""

from __future__ import annotations

from typing import Any, Protocol

from actors.ports import HasEvents, HasGangOf, HasRankCalls, HasStep, HasSync
from raytrec.config import EvalConfig
from raytrec.data.held_out import keeps_held_out
from raytrec.elastic.boundary import EvalState
from raytrec.elastic.decisions import Stop
from raytrec.elastic.events import EarlyStopped
from raytrec.eval_plan import EvalPlan, keep_eval_batches
from raytrec.observability.rec_metrics import InterpretedMetrics, merge_metric_states


class EvaluationPorts(HasRankCalls, HasGangOf, HasStep, HasSync, HasEvents, Protocol):
    """The ports :class:`JobEvaluation` calls."""


class JobEvaluation:
    """Evaluations of one job: the held-out shard, its plan and the last step evaluated."""

    def __init__(
        self, shard: Any, plan: EvalPlan, *, config: EvalConfig, job: EvaluationPorts
    ) -> None:
        self.job = job
        self.config = config
        self.shard = shard
        self.plan = plan
        # The start counts as evaluated: the first evaluation is at the first boundary at or
        # after every_n_steps, not at the first boundary of all.
        self.last_step = 0
        # (step, early_stopping_metric) of every evaluation, in order.
        self.scores: list[tuple[int, float | None]] = []
        # Rank -> the held-out batches it scored last or reads ahead for the next evaluation
        # (and holds read, or will): each keeps them.
        self.held: dict[int, list[int]] = {}
        # Rank -> every held-out batch it read or was sent to read ahead (padding included).
        self.read: dict[int, set[int]] = {}

    def state(self) -> EvalState:
        """The schedule and scores :func:`~raytrec.elastic.boundary.decide` reads."""
        cfg = self.config
        return EvalState(
            every=cfg.every_n_steps,
            batches=self.plan.num_batches,
            last_step=self.last_step,
            metric=cfg.early_stopping_metric,
            patience=cfg.early_stopping_patience,
            min_delta=cfg.early_stopping_min_delta,
            scores=tuple(self.scores),
        )

    def _assign(self, ranks: list[int]) -> dict[int, list[int | None]]:
        """What each of ``ranks`` scores at an evaluation now (it keeps what it holds)."""
        return keep_eval_batches(
            self.plan.num_batches, ranks, before=self.held, gang_of=self.job.gang_of
        )

    def read_ahead(self) -> None:
        """Has each live rank read in the background the held-out batches the next evaluation
        assigns it (as :meth:`run` would assign them now) that it has not read yet, so that the
        evaluation does not wait on its first read of them. Called once the job's ranks are
        built and after every membership change; a rank call that fails raises, as any rank
        call does. A held-out set the ranks do not keep (not read by index): nothing."""
        if not keeps_held_out(self.shard):
            return
        ranks = self.job.live_ranks()
        assigned = self._assign(ranks)
        self.held = _scored(assigned)
        # A rank with only padding rounds scores its first batch, or batch 0 with none.
        needed = {r: self.held[r] or [0] for r, batches in assigned.items() if batches}
        read = {r: self.read.get(r, set()) for r in ranks}
        send = {r: [b for b in ids if b not in read[r]] for r, ids in needed.items()}
        send = {r: ids for r, ids in send.items() if ids}
        for r, ids in send.items():
            read[r].update(ids)
        self.read = read
        if send:
            shard, batch_size = self.shard, self.plan.batch_size
            self.job.call(
                sorted(send), lambda w, r: w.prefetch_held_out(shard, send[r], batch_size)
            )

    def run(self) -> InterpretedMetrics:
        """Evaluates the job's model as of now (after a sync when the gangs' copies differ)."""
        job = self.job
        job.sync()
        ranks = job.live_ranks()
        assigned = self._assign(ranks)
        shard, batch_size = self.shard, self.plan.batch_size
        states = job.call(ranks, lambda w, r: w.evaluate(shard, assigned[r], batch_size))
        self.held = _scored(assigned)
        for r, batches in assigned.items():
            if batches:
                self.read.setdefault(r, set()).update(self.held[r] or [0])
        self.last_step = job.step()
        merged = merge_metric_states(states)
        metric = self.config.early_stopping_metric
        self.scores.append((job.step(), getattr(merged, metric.removeprefix("eval_"))))
        return merged

    def early_stopped(self, stop: Stop) -> None:
        """Records an early stop (a :class:`~raytrec.elastic.decisions.Stop`) as an
        ``early_stopped`` event."""
        self.job.record(
            EarlyStopped(
                at=self.job.now(),
                step=self.job.step(),
                metric=stop.metric,
                best=stop.best,
                best_step=stop.best_step,
                reason=stop.reason,
            )
        )


def _scored(assigned: dict[int, list[int | None]]) -> dict[int, list[int]]:
    """Rank -> the batches it scores (its padding rounds left out)."""
    return {r: [b for b in batches if b is not None] for r, batches in assigned.items()}
