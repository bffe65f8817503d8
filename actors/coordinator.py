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

The job runs as one loop over explicit states (:mod:`actors.job_loop`, the states in
:mod:`actors.job_states`): each step gathers observations, asks the one pure decision function,
:func:`raytrec.elastic.boundary.decide`, and has the part that owns it carry the decision (a value
of :mod:`raytrec.elastic.decisions`) out; a failed rank call anywhere returns a ``Recovering``
state to the loop. This class builds those parts, answers the driver's queries while the loop
runs, and applies the parts' outcomes to the job's shared record (:meth:`apply`). The live
ranks' plumbing (building, forming a generation, booking, syncing) is :mod:`actors.job_ranks`.

Every failure, generation, heal and resize is an event (:mod:`raytrec.elastic.events`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from torchrec.distributed.types import ShardingPlan

from actors.boundary_work import BoundaryWork
from actors.checkpoints import JobCheckpoints
from actors.coordinator_journal import CoordinatorJournal
from actors.data_growth import DataGrowth
from actors.drain import GangDrain
from actors.evaluation import JobEvaluation
from actors.gang_placement import JobPlacement, RankTemplate
from actors.growth import GangGrowth
from actors.job import JobRecord, Outcome, apply_outcome
from actors.job_loop import JobLoop
from actors.job_ranks import ControlCalls, JobRanks
from actors.job_training import LoopSettings
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
from raytrec.elastic.control import queue_depth
from raytrec.elastic.events import Event, EventLog
from raytrec.elastic.membership import Membership
from raytrec.elastic.rank_protocol import StateDigest
from raytrec.elastic.report import RankInfo
from raytrec.elastic.run_record import RunSummary
from raytrec.elastic.workers import Clock, SystemClock, WorkerGroup
from raytrec.engine.rank_engine import RENDEZVOUS_TIMEOUT_S, StoreAddress
from raytrec.errors import JobFailedError
from raytrec.eval_plan import EvalPlan
from raytrec.models import ModelFactory, build_dlrm
from raytrec.observability.metrics import IntervalMetrics

__all__ = ["Coordinator", "JobFailedError", "RunSummary"]


class Coordinator(JobLoop):
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
        clock_origin: float | None = None,  # the clock's monotonic time its times count from
    ) -> None:
        in_process = group is not None  # a fake group of the tests' or the simulation's
        if group is None:
            from actors.worker_group import RayWorkerGroup

            group = RayWorkerGroup()
        self.group: WorkerGroup = group
        self.clock: Clock = clock or SystemClock()
        if config.num_steps is None:
            raise ValueError("the coordinator needs a resolved num_steps (raytrec.data.length)")
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
        # What the loop reads of the config (actors/job_training.py).
        self.settings = LoopSettings(
            log_every=config.log_every,
            sync_every=config.sync.sync_every,
            epochs=config.data.epochs,
            elastic=config.elastic,
            checkpoint=config.checkpoint,
        )
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
        # Event and row times count from clock_origin: the driver's, so that a loss of this
        # coordinator it books is on the clock of this one's rows (raytrec.restarts).
        self._t0 = self.clock.monotonic() if clock_origin is None else clock_origin
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
            sync=config.sync,
            calls=self.calls,
            nodes=self.nodes,
            events=self.events,
            now=self._now,
            apply=self.apply,
            after_generation=self._read_held_out_ahead,
        )
        self.placement = JobPlacement(
            self.ports,
            run_dir=run_dir,
            scaling=config.scaling,
            elastic=config.elastic,
            ranks=RankTemplate(
                config=config,  # a rank reads most of it (docs/design-notes.md)
                plan=plan,
                num_dense=num_dense,
                model_factory=model_factory,
                features=features,
                timeout_s=config.elastic.collective_timeout_s,
            ),
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
            elastic=config.elastic,
            scaling=config.scaling,
            log_every=config.log_every,
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
            request_job=self.placement.request_job,
            gangs_to_place=self.placement.gangs_to_place,
            shutdown=self.shutdown,
            request_growth=self.growth.request,
        )
        self.recovery = FailureRecovery(
            self.ports,
            elastic=config.elastic,
            sync=config.sync,
            group=self.group,
            placement=self.placement,
            nodes=self.nodes,
            streams=self.streams,
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
        # What the loop observes at a boundary, and the model published there.
        self.boundary = BoundaryWork(
            self.state,
            elastic=config.elastic,
            publish=config.publish,
            run_dir=run_dir,
            clock=self.clock,
            job_state=self.job_state,
            drains=self.drains,
            nodes=self.nodes,
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

    # -- end of job ---------------------------------------------------------------------------

    def apply(self, outcome: Outcome) -> None:
        """Applies a part's outcome to the job's shared state (:func:`actors.job.apply_outcome`)."""
        apply_outcome(self.state, outcome)
        self.journal.applied(outcome, self.state)

    def _read_held_out_ahead(self) -> None:
        """After each new generation: the held-out batches of the next evaluation, read ahead."""
        if self.evaluation is not None:
            self.evaluation.read_ahead()

    def _now(self) -> float:
        return self._at(self.clock.monotonic())

    def _at(self, monotonic: float) -> float:
        """The clock's ``monotonic`` time as the event log's time (seconds since the start)."""
        return round(monotonic - self._t0, 3)

    def shutdown(self) -> None:
        """Ends every rank actor and releases every placement group, pending ones included."""
        self.placement.shutdown()
        self.growth.shutdown()
