"""What the job does at an interval boundary: the decisions made there, carried out.

At each boundary the loop (:mod:`actors.coordinator`) asks :func:`raytrec.elastic.boundary.decide`
what to do with what was observed there (a stop asked for, a drain requested, gangs built, too
few gangs, a checkpoint or an evaluation due) and this module carries the decision out through
the part that owns it: drains (:mod:`actors.drain`), growth (:mod:`actors.growth`), checkpoints
(:mod:`actors.checkpoints`), evaluation (:mod:`actors.evaluation`). A rank lost while it does so
is recovered from (:mod:`actors.recovery`) as anywhere else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from actors.checkpoints import JobCheckpoints
from actors.drain import GangDrain
from actors.evaluation import JobEvaluation
from actors.growth import GangGrowth
from actors.job import JobView, Outcome, Prepared
from actors.nodes import JobNodes
from actors.ports import JobPorts
from actors.publishing import JobPublishing
from actors.recovery import FailureRecovery
from raytrec.cluster.topology import Layout
from raytrec.config import TrainConfig
from raytrec.elastic.boundary import JobState, Observations, decide, evaluation_due, save_due
from raytrec.elastic.decisions import (
    Checkpoint,
    Continue,
    Decision,
    Drain,
    Evaluate,
    Fail,
    Grow,
    Stop,
    Wait,
)
from raytrec.elastic.drain_policy import stop_requested
from raytrec.elastic.events import EventLog, JobFailed, ResourcesWaited
from raytrec.elastic.report import RankReport
from raytrec.elastic.straggler_policy import StragglerWatch, gang_step_seconds
from raytrec.elastic.workers import Clock, RankCallError
from raytrec.errors import JobFailedError
from raytrec.observability.rec_metrics import InterpretedMetrics

__all__ = ["BoundaryWork"]


class BoundaryWork:
    """Decides at a boundary and carries the decisions out (module doc)."""

    def __init__(
        self,
        state: JobView,
        *,
        config: TrainConfig,
        run_dir: str,
        replayable: bool,
        clock: Clock,
        events: EventLog,
        apply: Callable[[Outcome], None],
        now: Callable[[], float],
        recovery: FailureRecovery,
        growth: GangGrowth,
        drains: GangDrain,
        nodes: JobNodes,
        checkpoints: JobCheckpoints,
        evaluation: JobEvaluation | None,
        ports: JobPorts | None = None,
    ) -> None:
        self.state = state
        self.cfg = config
        self.elastic = config.elastic
        self.run_dir = run_dir
        self.within_host = config.scaling.topology().layout is Layout.REPLICAS_WITHIN_HOST
        self.replayable = replayable
        self.clock = clock
        self.events = events
        self.apply = apply
        self.now = now
        self.recovery = recovery
        self.growth = growth
        self.drains = drains
        self.nodes = nodes
        self.checkpoints = checkpoints
        self.evaluation = evaluation
        # The model published for serving (``publish``), through the job's ports.
        self.publishing = (
            JobPublishing(ports, config=config.publish, run_dir=run_dir)
            if ports is not None and config.publish.every_n_steps is not None
            else None
        )
        self.stop = threading.Event()  # a stop was asked for (Coordinator.request_stop)
        self.stragglers = StragglerWatch()  # gangs slower than the others, interval by interval

    def job_state(self) -> JobState:
        """The job's state values :func:`~raytrec.elastic.boundary.decide` reads."""
        return JobState(
            membership=self.state.membership,
            step=self.state.step,
            end_step=self.state.end_step,
            max_gangs=self.state.max_gangs,
            elastic=self.elastic,
            sync_every=self.cfg.sync.sync_every,
            transient=self.recovery.transient,
            within_host=self.within_host,
            replayable=self.replayable,
            point=self.state.point,
            checkpoint=self.cfg.checkpoint,
            last_save=self.state.last_save,
            evaluation=None if self.evaluation is None else self.evaluation.state(),
        )

    def _decide(self, seen: Observations, now: float | None = None) -> tuple[Decision, ...]:
        return decide(self.job_state(), seen, self.clock.monotonic() if now is None else now)

    def stop_asked(self) -> bool:
        """Whether the job was asked to stop: ``request_stop`` (the driver's signal), or
        ``raytrec.stop`` from another process (a file in the run directory)."""
        if not self.stop.is_set() and stop_requested(self.run_dir):
            self.stop.set()
        return self.stop.is_set()

    def stopping(self, *, asked: Callable[[], bool], data_stop: str | None = None) -> Stop | None:
        """The :class:`Stop` decided here, if any: ``data_stop`` (why a rank could not prepare
        what is next), else ``asked()`` (a stop was requested; asked only then)."""
        seen = Observations(data_stop=data_stop, stop_requested=data_stop is None and asked())
        (decision, *_) = self._decide(seen)
        return decision if isinstance(decision, Stop) else None

    def work_due(self, step: int) -> bool:
        """Whether a checkpoint or an evaluation is due at the boundary at ``step`` (the rules
        :func:`~raytrec.elastic.boundary.decide` applies when the job gets there)."""
        state = self.job_state()
        due = save_due(state, step=step, now=self.clock.monotonic()) is not None
        publish = self.publishing is not None and self.publishing.due(step)
        return due or publish or evaluation_due(state, step)

    def observe(self, reports: list[RankReport]) -> None:
        """Books each gang's step time in the interval ``reports`` account for, when
        ``elastic.straggler_eviction`` is set
        (:class:`~raytrec.elastic.straggler_policy.StragglerWatch`)."""
        eviction = self.elastic.straggler_eviction
        if eviction is not None:
            step_s = gang_step_seconds(reports, self.state.membership.gang_of_rank)
            self.stragglers = self.stragglers.observe(step_s, eviction.factor)

    def _drain_seen(self, *, take: bool) -> Observations:
        return Observations(
            drain=self.drains.request(take=take),
            node_of_rank=self.nodes.of_rank,
            stragglers=self.stragglers,
        )

    def drain_due(self) -> bool:
        """Whether a drain would run at the next boundary (the request is left in place)."""
        (decision, *_) = self._decide(self._drain_seen(take=False))
        return isinstance(decision, Drain)

    def drain(self) -> None:
        """Takes what is asked to be given back and carries out the :class:`Drain` decided (a
        persistent straggler's eviction among them: the runs of slow intervals start over)."""
        for decision in self._decide(self._drain_seen(take=True)):
            match decision:
                case Drain():
                    self.drains.apply(decision)
                    if decision.straggler is not None:
                        self.stragglers = StragglerWatch()
                case Continue():
                    pass

    def admit(self) -> None:
        """Starts building the gangs whose placement became ready, and joins the built ones as
        the :class:`Grow` decided says."""
        self.growth.start_ready()
        built = self.growth.built()
        if not built:
            return
        seen = Observations(built=tuple(b.gang for b in built))
        for decision in self._decide(seen):
            match decision:
                case Grow():
                    self.growth.join(built, decision)

    def wait_for_gangs(self) -> None:
        """Below ``elastic.min_gangs`` training pauses until gangs join, for as long as the
        :class:`Wait` decided says (then a :class:`Fail`); a stop asked meanwhile ends it."""
        since = self.now()
        waited = False
        while True:
            seen = Observations(waiting_since=since, stop_requested=self.stop.is_set())
            (decision, *_) = self._decide(seen, self.now())
            match decision:
                case Continue() | Stop():
                    return
                case Fail():
                    self.events.append(
                        JobFailed(at=self.now(), step=self.state.step, reason=decision.reason)
                    )
                    raise JobFailedError(decision.reason)
                case Wait() if not waited:
                    self.events.append(
                        ResourcesWaited(
                            at=self.now(),
                            step=self.state.step,
                            live_gangs=self.state.membership.num_gangs,
                            min_gangs=self.elastic.min_gangs,
                            deadline=decision.deadline,
                        )
                    )
                    self.growth.request()
                    waited = True
            self.clock.sleep(self.elastic.poll_s)
            self.admit()

    def save_if_due(self, seen: Observations) -> None:
        """Saves a checkpoint when the :class:`Checkpoint` decision says so."""
        for decision in self._decide(seen):
            match decision:
                case Checkpoint():
                    self.apply(self.checkpoints.save())

    def checkpoint(self) -> None:
        """Saves a checkpoint, then publishes the model, when due here; a rank lost during
        their sync or their writes is recovered from as anywhere else, and what was due waits
        for the next boundary where it is."""
        try:
            self.save_if_due(Observations(save=True))
            self.publish()
        except RankCallError as e:
            self.recover(e)

    def publish(self, *, final: bool = False) -> None:
        """Publishes the model for serving when due here (``final``: the job's end, where the
        last write is also waited for)."""
        if self.publishing is None:
            return
        if self.publishing.due(self.state.step, final=final):
            self.publishing.publish()
        if final:
            self.publishing.finish()

    def evaluate(self) -> InterpretedMetrics | None:
        """Runs the held-out evaluation when one is due here; a rank lost meanwhile is
        recovered from as anywhere else, and the evaluation waits for the next boundary."""
        if self.evaluation is None:
            return None
        if not any(isinstance(d, Evaluate) for d in self._decide(Observations(evaluate=True))):
            return None
        try:
            return self.evaluation.run()
        except RankCallError as e:
            self.recover(e)
            return None

    def early_stop(self) -> Stop | None:
        """The early stop decided after an evaluation, if any (recorded by the evaluation)."""
        if self.evaluation is None:
            return None
        for decision in self._decide(Observations(evaluated=True)):
            if isinstance(decision, Stop):
                self.evaluation.early_stopped(decision)
                return decision
        return None

    def recover(self, error: RankCallError) -> None:
        """Recovers from a rank lost during work at a boundary."""
        self.recovery.recover_until_stable(self.recovery.probe(error))
        self.apply(Prepared(0))  # recovery may have re-opened the ranks' feeds
