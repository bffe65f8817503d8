"""The training states of the coordinator's loop: ``Running``, ``AtBoundary``, ``Waiting``.

What the loop (:mod:`actors.job_loop`) does while the job trains: at a boundary with nothing in
flight it asks :func:`raytrec.elastic.boundary.decide` (through :meth:`TrainingSteps.decide`, the
one place that calls it) whether to stop, drain, admit gangs built or wait for more, sends the
next interval and queues more behind it while nothing has to happen at the boundary between
them; it collects and books each interval, then evaluates, stops early or saves a checkpoint
when due. A rank call that fails returns a ``Recovering`` state naming the state to go back to.
This class also declares what the coordinator builds for the loop (:mod:`actors.coordinator`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from actors.boundary_work import BoundaryWork
from actors.checkpoints import JobCheckpoints
from actors.data_growth import DataGrowth
from actors.drain import GangDrain
from actors.evaluation import JobEvaluation
from actors.gang_placement import JobPlacement
from actors.growth import GangGrowth
from actors.job import Dispatched, IntervalOutcome, JobRecord, Outcome, Prepared
from actors.job_ranks import JobRanks
from actors.job_states import (
    AtBoundary,
    Failed,
    Finishing,
    JobLoopState,
    Recovering,
    Running,
    Waiting,
)
from actors.nodes import JobNodes
from actors.ports import RankCalls
from actors.recovery import FailureRecovery
from actors.reshare import DataStreams
from actors.total_loss import TotalLossRecovery
from raytrec.checkpoint.config import CheckpointConfig
from raytrec.cluster.topology import Layout, Topology
from raytrec.elastic.boundary import JobState, Observations, decide
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.control import Boundary, intervals_to_queue
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
from raytrec.elastic.events import EventLog, JobFailed, ResourcesWaited
from raytrec.elastic.report import RankInfo
from raytrec.elastic.run_record import RunSummary
from raytrec.elastic.straggler_policy import StragglerWatch
from raytrec.elastic.workers import Clock, RankCallError, RankFailed, WorkerGroup
from raytrec.engine.rank_engine import StoreAddress
from raytrec.errors import EarlyStopped, JobFailedError, StopRequested
from raytrec.observability.metrics import CoordinatorTime, IntervalMetrics, aggregate_interval
from raytrec.observability.rec_metrics import merge_metric_states

__all__ = ["LoopSettings", "LoopTimer", "TrainingSteps"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopSettings:
    """The settings the loop reads, built once by the coordinator from the job's config: steps
    per interval (``log_every``), the sync period (``sync.sync_every``), the passes over the
    data (``data.epochs``), and the ``elastic`` and ``checkpoint`` sections that
    :func:`~raytrec.elastic.boundary.decide` reads with the job's state."""

    log_every: int
    sync_every: int
    epochs: int
    elastic: ElasticConfig
    checkpoint: CheckpointConfig


