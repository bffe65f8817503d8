"""The coordinator: places gangs, hosts the rendezvous store and drives training elastically.

A plain class, made a Ray actor only at the launch site (:func:`raytrec.api.fit`). It hosts the
job's ``TCPStore`` (every gang world and replica plane rendezvous under their own prefix in it),
creates one placement group per gang (:mod:`raytrec.placement`), starts one
:class:`~actors.rank.RankWorker` per rank and runs training in intervals of ``log_every`` steps,
recording one metrics row per interval.

Elasticity, at interval granularity:

- **Loss.** A rank actor that dies (its process, or its node) fails its interval call at once; a
  hung rank is the one still running after its peers' collectives gave up. The coordinator kills
  what is left of every gang that lost a rank, aborts the survivors' replica planes (so their
  blocked collectives fail now, not after the timeout), collects from each survivor what it
  trained (``recover``), and starts a new generation: a replica plane among the survivors, the
  sync schedule recomputed for them, and a job-wide sync that makes every replica identical. The
  batches the lost gang trained since its last sync go back to the survivors
  (:class:`~raytrec.elastic.ledger.DataLedger`, :class:`~raytrec.elastic.streams.RankStreams`).
- **Growth.** With ``elastic.grow``, the coordinator keeps one pending placement group per gang
  it could still add (up to ``elastic.max_gangs``): on an autoscaling cluster that pending demand
  is what adds nodes. A gang whose group becomes ready is built in the background while the live
  gangs train, and joins at the first interval boundary after it is built: a job-wide sync among
  the live gangs, a new generation including it, and a broadcast of the full state (shards,
  optimizer state, dense state, step) from a live peer gang (:mod:`actors.growth`).
- **Too few gangs.** Below ``elastic.min_gangs`` training pauses until placements come back, for
  at most ``elastic.resource_wait_s``, then the job fails with a message saying so.
- **Total loss.** When some shard has no live copy left, the job is rebuilt at its initial shape
  from its last checkpoint (:mod:`raytrec.elastic.rollback` decides, and plans where each rebuilt
  rank reads), with its step, data streams and batch accounting rewound to it; without a
  checkpoint it fails.

Every failure, generation, heal and resize is an event (:mod:`raytrec.elastic.events`) with its
time and step, returned in the run summary.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from torchrec.distributed.types import ShardingPlan

from actors.growth import GangGrowth
from actors.rank import RankWorker
from actors.reshare import DataStreams, StreamTable
from actors.total_loss import TotalLossRecovery
from raytrec.checkpoint.config import checkpoint_root, save_decision
from raytrec.config import ConfigError, TrainConfig
from raytrec.data.parquet_indexed import IndexedParquetShard
from raytrec.data.source import BatchShard
from raytrec.data.synthetic import batch_id
from raytrec.elastic.accounting import BatchAccounting
from raytrec.elastic.control import (
    Boundary,
    intervals_to_queue,
    retry_transient,
    survivors_apart,
)
from raytrec.elastic.drain import REQUEST_FILE, Drain, DrainRequest, decide_drain, read_request
from raytrec.elastic.events import (
    CheckpointRestored,
    CheckpointSaved,
    DrainRejected,
    EventLog,
    GangDrained,
    GangDropped,
    GenerationStarted,
    HangDetected,
    NodeDied,
    RankDied,
)
from raytrec.elastic.membership import Gang, Membership, RankSlot
from raytrec.elastic.policy import Reform, Unrecoverable, decide, find_hung_ranks
from raytrec.elastic.report import RankInfo, RankReport
from raytrec.elastic.rollback import RollbackPoint, StreamStart
from raytrec.elastic.state import ElasticState
from raytrec.elastic.workers import (
    NODE_DIED,
    Clock,
    Placement,
    RankCallError,
    RankFailed,
    RankLost,
    SystemClock,
    WorkerGroup,
)
from raytrec.engine.rank import RENDEZVOUS_TIMEOUT_S, RankSpec, StoreAddress
from raytrec.errors import JobFailedError
from raytrec.metrics import IntervalMetrics, aggregate_interval
from raytrec.model import ModelFactory, build_dlrm
from raytrec.placement import placement_specs, rank_resources
from raytrec.rec_metrics import merge_metric_states
from raytrec.sync.schedule import SyncPlan, plan_sync
from raytrec.topology import Layout

__all__ = ["Coordinator", "JobFailedError", "RunSummary"]

# How long a recovery waits for Ray's node table to show a node death it suspects.
_NODE_TABLE_GRACE_S = 5.0

# Re-forms in a row after collective timeouts with every rank alive, before the job gives up.
_MAX_TRANSIENT = 3

# Why a rank the coordinator killed itself is gone: its gang lost another rank.
_PEER_KILLED = "its gang lost a rank"
_NODE_DIED = NODE_DIED


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSummary:
    history: list[IntervalMetrics]
    final_state_path: str | None
    steps: int
    wall_s: float
    ranks: list[RankInfo]
    digests: dict[int, dict[str, str]]  # job rank -> content hashes of its final state
    # Why training stopped before num_steps (bad input, data ran out), else None. The state
    # trained up to ``steps`` is still synced, checked and saved.
    stopped_by: BaseException | None = None
    first_batch_s: float = 0.0  # until every rank held its first interval's batches
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    generation: int = 0
    # Exactly-once accounting of batches (replayable sources): ids trained into the final model
    # (committed), counted with multiplicity, and those handed to survivors for replay.
    committed_batches: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    committed_count: int = 0
    replayed_batches: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    lost_batches: int = 0  # uncommitted batches of lost gangs that could not be replayed
    checkpoint: str | None = None  # the last checkpoint this run saved
    reshared_streams: dict[str, Any] | None = None  # StreamTable.to_json() of a re-shared source


def intervals(num_steps: int, every: int) -> list[int]:
    """Splits ``num_steps`` into reporting intervals of ``every`` steps (the last may be short)."""
    full, rest = divmod(num_steps, every)
    return [every] * full + ([rest] if rest else [])


@dataclasses.dataclass(frozen=True)
class _Dispatched:
    """One interval's ``train`` calls, sent."""

    n: int  # steps
    end: int  # the step it ends at
    seq: int  # numbers the job's train calls (actors.rank.IntervalOrder)
    refs: dict[int, Any]  # job rank -> the future of its report
    t0: float  # perf_counter() where the interval's wall-clock time starts
    started: float  # monotonic() when sent: for the hang timeout


