"""The coordinator: places gangs, hosts the rendezvous store and drives training elastically.

A plain class, made a Ray actor only at the launch site (:func:`raytrec.api.fit`). It hosts the
job's ``TCPStore``, places one placement group per gang, starts one :class:`~actors.rank.RankWorker`
per rank and trains in intervals of ``log_every`` steps, one metrics row per interval.

Elasticity, at interval granularity:

- **Loss** (:mod:`actors.recovery`). A dead rank fails its interval call at once; a hung one
  finishes no step for ``elastic.step_timeout_s``. The gangs that lost a rank are dropped, the
  survivors' replica planes aborted, what they trained collected, and a new generation formed
  among them; the lost gang's unsynced batches go back to them.
- **Growth** (:mod:`actors.growth`). One pending placement group per gang the job could still
  add; a gang whose group is ready is built in the background and joins at the next boundary,
  healed from a live peer.
- **Drains** (:mod:`actors.drain`) give gangs back at a boundary, without losing a row.
- **Total loss** (:mod:`actors.total_loss`). When some shard has no live copy left, the job is
  rebuilt from its last checkpoint; without one it fails.

Every decision is a value of one union (:mod:`raytrec.elastic.decisions`) returned by one pure
function, :func:`raytrec.elastic.boundary.decide`, called at each boundary of the loop with the
job's state and what was observed there; :mod:`actors.boundary_work` gathers the observations
and carries the decisions out (a ``match`` on the union). The live ranks' plumbing (building,
forming a generation, booking, syncing) is :mod:`actors.job_ranks`.

Every failure, generation, heal and resize is an event (:mod:`raytrec.elastic.events`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import deque
from typing import Any

from torchrec.distributed.types import ShardingPlan

from actors.boundary_work import BoundaryWork
from actors.checkpoints import JobCheckpoints
from actors.control_calls import ControlCalls
from actors.coordinator_journal import CoordinatorJournal
from actors.data_growth import DataGrowth
from actors.drain import GangDrain
from actors.evaluation import JobEvaluation
from actors.gang_placement import JobPlacement
from actors.growth import GangGrowth
from actors.interval import Dispatched, IntervalOutcome, LoopTimer
from actors.job import Committed, JobRecord, Outcome, Prepared, apply_outcome
from actors.job_ranks import JobRanks
from actors.nodes import JobNodes
from actors.ports import JobPorts
from actors.recovery import FailureRecovery
from actors.reshare import DataStreams, StreamTable
from actors.total_loss import TotalLossRecovery
from raytrec.config import TrainConfig
from raytrec.data.parquet_indexed import IndexedParquetShard
from raytrec.data.source import BatchShard
from raytrec.data.spec import FeatureSpec
from raytrec.data.synthetic import batch_id
from raytrec.elastic.accounting import BatchAccounting
from raytrec.elastic.boundary import MAX_TRANSIENT, Observations
from raytrec.elastic.control import Boundary, intervals_to_queue, queue_depth
from raytrec.elastic.events import Event, EventLog
from raytrec.elastic.membership import Membership
from raytrec.elastic.rank_protocol import StateDigest
from raytrec.elastic.report import RankInfo
from raytrec.elastic.run_record import RunSummary
from raytrec.elastic.workers import Clock, RankCallError, RankFailed, SystemClock, WorkerGroup
from raytrec.engine.rank_engine import RENDEZVOUS_TIMEOUT_S, StoreAddress
from raytrec.errors import ConfigError, EarlyStopped, JobFailedError, StopRequested
from raytrec.eval_plan import EvalPlan
from raytrec.models import ModelFactory, build_dlrm
from raytrec.observability.metrics import IntervalMetrics, aggregate_interval
from raytrec.observability.rec_metrics import merge_metric_states

__all__ = ["Coordinator", "JobFailedError", "RunSummary"]


class Coordinator:
    """Owns the job's membership, store and training loop."""

    # Parts the ports below reach lazily (they are built after the ports).
    ranks: JobRanks
    boundary: BoundaryWork
    recovery: FailureRecovery

    def __init__(
        self,
        config: TrainConfig,
        plan: ShardingPlan,
        shards: list[BatchShard],
        num_dense: int,
        run_dir: str,
        model_factory: ModelFactory = build_dlrm,
        new_shard: Any = None,
        resume_from: str | None = None,
        evaluation: tuple[Any, EvalPlan] | None = None,
        group: WorkerGroup | None = None,
        clock: Clock | None = None,
        features: FeatureSpec | None = None,
        init_from: str | None = None,  # a checkpoint whose model (only) to start from
        data_fingerprint: dict[str, Any] | None = None,  # recorded in every checkpoint
    ) -> None:
        in_process = group is not None  # a fake group of the tests' or the simulation's
        if group is None:
            from actors.worker_group import RayWorkerGroup

            group = RayWorkerGroup()
        self.group: WorkerGroup = group
        self.clock: Clock = clock or SystemClock()
        if config.num_steps is None:
            raise ValueError("the coordinator needs a resolved num_steps (raytrec.data.length)")
        self.cfg = config
        self.num_steps: int = config.num_steps
        self.plan = plan
        # Parquet read by index: each rank's first num_steps batches, re-shared (actors/reshare.py)
        table: StreamTable | None = None
        indexed = [s for s in shards if isinstance(s, IndexedParquetShard)]
        if shards and len(indexed) == len(shards):
            limited = [dataclasses.replace(s, limit=self.num_steps) for s in indexed]
            table = StreamTable(limited[0], batch_size=config.data.batch_size)
            shards = list(limited)
            new_shard = table.placeholder
        self.shards = shards
        self.num_dense = num_dense
        self.run_dir = run_dir
        self.model_factory = model_factory
        self.new_shard = new_shard  # job rank -> BatchShard, for gangs that join later
        self.resume_from = resume_from  # a checkpoint to start from
        self.features = features  # the row layout trained on, saved with the model
        self.elastic = config.elastic
        self.topology = config.scaling.topology()
        replayable = all(s.replayable for s in shards)
        self._stream_id = batch_id if replayable else None
        membership = Membership.initial(self.topology)
        # The state the job's parts share (actors/job.py): only the loop changes it (apply).
        self.state = JobRecord(
            membership=membership,
            step=0,
            # The step the job's data ends at: num_steps, or for a re-shared source the end of
            # its rows (earlier when the data holds fewer batches, later after a gang is lost).
            end_step=self.num_steps if table is None else min(self.num_steps, table.length(0)),
            max_gangs=self.elastic.resolved_max_gangs(self.topology.num_gangs),
            accounting=BatchAccounting(
                membership.gang_ids, stream_id=self._stream_id, batch_size=config.data.batch_size
            ),
            last_save=(0, self.clock.monotonic()),
        )
        self.first_batch_s = 0.0
        # Commits, generations, checkpoints, re-shares, durably for a coordinator taking over
        # this run (in process, with nothing to lose, without an fsync each).
        self.journal = CoordinatorJournal(
            run_dir, faults=config.testing.fault_plan, resume_from=resume_from, fsync=not in_process
        )
        self.events = EventLog()
        self._t0 = self.clock.monotonic()
        self._started = self.clock.perf_counter()  # run() sets it again as it starts
        self._history: list[IntervalMetrics] = []
        self._lock = threading.Lock()
        self._store_address: StoreAddress | None = None
        self._seq = 0  # the last train call's number
        self._depth = queue_depth(config.sync)  # intervals in flight at once
        # Control calls wait for every rank (building a gang, or a pipeline's first batches).
        self.calls = ControlCalls(
            self.group,
            self.clock,
            timeout_s=max(self.elastic.step_timeout_s, RENDEZVOUS_TIMEOUT_S),
            on_lost=lambda rank, pending: self.recovery.release(rank, pending),
        )
        self._call, self.answers = self.calls.call, self.calls.answers
        # The parts of the job with state of their own, each in its module: where the ranks
        # run, where they read, gangs being added, drains, failures, the rebuild after a total
        # loss, and checkpoints. They get these ports (not the coordinator) and the peers they
        # call; what they change in self.state are outcomes that self.apply applies. The
        # decisions they carry out are made in raytrec.elastic.
        self.ports = JobPorts(
            call=self._call,
            live_ranks=lambda: self.ranks.live(),
            gang_of=lambda rank: self.ranks.gang_of(rank),
            step=lambda: self.state.step,
            sync=lambda: self.ranks.sync_unless_synced(),
            record=self.events.append,
            now=self._now,
            clock=self.clock,
            cluster_nodes=self.group.nodes,
            view=self.state,
            apply=self.apply,
            answers=self.answers,
            build=lambda ranks: self.ranks.build(ranks),
            new_generation=lambda reason, before=None: self.ranks.new_generation(reason, before),
            account=lambda reports, completed_through=None: self.ranks.account(
                reports, completed_through=completed_through
            ),
            ranks_in_gang_order=lambda: self.ranks.in_gang_order(),
            at=self._at,
            job_state=lambda: self.boundary.job_state(),
            stop_asked=lambda: self.boundary.stop_asked(),
            sync_plan=lambda: self.ranks.joined_plan(),
        )
        # Held-out evaluation (raytrec.eval_plan): its shard and plan, when configured.
        self.evaluation = (
            None
            if evaluation is None
            else JobEvaluation(*evaluation, config=config.eval, job=self.ports)
        )
        self.nodes = JobNodes(self.ports)
        self.ranks = JobRanks(
            self.state,
            config=config,
            calls=self.calls,
            nodes=self.nodes,
            events=self.events,
            now=self._now,
            apply=self.apply,
        )
        self.placement = JobPlacement(
            self.ports,
            run_dir=run_dir,
            config=config,
            plan=plan,
            num_dense=num_dense,
            model_factory=model_factory,
            features=features,
            store=lambda: self._store_address,
            group=self.group,
            nodes=self.nodes,
        )
        self.streams = DataStreams(
            self.ports,
            table,
            shards=shards,
            new_shard=new_shard,
            stream_id=self._stream_id,
            batch_size=config.data.batch_size,
        )
        self.data_growth = DataGrowth.of(self.ports, self.streams, config.data)  # data.growing
        self.growth = GangGrowth(
            self.ports,
            config=config,
            group=self.group,
            placement=self.placement,
            nodes=self.nodes,
            streams=self.streams,
            new_shard=new_shard,
        )
        self.drains = GangDrain(
            self.ports,
            run_dir=run_dir,
            streams=self.streams,
            draining_nodes=self.group.draining_nodes,
            kill_gang=self.placement.kill_gang,
            fit_growth=self.growth.fit_to_cap,
            request_growth=self.growth.request,
        )
        self.total_loss = TotalLossRecovery(
            self.ports,
            topology=self.topology,
            streams=self.streams,
            nodes=self.nodes,
            place_job=self.placement.place_job,
            shutdown=self.shutdown,
            request_growth=self.growth.request,
        )
        self.recovery = FailureRecovery(
            self.ports,
            config=config,
            group=self.group,
            placement=self.placement,
            nodes=self.nodes,
            streams=self.streams,
            total_loss=self.total_loss,
            request_growth=self.growth.request,
        )
        self.checkpoints = JobCheckpoints(
            self.ports,
            run_dir=run_dir,
            config=config.checkpoint,
            streams=self.streams,
            progress=self.progress,
            data=data_fingerprint,
            init_from=init_from,
        )
        # What the loop does at a boundary: the decisions made there, carried out.
        self.boundary = BoundaryWork(
            self.state,
            config=config,
            run_dir=run_dir,
            replayable=self._stream_id is not None,
            clock=self.clock,
            events=self.events,
            apply=self.apply,
            now=self._now,
            recovery=self.recovery,
            growth=self.growth,
            drains=self.drains,
            nodes=self.nodes,
            checkpoints=self.checkpoints,
            evaluation=self.evaluation,
            ports=self.ports,
        )

    # -- queries (answered while run() is in progress) ----------------------

    def progress(self, since: int = 0) -> list[IntervalMetrics]:
        with self._lock:
            return list(self._history[since:])

    def events_since(self, since: int = 0) -> tuple[Event, ...]:
        """The events from the ``since``-th on (the driver polls them as they come)."""
        return self.events[since:]

    def request_stop(self) -> None:
        """Asks the job to stop at the next interval boundary (answered while run() runs): it
        syncs, checkpoints when checkpoints are configured, and saves the final model."""
        self.boundary.stop.set()

    def store_address(self) -> StoreAddress | None:
        """Where the job's rendezvous store listens, with the job's secret (for tests and
        diagnostics; the ranks are handed it in their spec)."""
        return self._store_address

    def rank_nodes(self) -> dict[int, str]:
        """Job rank -> the Ray node id it runs on (live ranks)."""
        return dict(self.nodes.of_rank)

    # -- the job --------------------------------------------------------------

    def start(self) -> list[RankInfo]:
        """Hosts the store, places every gang, starts and builds the rank actors."""
        self._store_address = self.group.host_store()
        starts = self.checkpoints.resume_streams(self.resume_from)

        def shard_of(rank: int) -> Any:
            return (
                self.shards[rank] if starts is None else self.streams.shard_of(starts[rank].shard)
            )

        refused = self.placement.place_job(self.state.membership.gangs, shard_of)
        if refused is not None:
            raise ConfigError(refused)
        if self.resume_from is not None or self.checkpoints.init_from is not None:
            started = sorted(self.placement.started)
            self.checkpoints.start_from(self.resume_from, starts, started, self.total_loss.recover)
            self.growth.request()
            return sorted((self.ranks.infos[r] for r in self.ranks.live()), key=lambda x: x.rank)
        # A rank lost while the job starts is a loss like any other: its gang is dropped and
        # the others start on (or, with no gang left, the job fails as a total loss does).
        for _ in range(self.state.max_gangs + 2):
            try:
                if self.state.membership.generation == 0 and not self.ranks.infos:
                    self.ranks.build(sorted(self.placement.started))
                    self.ranks.new_generation("job started")
                self._call(self.ranks.live(), lambda w, _r: w.broadcast_state(0))  # gang 0's state
                differ = self.recovery.start_copies_differ()
                if not differ:
                    break
                # A gang whose copy of gang 0's state came out different is dropped (and
                # replaced), as a join's that does not heal is.
                self.recovery.recover_until_stable(IntervalOutcome(dead=differ))
            except RankCallError as e:
                self.recovery.recover_until_stable(self.recovery.probe(e))
        else:
            raise JobFailedError("the job kept losing ranks while it started")
        self.growth.request()
        return sorted((self.ranks.infos[r] for r in self.ranks.live()), key=lambda x: x.rank)

    def run(self) -> RunSummary:
        """Trains ``num_steps`` steps and writes the final model; returns the summary.

        A rank trains an interval only with all of its batches in memory, and it prepares the
        next interval's batches before it reports the current one; so bad input or the end of
        a rank's data surfaces between steps, before any rank enters the next interval's
        collectives. Training stops there, and the model trained so far is synced, checked and
        saved like a finished one (``RunSummary.stopped_by`` says why).
        """
        clock = self.clock
        self._started = clock.perf_counter()
        ranks = self.start()
        stopped_by: BaseException | None = None
        every = self.cfg.log_every
        t0 = clock.perf_counter()
        prepared = True
        try:
            n = min(every, self.state.end_step - self.state.step)  # a resume starts at its step
            self._call(self.ranks.live(), lambda w, _r: w.prepare(n, first=True))
        except RankFailed as e:
            stopped_by = e.cause
        except RankCallError as e:  # a rank lost (or stuck) before the first step
            self.recovery.recover_until_stable(self.recovery.probe(e))
            prepared = False
        self.first_batch_s = clock.perf_counter() - t0
        train_start = clock.perf_counter()
        if stopped_by is None:
            stopped_by = self._train(prepared=prepared, train_start=train_start)
        # A job stopped before its first step trained nothing: no model to save.
        trained = stopped_by is None or self.state.step > 0
        final = os.path.join(self.run_dir, "final_model") if trained else None
        for _ in range(MAX_TRANSIENT + 1):
            try:
                # A growing source's job ended by its rules is saved as a stopped one: resumable.
                grown = self.data_growth is not None and self.data_growth.ended is not None
                stopping = grown or isinstance(stopped_by, StopRequested | EarlyStopped)
                digests = self._finish(
                    final, checkpoint=stopped_by is None or stopping, stopping=stopping
                )
                break
            except RankCallError as e:  # lost at the very end: re-form, and train on if rebuilt
                self.recovery.recover_until_stable(self.recovery.probe(e))  # from a checkpoint
                if stopped_by is None and self.state.step < self.state.end_step:
                    stopped_by = self._train(prepared=False, train_start=train_start)
        else:
            raise JobFailedError("the job kept losing ranks while it finished")
        if stopped_by is None and self.data_growth is None:  # a growing source has no end
            stopped_by = self.streams.ran_out(self.state.step, self.num_steps, self.cfg.data.epochs)
        return self._summary(final=final, digests=digests, stopped_by=stopped_by, ranks=ranks)

    def summary_so_far(self) -> RunSummary:
        """What the job committed up to now, for a job whose :meth:`run` raised: its history,
        events, committed batches and rows and last checkpoint (what it can resume from)."""
        return self._summary(final=None, digests={}, stopped_by=None, ranks=[])

    def _summary(
        self,
        *,
        final: str | None,
        digests: dict[int, StateDigest],
        stopped_by: BaseException | None,
        ranks: list[RankInfo],
    ) -> RunSummary:
        acc, table = self.state.accounting, self.streams.table
        return RunSummary(
            history=self.progress(),
            final_state_path=final,
            steps=self.state.step,
            wall_s=self.clock.perf_counter() - self._started,
            ranks=ranks,
            state_digests=digests,
            stopped_by=stopped_by,
            first_batch_s=self.first_batch_s,
            events=EventLog(self.events),  # a copy: the job's own log goes on
            generation=self.state.membership.generation,
            committed_batches=acc.committed(),
            committed_count=acc.committed_count(),
            committed_rows=acc.committed_rows if self._stream_id is not None else None,
            replayed_batches=acc.replayed(),
            lost_batches=acc.lost_batches + acc.replay_pending(),
            checkpoint=self.checkpoints.last,
            reshared_streams=None if table is None else table.to_json(),
        )

    def _train(self, *, prepared: bool, train_start: float) -> BaseException | None:
        """Trains interval by interval up to ``num_steps``, recovering from failures; returns
        what stopped training early (bad input, the end of the data), else None. ``prepared``:
        the live ranks hold the next interval's batches already.

        While an interval runs, the next one is already queued on the ranks when nothing has
        to happen at the boundary between them (:meth:`_top_up`), so a rank goes from one to
        the next without waiting for the coordinator; its report is booked while the ranks
        train on."""
        every = self.cfg.log_every
        stopped_by: BaseException | None = None
        stop: BaseException | None = None  # a rank could not prepare all it was asked to
        self.apply(Prepared(min(every, self.state.end_step - self.state.step) if prepared else 0))
        inflight: deque[Dispatched] = deque()  # sent, in order; the first one is running
        loop = LoopTimer(since=train_start)  # the coordinator's own time, row to row
        growing = self.data_growth  # a growing source's job waits for files at the data's end
        while stopped_by is None and (self.state.step < self.state.end_step or growing is not None):
            try:
                if not inflight:
                    t0 = self.clock.perf_counter()  # the interval's time includes what precedes it
                    n = min(every, self.state.end_step - self.state.step)
                    # Bad input, or the end of the data, in what is next; else a user's request.
                    data_stop = str(stop) if stop is not None and self.state.ready < n else None
                    halt = self.boundary.stopping(
                        data_stop=data_stop, asked=self.boundary.stop_asked
                    )
                    if halt is not None:
                        stopped_by = stop if halt.cause == "data" else StopRequested(halt.reason)
                        break
                    self.nodes.report_late_deaths()
                    self.boundary.drain()
                    self.boundary.admit()
                    self.boundary.wait_for_gangs()
                    # Asked while it waited:
                    halt = self.boundary.stopping(asked=self.boundary.stop.is_set)
                    if halt is not None:
                        stopped_by = StopRequested(halt.reason)
                        break
                    if growing is not None and not growing.boundary():  # waited, or ended
                        if growing.ended is not None:
                            break
                        continue
                    # A join may have shared the rows left among more ranks: the end is sooner.
                    n = min(every, self.state.end_step - self.state.step)
                    if n <= 0:
                        break
                    if self.state.ready < n:
                        try:
                            self.ranks.prepare(self.ranks.live(), n)
                        except RankFailed as e:
                            stopped_by = e.cause  # bad input, or the end of the data
                            break
                        self.apply(Prepared(n))
                    inflight.append(self._dispatch(self.state.step, n, t0=t0))
                dispatched = inflight.popleft()
                result = self.recovery.collect(dispatched)
            except RankCallError as e:
                result = self.recovery.probe(e)  # a rank or node died during a control call
            if result.failed:
                self.recovery.settle_queued(inflight, result)
                self.recovery.recover_until_stable(result)
                self.apply(Prepared(0))  # recovery may have re-opened the ranks' feeds
                stop = None
                continue
            # The interval's share of the timeline ends here; the next one's starts here.
            end = self.clock.perf_counter()
            reports = [result.reports[r] for r in sorted(result.reports)]
            step = max(r.step for r in reports)
            self.apply(Prepared(min(r.ready for r in reports)))  # batches held beyond ``step``
            stop = next((r.stop for r in reports if r.stop is not None), stop)
            self.boundary.observe(reports)  # a persistent straggler is evicted at a boundary
            if inflight:
                inflight[0] = dataclasses.replace(
                    inflight[0], t0=end, started=self.clock.monotonic()
                )
            self._top_up(inflight, step)
            self.ranks.account(reports)
            metrics = merge_metric_states([r.metrics for r in reports if r.metrics is not None])
            held_out = self.boundary.evaluate() if not inflight and stop is None else None
            row = aggregate_interval(
                reports,
                wall_s=end - dispatched.t0,
                generation=self.state.membership.generation,
                gangs=self.state.membership.num_gangs,
                elapsed_s=end - train_start,
                auc=metrics.auc,
                ne=metrics.ne,
                at=self._now(),
                coordinator=loop.lap(end, waited_s=result.waited_s),
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
                early = self.boundary.early_stop()
                if early is not None:
                    return EarlyStopped(early.reason)  # nothing is queued after it
            going_on = stop is None or self.state.ready >= min(
                every, self.state.end_step - self.state.step
            )
            if not inflight and going_on and self.state.step < self.state.end_step:
                self.boundary.checkpoint()
        return stopped_by

    def _top_up(self, inflight: deque[Dispatched], step: int) -> None:
        """Queues the intervals :func:`~raytrec.elastic.control.intervals_to_queue` allows
        behind the one running. ``step``: where the last interval collected ended."""
        boundary = Boundary(
            step=step,
            end_step=self.state.end_step,
            every=self.cfg.log_every,
            depth=self._depth,
            ready=self.state.ready,
            work_at_boundary=bool(self.growth.pending or self.growth.building)
            or self.boundary.stop_asked()
            or self.boundary.drain_due()
            or (self.data_growth is not None and self.data_growth.due()),
            live_gangs=self.state.membership.num_gangs,
            min_gangs=self.elastic.min_gangs,
        )
        end = inflight[-1].end if inflight else None
        for start, n in intervals_to_queue(boundary, end, len(inflight), self.boundary.work_due):
            after = inflight[-1].seq if inflight else None
            inflight.append(self._dispatch(start, n, after=after))

    def _finish(
        self, final: str | None, *, checkpoint: bool, stopping: bool = False
    ) -> dict[int, StateDigest]:
        """Ends on a job-wide sync, checks the replicas, saves the final model (none when
        ``final`` is None) and a checkpoint when the policy says so (``stopping``: the job stops
        on request)."""
        if (
            self.state.step % self.cfg.sync.sync_every
            or self.state.membership.last_sync_step != self.state.step
        ):
            # End on a sync: every replica the same.
            self._call(self.ranks.live(), lambda w, _r: w.sync())
        self.apply(Committed())
        if checkpoint:
            self.boundary.save_if_due(Observations(save=True, final=True, stopping=stopping))
        self.boundary.publish(final=True)
        digests = self.ranks.final_digests()
        if final is not None:
            first_gang = self.state.membership.gangs[0]
            self._call(list(first_gang.job_ranks), lambda w, _r: w.save(final))
        return digests

    # -- one interval -------------------------------------------------------------------------

    def _dispatch(
        self, start: int, n: int, *, t0: float | None = None, after: int | None = None
    ) -> Dispatched:
        """Sends ``train`` for the ``n`` steps from ``start`` to every live rank, asking each to
        prepare the batches of the next ``_depth`` intervals after it. ``after``: the call it
        is queued behind, still running. ``t0``: where the interval's wall-clock time starts
        (default: now; an interval sent early starts when the one before it is collected)."""
        self._seq += 1
        ready = min(self._depth * self.cfg.log_every, self.state.end_step - start - n)
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

    # -- end of job ---------------------------------------------------------------------------

    def apply(self, outcome: Outcome) -> None:
        """Applies a part's outcome to the job's shared state (:func:`actors.job.apply_outcome`)."""
        apply_outcome(self.state, outcome)
        self.journal.applied(outcome, self.state)

    def _now(self) -> float:
        return self._at(self.clock.monotonic())

    def _at(self, monotonic: float) -> float:
        """The clock's ``monotonic`` time as the event log's time (seconds since the start)."""
        return round(monotonic - self._t0, 3)

    def shutdown(self) -> None:
        """Ends every rank actor and releases every placement group, pending ones included."""
        self.placement.shutdown()
        self.growth.shutdown()