class TrainingSteps:
    """The loop's training states, and what every state's step uses (module doc)."""

    # What the coordinator builds and the loop runs (actors/coordinator.py).
    settings: LoopSettings
    topology: Topology
    clock: Clock
    group: WorkerGroup
    state: JobRecord
    events: EventLog
    run_dir: str
    resume_from: str | None
    shards: list[Any]
    first_batch_s: float
    num_steps: int
    ranks: JobRanks
    placement: JobPlacement
    streams: DataStreams
    data_growth: DataGrowth | None  # the watch over a growing source (data.growing)
    growth: GangGrowth
    drains: GangDrain
    nodes: JobNodes
    total_loss: TotalLossRecovery
    recovery: FailureRecovery
    checkpoints: JobCheckpoints
    evaluation: JobEvaluation | None
    boundary: BoundaryWork
    _call: RankCalls
    _store_address: StoreAddress | None
    _started: float
    _history: list[IntervalMetrics]
    _lock: threading.Lock
    _seq: int
    _depth: int
    apply: Callable[[Outcome], None]
    _now: Callable[[], float]
    _summary: Callable[..., RunSummary]
    _stream_id: Callable[..., Any] | None  # how a batch's id is made (None: not replayable)
    # Set as the loop starts (JobLoop.run): when training started (None: not yet), the final
    # model's path once training first ended (None inside: no model to save), the ranks built,
    # the coordinator's own time from one history row to the next (from when training started).
    _train_start: float | None
    _loop_timer: LoopTimer | None
    _final: tuple[str | None] | None
    _infos: list[RankInfo]

    def decide(self, seen: Observations, now: float | None = None) -> tuple[Decision, ...]:
        """:func:`~raytrec.elastic.boundary.decide` on the job's state and ``seen``."""
        now = self.clock.monotonic() if now is None else now
        return decide(self.job_state(), seen, now)

    def job_state(self) -> JobState:
        """The job's state values :func:`~raytrec.elastic.boundary.decide` reads."""
        cfg = self.settings
        return JobState(
            membership=self.state.membership,
            step=self.state.step,
            end_step=self.state.end_step,
            max_gangs=self.state.max_gangs,
            elastic=cfg.elastic,
            sync_every=cfg.sync_every,
            transient=self.recovery.transient,
            within_host=self.topology.layout is Layout.REPLICAS_WITHIN_HOST,
            replayable=self._stream_id is not None,
            point=self.state.point,
            checkpoint=cfg.checkpoint,
            last_save=self.state.last_save,
            evaluation=None if self.evaluation is None else self.evaluation.state(),
        )

    def _lost(self, error: RankCallError, then: JobLoopState) -> Recovering:
        """A rank call failed (``error``): which ranks are lost, and the state to go back to
        once the job re-formed without them."""
        return self._recover(self.recovery.probe(error), then)

    def _recover(self, cause: IntervalOutcome, then: JobLoopState) -> Recovering:
        self.recovery.fresh()  # a new loss (one found while re-forming: Recovering again)
        m = self.state.membership
        return Recovering(cause, then, attempts_left=self.state.max_gangs + m.num_gangs + 1)

    def _training_starts(self, t0: float) -> None:
        if self._train_start is None:
            self.first_batch_s = self.clock.perf_counter() - t0
            self._train_start = self.clock.perf_counter()
            self._loop_timer = LoopTimer(since=self._train_start)

    # -- training -----------------------------------------------------------------------------

    def _running(self, s: Running) -> JobLoopState:
        """One turn of training: at a boundary with nothing in flight, what is decided there
        (a stop, a drain, gangs joining, a wait for gangs) and the next interval sent; then
        the interval that runs collected and booked, the next ones queued behind it while
        nothing has to happen at the boundary between them (:meth:`_top_up`)."""
        every = self.settings.log_every
        if s.entering:
            self._training_starts(s.t0)
            n = min(every, self.state.end_step - self.state.step)
            self.apply(Prepared(n if s.prepared else 0))
            s.entering = False
        growing = self.data_growth  # a growing source's job waits for files at the data's end
        if self.state.step >= self.state.end_step and growing is None:
            return Finishing(None, attempt=s.finishing)
        try:
            if not s.inflight:
                if not s.waited:
                    s.t0 = self.clock.perf_counter()  # the interval's time includes this
                    n = min(every, self.state.end_step - self.state.step)
                    # Bad input, or the end of the data, in what is next; else a user's request.
                    data_stop = str(s.stop) if s.stop is not None and self.state.ready < n else None
                    halt = self._stopping(data_stop=data_stop, asked=self.boundary.stop_asked)
                    if halt is not None:
                        cause = s.stop if halt.cause == "data" else StopRequested(halt.reason)
                        return Finishing(cause, attempt=s.finishing)
                    self.nodes.report_late_deaths()
                    self._drain()
                    self._admit()
                    since = self._now()
                    seen = Observations(
                        waiting_since=since, stop_requested=self.boundary.stop.is_set()
                    )
                    wait = self._wait_for_gangs(seen, first=True)
                    if wait is not None:
                        return wait if isinstance(wait, Failed) else Waiting(since, running=s)
                s.waited = False
                # Asked while it waited:
                halt = self._stopping(asked=self.boundary.stop.is_set)
                if halt is not None:
                    return Finishing(StopRequested(halt.reason), attempt=s.finishing)
                if growing is not None and not growing.boundary():  # waited, or ended
                    if growing.ended is not None:
                        return Finishing(None, attempt=s.finishing)
                    return s
                # A join may have shared the rows left among more ranks: the end is sooner.
                n = min(every, self.state.end_step - self.state.step)
                if n <= 0:
                    return Finishing(None, attempt=s.finishing)
                if self.state.ready < n:
                    try:
                        self.ranks.prepare(self.ranks.live(), n)
                    except RankFailed as e:  # bad input, or the end of the data
                        return Finishing(e.cause, attempt=s.finishing)
                    self.apply(Prepared(n))
                s.inflight.append(self._dispatch(self.state.step, n, t0=s.t0))
            dispatched = s.inflight.popleft()
            result = self.recovery.collect(dispatched, meanwhile=self._start_placed)
        except RankCallError as e:
            result = self.recovery.probe(e)  # a rank or node died during a control call
        if result.failed:
            self.recovery.settle_queued(s.inflight, result)
            return self._recover(result, Running(finishing=s.finishing))
        # The interval's share of the timeline ends here; the next one's starts here.
        end = self.clock.perf_counter()
        reports = [result.reports[r] for r in sorted(result.reports)]
        step = max(r.step for r in reports)
        self.apply(Prepared(min(r.ready for r in reports)))  # batches held beyond ``step``
        s.stop = next((r.stop for r in reports if r.stop is not None), s.stop)
        self.boundary.observe(reports)  # a persistent straggler is evicted at a boundary
        if s.inflight:
            s.inflight[0] = dataclasses.replace(
                s.inflight[0], t0=end, started=self.clock.monotonic()
            )
        self._top_up(s.inflight, step)
        self.ranks.account(reports)
        return AtBoundary(s, reports, wall_s=end - dispatched.t0, end=end, waited_s=result.waited_s)

    def _at_boundary(self, b: AtBoundary) -> JobLoopState:
        """After an interval: its metrics row, the held-out evaluation and early stopping when
        due, then a checkpoint when due (nothing queued, training goes on)."""
        s, every = b.running, self.settings.log_every
        if b.recovered:
            self.apply(Prepared(0))  # recovery may have re-opened the ranks' feeds
            b.recovered = False
        held_out = None
        if not b.evaluated and not s.inflight and s.stop is None:
            b.evaluated = True
            try:
                held_out = self._evaluate()
            except RankCallError as e:
                # The evaluation waits for the next boundary where it is due.
                return self._lost(e, dataclasses.replace(b, recovered=True))
        metrics = merge_metric_states([r.metrics for r in b.reports if r.metrics is not None])
        assert self._train_start is not None and self._loop_timer is not None
        row = aggregate_interval(
            b.reports,
            wall_s=b.wall_s,
            generation=self.state.membership.generation,
            gangs=self.state.membership.num_gangs,
            elapsed_s=b.end - self._train_start,
            auc=metrics.auc,
            ne=metrics.ne,
            at=self._now(),
            coordinator=self._loop_timer.lap(b.end, waited_s=b.waited_s),
        )
        row = dataclasses.replace(row, end_step=self.state.end_step)
        if held_out is not None:
            row = dataclasses.replace(
                row,
                eval_auc=held_out.auc,
                eval_ne=held_out.ne,
                eval_log_loss=held_out.log_loss,
                eval_rows=held_out.rows,
            )
        with self._lock:
            self._history.append(row)
        if held_out is not None:
            early = self._early_stop()
            if early is not None:
                return Finishing(EarlyStopped(early.reason), attempt=s.finishing)  # nothing queued
        going_on = s.stop is None or self.state.ready >= min(
            every, self.state.end_step - self.state.step
        )
        if not s.inflight and going_on and self.state.step < self.state.end_step:
            try:
                self._checkpoint()
            except RankCallError as e:
                # What was due waits for the next boundary where it is.
                return self._lost(e, Running(stop=s.stop, finishing=s.finishing))
        return s

    def _waiting(self, w: Waiting) -> JobLoopState:
        """Below ``elastic.min_gangs`` training pauses until gangs join, for as long as the
        :class:`Wait` decided says (then a :class:`Fail`); a stop asked meanwhile ends it."""
        self.clock.sleep(self.settings.elastic.poll_s)
        try:
            self._admit()
        except RankCallError as e:  # nothing is in flight while the job waits
            return self._lost(e, Running(finishing=w.running.finishing))
        seen = Observations(waiting_since=w.since, stop_requested=self.boundary.stop.is_set())
        wait = self._wait_for_gangs(seen, first=False)
        if wait is not None:
            return wait if isinstance(wait, Failed) else w
        w.running.waited = True
        return w.running

    def _wait_for_gangs(self, seen: Observations, *, first: bool) -> Wait | Failed | None:
        """None when training goes on (:class:`Continue` or :class:`Stop`), else the
        :class:`Wait` for gangs decided (``first``: the wait starts: an event says so and more
        placement is asked for), or the job failed at the wait's deadline."""
        (decision, *_) = self.decide(seen, self._now())
        match decision:
            case Continue() | Stop():
                return None
            case Fail():
                self.events.append(
                    JobFailed(at=self._now(), step=self.state.step, reason=decision.reason)
                )
                return Failed(JobFailedError(decision.reason))
            case Wait():
                if first:
                    self.events.append(
                        ResourcesWaited(
                            at=self._now(),
                            step=self.state.step,
                            live_gangs=self.state.membership.num_gangs,
                            min_gangs=self.settings.elastic.min_gangs,
                            deadline=decision.deadline,
                        )
                    )
                    self.growth.request()
                return decision
        raise AssertionError(f"not a decision about the wait for gangs: {decision!r}")

    def _stopping(self, *, asked: Callable[[], bool], data_stop: str | None = None) -> Stop | None:
        """The :class:`Stop` decided here, if any: ``data_stop`` (why a rank could not prepare
        what is next), else ``asked()`` (a stop was requested; asked only then)."""
        seen = Observations(data_stop=data_stop, stop_requested=data_stop is None and asked())
        (decision, *_) = self.decide(seen)
        return decision if isinstance(decision, Stop) else None

    def _drain_due(self) -> bool:
        """Whether a drain would run at the next boundary (the request is left in place)."""
        (decision, *_) = self.decide(self.boundary.drain_seen(take=False))
        return isinstance(decision, Drain)

    def _drain(self) -> None:
        """Takes what is asked to be given back and carries out the :class:`Drain` decided (a
        persistent straggler's eviction among them: the runs of slow intervals start over)."""
        for decision in self.decide(self.boundary.drain_seen(take=True)):
            if isinstance(decision, Drain):
                self.drains.apply(decision)
                if decision.straggler is not None:
                    self.boundary.stragglers = StragglerWatch()

    def _admit(self) -> None:
        """Starts building the gangs whose placement became ready, and joins the built ones as
        the :class:`Grow` decided says."""
        self.growth.start_ready()
        built = self.growth.built()
        if not built:
            return
        for decision in self.decide(Observations(built=tuple(b.gang for b in built))):
            if isinstance(decision, Grow):
                self.growth.join(built, decision)

    def _start_placed(self) -> None:
        """While an interval runs: starts building the gangs whose placement became ready (their
        ranks' process start, imports and build take seconds, an interval may take longer).
        They join at a boundary (:meth:`_admit`). With a stop or a drain asked, the boundary
        comes first, as there (a drain gives back the placement beyond its new cap)."""
        if self.growth.pending and not self.boundary.stop_asked() and not self._drain_due():
            self.growth.start_ready()

    def _evaluate(self) -> Any:
        """Runs the held-out evaluation when one is due here."""
        if self.evaluation is None:
            return None
        if not any(isinstance(d, Evaluate) for d in self.decide(Observations(evaluate=True))):
            return None
        return self.evaluation.run()

    def _early_stop(self) -> Stop | None:
        """The early stop decided after an evaluation, if any (recorded by the evaluation)."""
        if self.evaluation is None:
            return None
        for decision in self.decide(Observations(evaluated=True)):
            if isinstance(decision, Stop):
                self.evaluation.early_stopped(decision)
                return decision
        return None

    def _save_if_due(self, seen: Observations) -> None:
        """Saves a checkpoint when the :class:`Checkpoint` decision says so."""
        if any(isinstance(d, Checkpoint) for d in self.decide(seen)):
            self.apply(self.checkpoints.save())

    def _checkpoint(self) -> None:
        """Saves a checkpoint, then publishes the model, when due here."""
        self._save_if_due(Observations(save=True))
        self.boundary.publish()

    def _top_up(self, inflight: deque[Dispatched], step: int) -> None:
        """Queues the intervals :func:`~raytrec.elastic.control.intervals_to_queue` allows
        behind the one running. ``step``: where the last interval collected ended."""
        boundary = Boundary(
            step=step,
            end_step=self.state.end_step,
            every=self.settings.log_every,
            depth=self._depth,
            ready=self.state.ready,
            work_at_boundary=bool(self.growth.pending or self.growth.building)
            or self.boundary.stop_asked()
            or self._drain_due()
            or (self.data_growth is not None and self.data_growth.due()),
            live_gangs=self.state.membership.num_gangs,
            min_gangs=self.settings.elastic.min_gangs,
        )
        end = inflight[-1].end if inflight else None
        for start, n in intervals_to_queue(boundary, end, len(inflight), self.boundary.work_due):
            after = inflight[-1].seq if inflight else None
            inflight.append(self._dispatch(start, n, after=after))

    def _dispatch(
        self, start: int, n: int, *, t0: float | None = None, after: int | None = None
    ) -> Dispatched:
        """Sends ``train`` for the ``n`` steps from ``start`` to every live rank, asking each to
        prepare the batches of the next ``_depth`` intervals after it. ``after``: the call it
        is queued behind, still running. ``t0``: where the interval's wall-clock time starts
        (default: now; an interval sent early starts when the one before it is collected)."""
        self._seq += 1
        ready = min(self._depth * self.settings.log_every, self.state.end_step - start - n)
        ranks = self.ranks.live()
        now = self.clock.monotonic()
        if after is None:
            self.recovery.quiet_since(ranks, now)  # nothing was running
        seq = self._seq
        refs = self.group.call(ranks, lambda w, _r: w.train(n, ready, seq=seq, after=after))
        return Dispatched(
            n=n,
            end=start + n,
            seq=self._seq,
            refs=refs,
            t0=self.clock.perf_counter() if t0 is None else t0,
            started=now,
        )


class LoopTimer:
    """The coordinator loop's time from one history row to the next (:class:`CoordinatorTime`):
    wall-clock time between the ends it is given (``since``: where the first row's time starts,
    on the loop's ``perf_counter``), and its thread's CPU time by ``cpu``."""

    def __init__(self, *, since: float, cpu: Callable[[], float] = time.thread_time) -> None:
        self.cpu = cpu
        self.last, self.last_cpu = since, cpu()

    def lap(self, end: float, *, waited_s: float) -> CoordinatorTime:
        """The time up to ``end``, of which ``waited_s`` waiting for the ranks' reports; the
        next lap starts there."""
        cpu = self.cpu()
        out = CoordinatorTime(loop_s=end - self.last, waited_s=waited_s, cpu_s=cpu - self.last_cpu)
        self.last, self.last_cpu = end, cpu
        return out