@dataclasses.dataclass
class _Interval:
    """The outcome of one interval call on every live rank."""

    reports: dict[int, RankReport] = dataclasses.field(default_factory=dict)
    dead: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> cause
    errored: dict[int, str] = dataclasses.field(default_factory=dict)
    hung: list[int] = dataclasses.field(default_factory=list)
    # Hung rank -> (the last step it finished, seconds it had been silent when found).
    silence: dict[int, tuple[int, float]] = dataclasses.field(default_factory=dict)
    # Reports of intervals queued behind the failed one that some survivors went on to train.
    later: list[RankReport] = dataclasses.field(default_factory=list)
    booked: bool = False  # recovery has booked the reports above

    @property
    def failed(self) -> bool:
        return bool(self.dead or self.errored or self.hung)


class Coordinator:
    """Owns the job's membership, store and training loop."""

    def __init__(
        self,
        config: TrainConfig,
        plan: ShardingPlan,
        shards: list[BatchShard],
        num_dense: int,
        run_dir: str,
        model_factory: ModelFactory = build_dlrm,
        placement_timeout_s: float = 300.0,
        new_shard: Any = None,
        resume_from: str | None = None,
        group: WorkerGroup | None = None,
        clock: Clock | None = None,
    ) -> None:
        if group is None:
            from actors.worker_group import RayWorkerGroup

            group = RayWorkerGroup()
        self.group: WorkerGroup = group
        self.clock: Clock = clock or SystemClock()
        self.cfg = config
        self.plan = plan
        # Parquet read by index: the job's rows are every rank's first num_steps batches, shared
        # again among the live ranks whenever the membership changes (actors/reshare.py).
        table: StreamTable | None = None
        indexed = [s for s in shards if isinstance(s, IndexedParquetShard)]
        if shards and len(indexed) == len(shards):
            limited = [dataclasses.replace(s, limit=config.num_steps) for s in indexed]
            table = StreamTable(limited[0], batch_size=config.data.batch_size)
            shards = list(limited)
            new_shard = table.placeholder
        # The parts of the job with state of their own: where ranks read, gangs being added,
        # and the rebuild after a total loss.
        self.streams = DataStreams(self, table)
        self.growth = GangGrowth(self)
        self.total_loss = TotalLossRecovery(self)
        self.shards = shards
        self.num_dense = num_dense
        self.run_dir = run_dir
        self.model_factory = model_factory
        self.placement_timeout_s = placement_timeout_s
        self.new_shard = new_shard  # job rank -> BatchShard, for gangs that join later
        self.resume_from = resume_from  # a checkpoint to start from
        self.checkpoint_root = checkpoint_root(run_dir)
        self.last_checkpoint: str | None = None
        self._last_save = (0, self.clock.monotonic())  # (step, clock) of the last save (or start)
        self.elastic = config.elastic
        self.topology = config.scaling.topology()
        self.membership = Membership.initial(self.topology)
        self.max_gangs = self.elastic.resolved_max_gangs(self.topology.num_gangs)
        self.step = 0
        # The step the job's data ends at: num_steps, or for a re-shared source the end of its
        # rows (earlier when the data holds fewer batches, later after a gang is lost).
        self.end_step = config.num_steps
        if self.streams.table is not None:
            self.end_step = min(config.num_steps, self.streams.table.length(0))
        self.first_batch_s = 0.0
        self.events = EventLog()
        self._t0 = self.clock.monotonic()
        self._history: list[IntervalMetrics] = []
        self._lock = threading.Lock()
        self._pgs: dict[int, Placement] = {}  # gang id -> its placement group
        self._started: set[int] = set()  # job ranks whose process was started and not ended
        self._rank_nodes: dict[int, str] = {}  # job rank -> Ray node id
        self._node_index: dict[str, int] = {}
        # Job rank -> (the last step it reported finishing, when the coordinator saw it): the
        # hang rule's input (raytrec.elastic.policy.find_hung_ranks).
        self._progress: dict[int, tuple[int, float]] = {}
        self._store_address: StoreAddress | None = None
        replayable = all(s.replayable for s in shards)
        self._stream_id = batch_id if replayable else None
        self.accounting = BatchAccounting(self.membership.gang_ids, stream_id=self._stream_id)
        self._transient = 0  # re-forms in a row with no rank lost
        self._seq = 0  # the last train call's number
        self._ready = 0  # batches every live rank holds prepared beyond the job's step
        # Intervals in flight at once: the running one and one queued behind it, unless the
        # gangs may drift apart between syncs (hierarchical levels with dense state synced on
        # the schedule): then a survivor of a failure could be a whole interval further on
        # than the others, and the job sends the next interval only after the last one.
        hierarchical = bool(config.sync.levels) and config.sync.dense != "every_step"
        self._depth = 1 if hierarchical else 2

    # -- queries (answered while run() is in progress) ----------------------

    def progress(self, since: int = 0) -> list[IntervalMetrics]:
        with self._lock:
            return list(self._history[since:])

    def event_dicts(self, since: int = 0) -> list[dict[str, Any]]:
        """The events from the ``since``-th on, as dicts (the driver polls them as they come)."""
        return [e.to_dict() for e in list(self.events)[since:]]

    def rank_nodes(self) -> dict[int, str]:
        """Job rank -> the Ray node id it runs on (live ranks)."""
        return dict(self._rank_nodes)

    # -- the job --------------------------------------------------------------

    def start(self) -> list[RankInfo]:
        """Hosts the store, places every gang, starts and builds the rank actors."""
        self._store_address = self.group.host_store()
        starts = self._resume_streams(self.resume_from) if self.resume_from is not None else None

        def shard_of(rank: int) -> Any:
            return (
                self.shards[rank] if starts is None else self.streams.shard_of(starts[rank].shard)
            )

        timeout_s = self.placement_timeout_s
        placed = self._place_job(self.membership.gangs, shard_of, timeout_s=timeout_s)
        if not placed:
            raise TimeoutError(
                f"the job's placement groups were not ready within "
                f"{self.placement_timeout_s:.0f}s; the cluster lacks {self._per_rank()} x "
                f"{self.topology.world_size} ranks"
            )
        infos = self._build(sorted(self._started))
        self._new_generation(reason="job started")
        if self.resume_from is not None:
            self._restore(self.resume_from, starts)
        else:
            self._call(self._live_ranks(), RankWorker.broadcast_state, 0)  # all from gang 0's state
        self.growth.request()
        return infos

    def _resume_streams(self, uri: str) -> dict[int, StreamStart] | None:
        """Where each rank of this job reads after resuming from ``uri``: the checkpoint's own
        streams continued (:func:`~raytrec.elastic.rollback.plan_streams`, on any number of
        ranks), with its batch accounting restored, so the job goes on with the batches the
        saved one had not trained and counts each batch once across both runs. None, when the
        checkpoint holds no accounting or the source cannot name its batches: the ranks then
        read their own shards from the checkpoint's step."""
        from raytrec.checkpoint.layout import read_manifest

        extra = read_manifest(uri).extra
        snapshot = extra.get("accounting")
        if self._stream_id is None or not snapshot or snapshot.get("streams") is None:
            return None
        return self.streams.rewind_to(
            snapshot,
            order=self._ranks_in_gang_order(),
            gang_ids=self.membership.gang_ids,
            step=int(extra["step"]),
        )

    def _restore(self, uri: str, starts: dict[int, StreamStart] | None) -> None:
        """Every gang loads the checkpoint (resharded to this job's shape); step counters go to
        its step, and each rank's stream to ``starts`` (else its own shard at that step)."""
        ranks = self._live_ranks()
        if starts is None:
            loaded = self._call(ranks, RankWorker.load_checkpoint, uri)
        else:
            loaded = self._call_by_rank(
                ranks, RankWorker.load_checkpoint, lambda r: (uri, starts[r].at)
            )
        step, generation = loaded[0]["step"], loaded[0]["generation"]
        self.step = step
        self._last_save = (step, self.clock.monotonic())
        if starts is None:
            for r in ranks:
                self.accounting.restart(r, at=step)
        else:
            self.streams.continue_streams(starts, gang_of=self._gang_of, step=step)
            if not self.streams.reshare(self._ranks_in_gang_order()):  # rows left uneven
                self.streams.queue_replays(starts)
        self.membership = self.membership.synced(step)
        self.total_loss.point = RollbackPoint(
            uri=uri, step=step, accounting=self._accounting_snapshot()
        )
        self.events.append(
            CheckpointRestored(
                at=self._now(), step=step, uri=uri, saved_step=step, saved_generation=generation
            )
        )

    def _place_job(
        self, gangs: Sequence[Gang], shard_of: Callable[[int], Any], *, timeout_s: float
    ) -> bool:
        """Places a whole job of the topology's shape, topology gang ``i`` as ``gangs[i]``, and
        starts its rank actors, job rank ``r`` reading ``shard_of(r)``. False, with nothing left
        behind, when the placement groups are not all ready within ``timeout_s`` (until then
        they are pending: the demand an autoscaler sees)."""
        specs = placement_specs(self.topology, per_rank=self._per_rank())
        # Names stay unique when a rebuilt job is placed again in a later generation.
        suffix = f"-gen{self.membership.generation}" if self.membership.generation else ""
        pgs = [self.group.place(s, name=f"{self.cfg.name}-{s.name}{suffix}") for s in specs]
        if len(self.group.ready(pgs, timeout=timeout_s)) < len(pgs):
            for pg in pgs:
                self.group.release(pg)
            return False
        across = self.topology.layout is Layout.REPLICAS_ACROSS_HOSTS
        for spec, pg in zip(specs, pgs, strict=True):
            for bundle, ranks in enumerate(spec.ranks):
                for t in ranks:
                    pos = self.topology.position(t)
                    gang = gangs[pos.gang]
                    self._pgs[gang.gang_id if across else -1] = pg  # within: one for the job
                    r = gang.ranks[pos.gang_rank].job_rank
                    self._start_rank(r, gang.gang_id, pos.gang_rank, pg, bundle, shard_of(r))
        return True

    def _per_rank(self) -> dict[str, float]:
        scaling = self.cfg.scaling
        return rank_resources(cpus_per_rank=scaling.cpus_per_rank, use_gpu=scaling.use_gpu)

    def _save_due(self, step: int, *, final: bool = False) -> bool:
        """Whether the checkpoint policy wants a save at ``step``."""
        last_step, last_clock = self._last_save
        decision = save_decision(
            self.cfg.checkpoint,
            step=step,
            now_s=self.clock.monotonic(),
            last_save_step=last_step,
            last_save_s=last_clock,
            sync_every=1,  # a sync is done right here when one is due
            final_step=self.end_step if final else None,
        )
        return decision.save and step != 0 and last_step != step

    def _maybe_checkpoint(self, *, final: bool = False) -> None:
        """Saves a checkpoint when the policy says so: one gang writes, after a job-wide sync
        (so its copy is the job's state)."""
        cfg = self.cfg.checkpoint
        if not self._save_due(self.step, final=final):
            return
        if self.membership.last_sync_step != self.step:
            self._call(self._live_ranks(), RankWorker.sync)
            self._commit_all()
        writer = list(self.membership.gangs[0].job_ranks)
        # The accounting goes into the checkpoint: a rebuild from it rewinds to this state.
        accounting = self._accounting_snapshot()
        extra = {"step": self.step, "gangs": self.membership.num_gangs, "accounting": accounting}
        refs = self._call(
            writer,
            RankWorker.save_checkpoint,
            self.checkpoint_root,
            self.membership.generation,
            extra,
            cfg.num_to_keep,
            self.membership.num_gangs,
        )
        self.last_checkpoint = refs[0][1]
        self.total_loss.point = RollbackPoint(uri=refs[0][1], step=self.step, accounting=accounting)
        self._last_save = (self.step, self.clock.monotonic())
        self.events.append(CheckpointSaved(at=self._now(), step=self.step, uri=refs[0][1]))

    def _accounting_snapshot(self) -> dict[str, Any]:
        """The batch accounting (and the table of re-shared streams its positions name) as
        JSON, for a checkpoint and for a rewind to it."""
        snapshot = self.accounting.snapshot(self._ranks_in_gang_order())
        if self.streams.table is not None:
            snapshot["streams_table"] = self.streams.table.to_json()
        return snapshot

    def run(self) -> RunSummary:
        """Trains ``num_steps`` steps and writes the final model; returns the summary.

        A rank trains an interval only with all of its batches in memory, and it prepares the
        next interval's batches before it reports the current one; so bad input or the end of
        a rank's data surfaces between steps, before any rank enters the next interval's
        collectives. Training stops there, and the model trained so far is synced, checked and
        saved like a finished one (``RunSummary.stopped_by`` says why).
        """
        clock = self.clock
        started = clock.perf_counter()
        ranks = self.start()
        stopped_by: BaseException | None = None
        every = self.cfg.log_every
        t0 = clock.perf_counter()
        try:
            self._call(
                self._live_ranks(), RankWorker.prepare, min(every, self.end_step), first=True
            )
        except RankFailed as e:
            stopped_by = e.cause
        self.first_batch_s = clock.perf_counter() - t0
        train_start = clock.perf_counter()
        if stopped_by is None:
            stopped_by = self._train(prepared=True, train_start=train_start)
        final = os.path.join(self.run_dir, "final_model")
        for _ in range(_MAX_TRANSIENT + 1):
            try:
                digests = self._finish(final, checkpoint=stopped_by is None)
                break
            except RankCallError as e:
                self._recover_until_stable(self._probe(e))  # lost at the very end: re-form
                if stopped_by is None and self.step < self.end_step:  # rebuilt from a checkpoint
                    stopped_by = self._train(prepared=False, train_start=train_start)
        else:
            raise JobFailedError("the job kept losing ranks while it finished")
        table = self.streams.table
        if stopped_by is None and table is not None:
            per_rank = table.template.plan(table.batch_size).num_steps
            if per_rank < self.cfg.num_steps:  # the job's rows were all the data had
                stopped_by = RuntimeError(
                    f"the data source ran out after {self.step} steps: its "
                    f"{self.cfg.data.epochs} epoch(s) hold {per_rank} batches per rank, fewer "
                    f"than num_steps={self.cfg.num_steps} (every row was trained once); lower "
                    "num_steps or raise data.epochs"
                )
        return RunSummary(
            history=self.progress(),
            final_state_path=final,
            steps=self.step,
            wall_s=clock.perf_counter() - started,
            ranks=ranks,
            digests=digests,
            stopped_by=stopped_by,
            first_batch_s=self.first_batch_s,
            events=self.event_dicts(),
            generation=self.membership.generation,
            committed_batches=self.accounting.committed(),
            committed_count=self.accounting.committed_count(),
            replayed_batches=self.accounting.replayed(),
            lost_batches=self.accounting.lost_batches + self.accounting.replay_pending(),
            checkpoint=self.last_checkpoint,
            reshared_streams=None if self.streams.table is None else self.streams.table.to_json(),
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
        self._ready = min(every, self.end_step - self.step) if prepared else 0
        inflight: deque[_Dispatched] = deque()  # sent, in order; the first one is running
        while stopped_by is None and self.step < self.end_step:
            try:
                if not inflight:
                    t0 = self.clock.perf_counter()  # the interval's time includes what precedes it
                    n = min(every, self.end_step - self.step)
                    if stop is not None and self._ready < n:
                        stopped_by = stop  # bad input, or the end of the data, in what is next
                        break
                    self._apply_drain()
                    self.growth.admit()
                    self.growth.wait_for_min_gangs()
                    # A join may have shared the rows left among more ranks: the end is sooner.
                    n = min(every, self.end_step - self.step)
                    if n <= 0:
                        break
                    if self._ready < n:
                        try:
                            self._call(self._live_ranks(), RankWorker.prepare, n)
                        except RankFailed as e:
                            stopped_by = e.cause  # bad input, or the end of the data
                            break
                        self._ready = n
                    inflight.append(self._dispatch(self.step, n, t0=t0))
                dispatched = inflight.popleft()
                result = self._collect(dispatched)
            except RankCallError as e:
                result = self._probe(e)  # a rank or node died during a control call
            if result.failed:
                self._drain(inflight, result)
                self._recover_until_stable(result)
                self._ready, stop = 0, None  # recovery may have re-opened the ranks' feeds
                continue
            # The interval's share of the timeline ends here; the next one's starts here.
            end = self.clock.perf_counter()
            reports = [result.reports[r] for r in sorted(result.reports)]
            step = max(r.step for r in reports)
            self._ready = min(r.ready for r in reports)  # batches held beyond ``step``
            stop = next((r.stop for r in reports if r.stop is not None), stop)
            if inflight:
                inflight[0] = dataclasses.replace(
                    inflight[0], t0=end, started=self.clock.monotonic()
                )
            self._top_up(inflight, step)
            self._account(reports)
            metrics = merge_metric_states([r.metrics for r in reports if r.metrics is not None])
            row = aggregate_interval(
                reports,
                wall_s=end - dispatched.t0,
                generation=self.membership.generation,
                gangs=self.membership.num_gangs,
                elapsed_s=end - train_start,
                auc=metrics.auc,
                ne=metrics.ne,
                at=self._now(),
            )
            row = dataclasses.replace(row, end_step=self.end_step)
            with self._lock:
                self._history.append(row)
            going_on = stop is None or self._ready >= min(every, self.end_step - self.step)
            if not inflight and going_on and self.step < self.end_step:
                self._maybe_checkpoint()
        return stopped_by

    def _top_up(self, inflight: deque[_Dispatched], step: int) -> None:
        """Queues the intervals :func:`~raytrec.elastic.control.intervals_to_queue` allows
        behind the one running. ``step``: where the last interval collected ended."""
        boundary = Boundary(
            step=step,
            end_step=self.end_step,
            every=self.cfg.log_every,
            depth=self._depth,
            ready=self._ready,
            membership_changing=bool(self.growth.pending or self.growth.building)
            or self._drain_decision(take=False) is not None,
            live_gangs=self.membership.num_gangs,
            min_gangs=self.elastic.min_gangs,
        )
        end = inflight[-1].end if inflight else None
        for start, n in intervals_to_queue(boundary, end, len(inflight), self._save_due):
            after = inflight[-1].seq if inflight else None
            inflight.append(self._dispatch(start, n, after=after))

    # -- drains -------------------------------------------------------------------------------

    def _drain_decision(self, *, take: bool) -> Drain | None:
        """What the policy says to give back now (:func:`~raytrec.elastic.drain.decide_drain`),
        from a user's request in the run directory and the nodes the cluster is draining.
        ``take``: a user's request is consumed (it is being carried out)."""
        path = os.path.join(self.run_dir, REQUEST_FILE)
        try:
            request = read_request(path, remove=take)
        except ConfigError as e:  # a bad request must not stop a training job
            os.replace(path, f"{path}.rejected")
            self.events.append(DrainRejected(at=self._now(), step=self.step, reason=str(e)))
            request = DrainRequest()
        draining = self.group.draining_nodes()
        if draining:
            request = request.merged(DrainRequest(nodes=frozenset(draining)))
        decision = decide_drain(
            self.membership,
            request,
            node_of_rank=self._rank_nodes,
            max_gangs=self.max_gangs,
            min_gangs=self.elastic.min_gangs,
        )
        return decision

    def _apply_drain(self) -> None:
        """Gives gangs back at this boundary (nothing in flight): a job-wide sync commits their
        work, the rows they had not trained are shared again among the others, and their
        placement groups are released; no row is lost or trained twice."""
        decision = self._drain_decision(take=True)
        if decision is None:
            return
        self.max_gangs = decision.max_gangs
        if decision.gangs:
            self._call(self._live_ranks(), RankWorker.sync)
            self._commit_all()
            drained = list(decision.gangs)
            survivors = [g for g in self.membership.gang_ids if g not in decision.gangs]
            ranks = [r for g in drained for r in self.membership.gang(g).job_ranks]
            # They reported every batch up to this step and all of it is committed: this only
            # retires their streams where they stand, for the others or a later gang to go on.
            self.accounting.lost_rank_reports(ranks, fail_step=self.step)
            self._drop(drained, survivors)
            for gid in drained:
                self.events.append(
                    GangDrained(at=self._now(), step=self.step, gang_id=gid, reason=decision.reason)
                )
                self._kill_gang(gid)
            self.membership = self.membership.without(drained)
        # Placement requested beyond the new cap is given back too.
        while (
            self.growth.pending
            and self.membership.num_gangs + len(self.growth.pending) + len(self.growth.building)
            > self.max_gangs
        ):
            self.group.release(self.growth.pending.pop())
        if decision.gangs:
            self._new_generation(reason=decision.reason)
            if self.streams.reshare(self._ranks_in_gang_order()):
                self._ready = 0  # new streams: every rank reads its share from the start
        self.growth.request()

    def _finish(self, final: str, *, checkpoint: bool) -> dict[int, dict[str, str]]:
        """Ends on a job-wide sync, checks the replicas, saves the final model."""
        if self.step % self.cfg.sync.sync_every or self.membership.last_sync_step != self.step:
            self._call(self._live_ranks(), RankWorker.sync)  # end on a sync: every replica the same
        self._commit_all()
        if checkpoint:
            self._maybe_checkpoint(final=True)
        digests = self._final_digests()
        first_gang = self.membership.gangs[0]
        self._call(list(first_gang.job_ranks), RankWorker.save, final)
        return digests

    # -- one interval -------------------------------------------------------------------------

    def _dispatch(
        self, start: int, n: int, *, t0: float | None = None, after: int | None = None
    ) -> _Dispatched:
        """Sends ``train`` for the ``n`` steps from ``start`` to every live rank, asking each to
        prepare the batches of the next ``_depth`` intervals after it. ``after``: the call it
        is queued behind, still running. ``t0``: where the interval's wall-clock time starts
        (default: now; an interval sent early starts when the one before it is collected)."""
        self._seq += 1
        ready = min(self._depth * self.cfg.log_every, self.end_step - start - n)
        ranks = self._live_ranks()
        now = self.clock.monotonic()
        if after is None:
            # Nothing was running: silence counts from now, not from the last interval's end
            # (a checkpoint, a join or a recovery may have run in between).
            for r in ranks:
                step = self._progress.get(r, (self.step, now))[0]
                self._progress[r] = (step, now)
        refs = self.group.call(
            ranks, RankWorker.train, lambda _r: (n, ready), seq=self._seq, after=after
        )
        return _Dispatched(
            n=n,
            end=start + n,
            seq=self._seq,
            refs=refs,
            t0=self.clock.perf_counter() if t0 is None else t0,
            started=now,
        )

    def _collect(self, dispatched: _Dispatched) -> _Interval:
        """Waits for every rank's ``train`` report and sorts out what happened.

        While it waits it reads the ranks' heartbeats (the last step each finished): a rank
        that finishes no step for ``elastic.step_timeout_s`` is hung (the policy's rule,
        :func:`~raytrec.elastic.policy.find_hung_ranks`), however many steps the interval has.
        """
        out = _Interval()
        pending = dict(dispatched.refs)
        deadline: float | None = None
        elastic = self.elastic
        while pending:
            ready = self.group.wait(list(pending.values()), num_returns=1, timeout=elastic.poll_s)
            now = self.clock.monotonic()
            for future in ready:
                rank = next((r for r, x in pending.items() if x is future), None)
                if rank is None:
                    continue  # a lost gang's peer, already counted
                del pending[rank]
                try:
                    report: RankReport = self.group.result(future)
                    out.reports[rank] = report
                    self._progress[rank] = (report.step, now)
                except RankLost as e:
                    out.dead[rank] = e.cause
                    # The rest of its gang is dropped anyway; left alone it would sit in the
                    # gang's collectives until their timeout. Kill it now.
                    for peer in self.membership.gang(self._gang_of(rank)).job_ranks:
                        if peer in pending:
                            self.group.kill(peer)
                            del pending[peer]
                            out.dead[peer] = _PEER_KILLED
                except RankFailed as e:
                    out.errored[rank] = str(e)
            if (out.dead or out.errored) and deadline is None:
                # Fail the survivors' blocked collectives now, and give everyone the
                # collective timeout to report; whoever is still running then is hung.
                deadline = now + 2 * elastic.collective_timeout_s + elastic.poll_s
                self._abort_planes(set(pending) - set(out.dead))
            if deadline is not None and now > deadline:
                out.hung = sorted(pending)
                out.silence = {r: self._silence(r, now) for r in out.hung}
                break
            if deadline is None and pending:
                hung = self._hung_ranks(pending, now)
                if hung:
                    out.hung = list(hung)
                    out.silence = {r: self._silence(r, now) for r in hung}
                    break
        return out

    def _hung_ranks(self, pending: dict[int, Any], now: float) -> tuple[int, ...]:
        """The ranks still training that count as hung at ``now``, by the policy's rule, after
        reading their heartbeats. Ranks that already reported are not expected to progress."""
        for r, step in self.group.progress(list(pending)).items():
            if step > self._progress.get(r, (-1, now))[0]:
                self._progress[r] = (step, now)
        progress = {
            r: self._progress.get(r, (self.step, now)) if r in pending else (self.step, now)
            for r in self._live_ranks()
        }
        state = ElasticState(
            membership=self.membership,
            sync_every=self.cfg.sync.sync_every,
            max_gangs=self.max_gangs,
            progress=progress,
        )
        return find_hung_ranks(state, now=now, config=self.elastic)

    def _silence(self, rank: int, now: float) -> tuple[int, float]:
        """(the last step ``rank`` finished, seconds since it did), as the coordinator saw it."""
        step, at = self._progress.get(rank, (self.step, now))
        return step, round(now - at, 3)

    def _drain(self, inflight: deque[_Dispatched], result: _Interval) -> None:
        """After a failed interval, waits out the intervals queued behind it.

        A rank whose own call failed skips the one queued behind it. A rank that finished the
        failed interval (its gang intact) has gone on into the next one, and may be waiting in
        a replica-plane collective for a lost peer: its planes are aborted so that it stops at
        once. What it trained comes back in its report (``result.later``) or from ``recover``,
        and is booked with the rest. Ranks of gangs that lost a rank are left alone: they are
        killed with their gang. A survivor whose queued call does not end counts as hung.
        """
        lost_gangs = {self._gang_of(r) for r in [*result.dead, *result.hung]}
        while inflight:
            d = inflight.popleft()
            refs = {r: x for r, x in d.refs.items() if self._gang_of(r) not in lost_gangs}
            self._abort_planes(set(refs))
            # A survivor may train the whole queued interval (nothing in it waits for the lost
            # gang): give it the interval's own hang timeout, as _collect does.
            timeout = max(
                2 * self.elastic.collective_timeout_s + self.elastic.poll_s,
                self.elastic.step_timeout_s * max(1, d.n),
            )
            ready = self.group.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
            now = self.clock.monotonic()
            for r, future in refs.items():
                if future not in ready:
                    result.hung.append(r)
                    result.silence[r] = self._silence(r, now)
                    continue
                try:
                    report = self.group.result(future)
                except RankLost as e:
                    result.dead[r] = e.cause
                except RankFailed as e:
                    result.errored.setdefault(r, str(e))
                else:
                    if not report.skipped:
                        result.later.append(report)
            lost_gangs |= {self._gang_of(r) for r in [*result.dead, *result.hung]}

    def _abort_planes(self, ranks: set[int]) -> None:
        # Fire and forget: the answer does not matter, only that blocked collectives fail.
        self.group.call(sorted(ranks & self._started), RankWorker.abort_replica_planes)

    # -- failures ---------------------------------------------------------------------------

    def _probe(self, error: BaseException) -> _Interval:
        """Which live ranks are dead, after ``error`` broke a control call."""
        out = _Interval()
        refs = self.group.call(self._live_ranks(), RankWorker.step)
        ready = self.group.wait(list(refs.values()), num_returns=len(refs), timeout=10)
        now = self.clock.monotonic()
        for r, future in refs.items():
            if future not in ready:
                out.hung.append(r)
                out.silence[r] = self._silence(r, now)
                continue
            try:
                self.group.result(future)
            except RankLost as e:
                out.dead[r] = e.cause
        if not out.failed:
            if not isinstance(error, RankLost):
                raise error  # nobody died: a real error of its own
            # An actor outside the membership died (a gang that was starting): re-form as is.
            out.errored[-1] = str(error)
        return out

    def _recover_until_stable(self, result: _Interval) -> None:
        """Recovers; a further loss during recovery starts it over with the new losses."""
        for _ in range(self.max_gangs + self.membership.num_gangs + 1):
            try:
                self._recover(result)
                return
            except RankCallError as e:
                probed = self._probe(e)
                if not result.booked:  # what the survivors reported is not in the books yet
                    probed.reports = {**result.reports, **probed.reports}
                    probed.later = result.later + probed.later
                result = probed
        raise JobFailedError("the job kept losing ranks while it re-formed")

    def _recover(self, result: _Interval) -> None:
        """Drops every gang that lost a rank and re-forms the job among the survivors."""
        now = self._now()
        lost = set(result.dead) | set(result.hung)
        if not lost:
            # Collectives gave up but every rank is alive and answered: a stall longer than the
            # collective timeout (an overloaded host, a long pause). Nobody is dropped; the job
            # re-forms as it was, unless that keeps happening.
            self._transient += 1
            errors = [f"rank {r}: {e}" for r, e in sorted(result.errored.items())]
            why = retry_transient(self._transient, limit=_MAX_TRANSIENT, errors=errors)
            if why is not None:
                raise JobFailedError(why)
        else:
            self._transient = 0
        # A gang that was joining has no state of its own yet: if anything fails meanwhile,
        # it goes too and is requested again.
        failed_gangs = sorted({self._gang_of(r) for r in lost} | self.growth.joining)
        self.growth.joining = set()
        # Ray says when an actor died with its node; the node table may lag behind that, and
        # a rank on a node that just went can look hung for a moment: give the table a few
        # seconds to catch up, and count such ranks as dead.
        if result.hung:
            deadline = self.clock.monotonic() + _NODE_TABLE_GRACE_S
            while self.clock.monotonic() < deadline and not self._dead_nodes():
                self.clock.sleep(0.5)
            gone = set(self._dead_nodes())
            for r in [r for r in result.hung if self._rank_nodes.get(r) in gone]:
                result.hung.remove(r)
                result.dead[r] = _NODE_DIED
        dead_nodes = sorted(
            set(self._dead_nodes())
            | {
                self._rank_nodes[r]
                for r, cause in result.dead.items()
                if "node" in cause and r in self._rank_nodes
            }
        )
        # A rank on a dead node died with it, whatever its call said first: a gang peer killed
        # because its gang lost a rank may have been there too (the whole job fits on one
        # host). It counts as lost in its own right; otherwise a shard whose every copy was on
        # that node would look alive.
        for r, cause in list(result.dead.items()):
            if cause != _NODE_DIED and self._rank_nodes.get(r) in dead_nodes:
                result.dead[r] = _NODE_DIED
        for node_id in dead_nodes:
            gangs = sorted({self._gang_of(r) for r, n in self._rank_nodes.items() if n == node_id})
            self.events.append(
                NodeDied(at=now, step=self.step, node=self._node(node_id), gang_ids=tuple(gangs))
            )
        for r, cause in sorted(result.dead.items()):
            self.events.append(
                RankDied(at=now, step=self.step, job_rank=r, gang_id=self._gang_of(r), cause=cause)
            )
        if result.hung:
            silence = [result.silence.get(r, (self.step, 0.0)) for r in result.hung]
            self.events.append(
                HangDetected(
                    at=now,
                    step=self.step,
                    job_ranks=tuple(result.hung),
                    gang_ids=tuple(sorted({self._gang_of(r) for r in result.hung})),
                    last_step=min(step for step, _ in silence),
                    silent_s=max(silent for _, silent in silence),
                )
            )
        # The policy decides: drop the gangs that lost a rank and re-form among the intact
        # ones, or, when no gang is intact, a total loss (some shard may have no live copy).
        # A gang still joining has no state of its own and counts as lost with the rest.
        joining = {r for g in failed_gangs for r in self.membership.gang(g).job_ranks}
        state = ElasticState(
            membership=self.membership,
            sync_every=self.cfg.sync.sync_every,
            max_gangs=self.max_gangs,
            dead_ranks=frozenset(lost | joining) if lost else frozenset(),
        )
        decision = decide(state, now=self.clock.monotonic(), config=self.elastic)
        if isinstance(decision, Unrecoverable):
            own = sorted(r for r in lost if result.dead.get(r) != _PEER_KILLED)
            self.total_loss.recover(own, failed_gangs, why=lambda g: _why(result, g, self))
            return
        if isinstance(decision, Reform):
            failed_gangs = sorted(set(failed_gangs) | set(decision.drop))
        survivors = [g.gang_id for g in self.membership.gangs if g.gang_id not in failed_gangs]
        survivor_ranks = [r for g in survivors for r in self.membership.gang(g).job_ranks]
        self._abort_planes(set(survivor_ranks))
        recovered = self._call(survivor_ranks, RankWorker.recover)
        steps = sorted({rep.step for rep in recovered})
        apart = survivors_apart(steps, sync_every=self.cfg.sync.sync_every, lost_gangs=failed_gangs)
        if apart is not None:
            raise JobFailedError(apart)
        # A failure reaches the members of a collective at slightly different moments: one may
        # have finished a step its peers did not. The job goes on from the furthest step; a
        # rank that is behind simply trained one batch less (its log says which).
        fail_step = steps[-1]
        # What everyone trained in the failed interval: the survivors' own logs (a survivor
        # may even have finished it), and for the lost ranks, whose logs died with them, the
        # next batches in their stream order, one per step up to the failure.
        reports = [result.reports[r] for r in survivor_ranks if r in result.reports]
        reports += [rep for rep in result.later if rep.rank in survivor_ranks] + recovered
        lost_ranks = [r for g in failed_gangs for r in self.membership.gang(g).job_ranks]
        reports += self.accounting.lost_rank_reports(lost_ranks, fail_step=fail_step)
        # Syncs before the failed step completed on every gang; the one at it did not.
        self._account(reports, completed_through=fail_step - 1)
        result.booked = True
        replay = self._drop(failed_gangs, survivors)
        for gid in failed_gangs:
            self.events.append(
                GangDropped(
                    at=self._now(), step=self.step, gang_id=gid, reason=_why(result, gid, self)
                )
            )
            self._kill_gang(gid)
        if failed_gangs:
            self.membership = self.membership.without(failed_gangs)
            reason = f"lost gangs {failed_gangs}"
        else:
            self.membership = dataclasses.replace(
                self.membership, generation=self.membership.generation + 1
            )
            reason = "collectives timed out with every rank alive"
        self._new_generation(reason=reason)
        # The re-formed job's first sync: every replica (and dense state) identical again, and
        # the survivors' batches so far are in the model: committed.
        self._call(self._live_ranks(), RankWorker.set_step, fail_step)
        self._call(self._live_ranks(), RankWorker.sync)
        self._call(self._live_ranks(), RankWorker.broadcast_dense, 0)
        self._commit_all()
        # Re-sharing (after the replays are booked) hands each rank its replays too.
        if replay and not self.streams.reshare(self._ranks_in_gang_order()):
            self._call_by_rank(sorted(replay), RankWorker.replay, lambda r: (replay[r],))
        self.growth.request()

    def _drop(self, gangs: list[int], survivors: list[int]) -> dict[int, list[int]]:
        """The dropped gangs' uncommitted batches, split over the survivors' ranks."""
        return self.accounting.drop(
            gangs, survivors, ranks_of=lambda g: self.membership.gang(g).job_ranks
        )

    # -- membership plumbing -----------------------------------------------------------------

    def _start_rank(
        self,
        rank: int,
        gang: int,
        gang_rank: int,
        pg: Placement,
        bundle: int,
        shard: Any,
        *,
        account: bool = True,
    ) -> None:
        """Starts rank ``rank``'s actor; ``account``: it trains from this step on (a gang built
        in the background is booked when it joins)."""
        assert self._store_address is not None
        spec = RankSpec(
            rank=rank,
            gang=gang,
            gang_rank=gang_rank,
            gang_size=self.topology.gang_size,
            config=self.cfg,
            plan=self.plan,
            num_dense=self.num_dense,
            store=self._store_address,
            model_factory=self.model_factory,
            timeout_s=self.elastic.collective_timeout_s,
        )
        self.group.start_rank(spec, shard, placement=pg, bundle=bundle)
        self._started.add(rank)
        if account:
            self.accounting.add_rank(rank, shard=getattr(shard, "index", rank), step=self.step)
        else:
            self.growth.shards_of_new[rank] = shard

    def _build(self, ranks: list[int]) -> list[RankInfo]:
        infos: list[RankInfo] = self._call(ranks, RankWorker.build)
        for info in infos:
            self._rank_nodes[info.rank] = info.node_id
            self._node(info.node_id)
        return sorted(infos, key=lambda x: x.rank)

    def _new_generation(self, *, reason: str) -> None:
        """Replica plane and sync plan of the current membership, on every live rank."""
        m = self.membership
        ranks = self._live_ranks()
        self._call_by_rank(
            ranks,
            RankWorker.join_replica_plane,
            lambda r: (m.generation, m.member_index(self._gang_of(r)), m.num_gangs),
        )
        self._call(ranks, RankWorker.join_sync_plan, self._sync_plan())
        self.events.append(
            GenerationStarted(
                at=self._now(),
                step=self.step,
                generation=m.generation,
                gang_ids=m.gang_ids,
                reason=reason,
            )
        )

    def _sync_plan(self) -> SyncPlan:
        """The generation's sync schedule over the live gangs, gangs on one host together."""
        locality = {
            g.gang_id: tuple(sorted({self._node_of(s) for s in g.ranks}))
            for g in self.membership.gangs
        }
        return plan_sync(
            self.cfg.sync,
            generation=self.membership.generation,
            live_gangs=self.membership.gang_ids,
            locality=locality,
        )

    def _kill_gang(self, gang_id: int) -> None:
        self._release(gang_id, self.membership.gang(gang_id).job_ranks)

    def _release(self, gang_id: int, ranks: Sequence[int]) -> None:
        """Kills the gang's rank actors and removes its placement group."""
        for r in ranks:
            self.group.kill(r)
            self._started.discard(r)
            self._rank_nodes.pop(r, None)
        pg = self._pgs.pop(gang_id, None)
        if pg is not None:
            self.group.release(pg)

    def _live_ranks(self) -> list[int]:
        return sorted(r for g in self.membership.gangs for r in g.job_ranks)

    def _ranks_in_gang_order(self) -> list[int]:
        return [r for g in self.membership.gangs for r in g.job_ranks]

    def _with_nodes(self, gangs: Sequence[Gang]) -> tuple[Gang, ...]:
        """The gangs with the nodes their built ranks run on."""
        return tuple(
            dataclasses.replace(
                g,
                ranks=tuple(
                    RankSlot(job_rank=s.job_rank, gang_rank=s.gang_rank, node=self._node_of(s))
                    for s in g.ranks
                ),
            )
            for g in gangs
        )

    def _gang_of(self, rank: int) -> int:
        gang = self.membership.gang_of_rank(rank)
        assert gang is not None, f"rank {rank} is in no live gang"
        return gang

    def _node(self, node_id: str) -> int:
        """A small index for a Ray node id (in order of first sight)."""
        return self._node_index.setdefault(node_id, len(self._node_index))

    def _node_of(self, slot: RankSlot) -> int:
        node_id = self._rank_nodes.get(slot.job_rank)
        return slot.node if node_id is None else self._node(node_id)

    def _dead_nodes(self) -> list[str]:
        alive = {n.node_id for n in self.group.nodes() if n.alive}
        return sorted({n for n in self._rank_nodes.values() if n not in alive})

    def _now(self) -> float:
        return round(self.clock.monotonic() - self._t0, 3)

    # -- accounting -----------------------------------------------------------------------------

    def _account(self, reports: list[RankReport], *, completed_through: int | None = None) -> None:
        """Books the ranks' trained batches; a job-wide sync among them commits."""
        sync = self.cfg.sync
        last_sync = self.accounting.record(
            reports,
            gang_of=self._gang_of,
            live_gangs=self.membership.gang_ids,
            last_sync_step=self.membership.last_sync_step,
            is_job_wide_sync=lambda s: s % sync.sync_every == 0 or s <= sync.warmup_steps,
            completed_through=completed_through,
        )
        if last_sync is not None:
            self.membership = self.membership.synced(last_sync)
        self.step = max((r.step for r in reports), default=self.step)

    def _commit_all(self) -> None:
        """A job-wide sync just completed: everything trained so far is in every replica."""
        self.accounting.commit(self.membership.gang_ids)
        self.membership = self.membership.synced(self.step)

    # -- end of job ---------------------------------------------------------------------------

    def _final_digests(self) -> dict[int, dict[str, str]]:
        """Checks that the final sync left every replica of every shard identical."""
        ranks = self._live_ranks()
        digests = dict(zip(ranks, self._call(ranks, RankWorker.state_digest), strict=True))
        for group in self.membership.replica_groups:
            members = [m.job_rank for m in group]
            shard_digests = {digests[r]["shards"] for r in members}
            if len(shard_digests) != 1:
                raise RuntimeError(f"replica group of ranks {members} disagrees after final sync")
        if len({d["dense"] for d in digests.values()}) != 1:
            raise RuntimeError("dense parameters differ between ranks after the final step")
        return digests

    def shutdown(self) -> None:
        for r in sorted(self._started):
            self.group.kill(r)
        self._started.clear()
        for pg in [*self._pgs.values(), *self.growth.pending]:
            self.group.release(pg)
        self._pgs.clear()
        self.growth.pending.clear()
        self.growth.building.clear()
        self.growth.shards_of_new.clear()

    # -- helpers ----------------------------------------------------------------

    def _call(
        self, ranks: list[int], method: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> list[Any]:
        return self._call_by_rank(ranks, method, lambda _r: args, **kwargs)

    def _call_by_rank(
        self,
        ranks: list[int],
        method: Callable[..., Any],
        args_of: Callable[[int], tuple[Any, ...]],
        **kwargs: Any,
    ) -> list[Any]:
        """Calls ``method`` on ``ranks`` and returns their answers in order; raises
        :class:`RankLost` or :class:`RankFailed` for the first rank whose call failed."""
        futures = self.group.call(ranks, method, args_of, **kwargs)
        # Control calls (build, join, sync, prepare, recover) are not what hang detection
        # watches (that is _collect's job); building a gang's ranks on a loaded machine,
        # or the data pipeline's first batches, can take minutes.
        timeout = max(self.elastic.step_timeout_s, RENDEZVOUS_TIMEOUT_S)
        pending = list(futures.values())
        if len(self.group.wait(pending, num_returns=len(pending), timeout=timeout)) < len(pending):
            raise TimeoutError(
                f"{method.__name__} did not return on every rank of {ranks} within {timeout:g}s"
            )
        return [self.group.result(futures[r]) for r in ranks]


def _why(result: _Interval, gang: int, coordinator: Coordinator) -> str:
    ranks = coordinator.membership.gang(gang).job_ranks
    dead = [r for r in ranks if r in result.dead]
    hung = [r for r in ranks if r in result.hung]
    if dead:
        return f"rank(s) {dead} died"
    if hung:
        return f"rank(s) {hung} hung"
    return f"rank(s) {[r for r in ranks if r in result.errored]} failed"
