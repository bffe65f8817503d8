"""The rank actor: a thin Ray shell over :class:`raytrec.engine.rank_engine.RankEngine`.

It owns one rank's engine and its data feed, and answers the coordinator's
calls. All training logic lives in the engine, which tests drive without Ray.

The actor runs with three threads (``max_concurrency=3``): ``train`` for the
interval running, the next interval's ``train`` queued behind it (see
:class:`IntervalOrder`), and one for the coordinator's other calls: while
``train`` is blocked in a collective whose peer died, the coordinator can
still call ``abort_replica_planes`` to fail it at once, and ``recover``
afterwards.
Every batch the rank trains is logged with its id and step until the
coordinator collects the log (``train``'s report, or ``recover`` after a
failed interval), which is what the coordinator's exactly-once ledger is built from.

Faults are not the rank's business: it calls its :class:`RankHooks` as a step begins, as it
enters a phase of its work and after a heal, and the plain hooks do nothing. Tests and demos
that configure ``testing.faults`` or ``testing.stragglers`` get hooks that carry them out
(:mod:`actors.fault_injection`), chosen at launch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import ray
import torch

from raytrec.checkpoint.config import CheckpointConfig
from raytrec.cluster import pin_collectives_to
from raytrec.data.feed import BatchFeed, DataExhausted
from raytrec.data.held_out import HeldOutBatches
from raytrec.data.parquet_indexed import IndexedParquetShard
from raytrec.data.parquet_streams import Stream
from raytrec.data.source import Batch, BatchShard
from raytrec.data.synthetic import split_batch_id
from raytrec.elastic.faults import Phase
from raytrec.elastic.rank_protocol import (
    LoadedCheckpoint,
    RankProtocol,
    ReformPlan,
    StateDigest,
)
from raytrec.elastic.report import RankInfo, RankReport, TrainedBatch
from raytrec.engine.publish_rows import PublishedRows
from raytrec.engine.rank_engine import RankEngine, RankSpec
from raytrec.engine.stepping import (
    StepBegins,
    StepFailed,
    StepInput,
    StepResult,
    SyncBegins,
)
from raytrec.observability.rec_metrics import MetricState, RankMetrics
from raytrec.sync.schedule import SyncPlan

__all__ = ["RankHooks", "RankWorker", "progress_key"]

Item = tuple[int | None, Batch]  # (batch id, batch)
#: Batches before a longer stream's new part (``extend_stream``) where its pipeline starts: a
#: pipeline delivers nothing for seconds after its start (in-process reads cover what it has
#: not delivered when due), and one started long before would read beside the rank's other.
_READ_ON_LEAD = 512


def progress_key(rank: int) -> str:
    """The store key under which rank ``rank`` keeps the last step it finished."""
    return f"progress/{rank}"


class IntervalOrder:
    """Keeps a rank's ``train`` calls in the order the coordinator sent them.

    The coordinator sends interval k+1 while k is still running, so a rank goes straight on
    from one interval to the next instead of waiting a round trip through the coordinator
    (``TrainingSteps._top_up``). A queued call names the call it follows (``after``): it waits
    for that call to end, and may run only if that call succeeded (and, in
    :meth:`RankWorker.train`, only if it did on every rank of the gang). After a failed
    interval the rank's model waits for the coordinator's recovery, so what was queued behind
    it is skipped without touching it. Ray runs a threaded actor's calls as they arrive, not
    in the order they were sent, hence this class.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ended = -1  # the last call (by sequence number) that ended, however
        self._succeeded = -1  # the last call that returned its report

    def wait_turn(self, after: int | None) -> bool:
        """Waits until call ``after`` ended; returns whether to run (it succeeded). None: a
        call sent with nothing running before it runs at once."""
        if after is None:
            return True
        with self._cond:
            self._cond.wait_for(lambda: self._ended >= after)
            return self._succeeded == after

    def ended(self, seq: int, *, succeeded: bool) -> None:
        with self._cond:
            self._ended = max(self._ended, seq)
            if succeeded:
                self._succeeded = seq
            self._cond.notify_all()


class RankHooks:
    """Where something outside a rank's own work may act on it: as a training step begins, as
    the rank enters a phase of its work (:class:`~raytrec.elastic.faults.Phase`), and after it
    took a peer's state in a heal. These do nothing; :mod:`actors.fault_injection` carries out
    ``testing.faults`` and ``testing.stragglers`` in them."""

    def attach(self, rank: RankWorker) -> None:
        """The rank these hooks belong to, once it is constructed (in its own process)."""

    def step_begins(self, step: int) -> float:
        """Before training step ``step``; returns the seconds the rank was held up."""
        return 0.0

    def enters(self, phase: Phase) -> None:
        """As the rank enters ``phase``."""

    def healed(self) -> None:
        """After the rank took a replica peer's state (``broadcast_state``)."""


class RankWorker:
    """One rank of the job. Made a Ray actor by the coordinator (``ray.remote(RankWorker)``);
    ``hooks``: see :class:`RankHooks` (default: none that act)."""

    def __init__(self, spec: RankSpec, shard: BatchShard, hooks: RankHooks | None = None) -> None:
        self.spec = spec
        self.shard = shard
        self.engine = RankEngine(spec)
        self.hooks = hooks or RankHooks()
        self.metrics = RankMetrics()
        self._feed: BatchFeed[Item] | None = None
        self._lock = threading.Lock()
        self._trained: list[TrainedBatch] = []  # (step, batch id) not yet reported
        self._short: list[tuple[int, int]] = []  # (batch id, rows) of those short of a batch
        self._losses: list[torch.Tensor] = []  # each step's loss, read at the report
        self._order = IntervalOrder()
        self._last_end: float | None = None  # when the last train call ended (perf_counter)
        self._held_out = HeldOutBatches()  # held-out batches read (evaluate, prefetch_held_out)
        self._heartbeat: threading.Thread | None = None
        self._closed = threading.Event()
        # Queued replay batches that update their embedding rows only: their dense gradient is
        # already in the model (the coordinator's accounting says which).
        self._embedding_only: set[int] = set()
        self.hooks.attach(self)

    def build(self) -> RankInfo:
        """Joins the gang world and shards the model; returns where this rank runs."""
        address = ray.util.get_node_ip_address()
        pin_collectives_to(address)
        self.engine.build()
        self._open_feed()
        self._heartbeat = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._heartbeat.start()
        return RankInfo(
            rank=self.spec.rank,
            gang=self.spec.gang,
            node_id=ray.get_runtime_context().get_node_id(),
            address=address,
            pid=os.getpid(),
            device=str(self.engine.device),
        )

    def _open_feed(self, *, start_step: int = 0) -> None:
        """Reads this rank's shard from batch ``start_step`` on; a feed open before is closed
        (what it had read ahead is dropped)."""
        if self._feed is not None:
            self._feed.close()
        self._embedding_only = set()
        data = self.spec.config.data
        self._feed = BatchFeed(
            self.shard.identified_batches(data.batch_size, start_step=start_step),
            prefetch=data.prefetch_batches,
            background=self.spec.config.feed_in_background,
        )

    def reform(self, plan: ReformPlan) -> None:
        """Carries out ``plan``'s parts in order, as the separate calls would (one call instead
        of one per part: the coordinator waits on every rank once)."""
        if plan.replay is not None:
            self.replay(list(plan.replay), list(plan.embedding_only))
        if (g := plan.generation) is not None:
            self.join_replica_plane(g.generation, g.member_rank, g.size)
            self.join_sync_plan(g.sync_plan)
        if plan.step is not None:
            self.set_step(plan.step)
        if plan.sync and plan.rolled_back:
            self.hooks.enters(Phase.SYNC)
            self.engine.sync_without(plan.rolled_back)
        elif plan.sync:
            self.sync()
        if plan.broadcast_state_from is not None:
            self.broadcast_state(plan.broadcast_state_from)
        if plan.dense_from is not None:
            self.broadcast_dense(*plan.dense_from)
        if plan.finish_failed_step is not None:
            self.settle_failed_step(plan.finish_failed_step)

    def join_replica_plane(self, generation: int, member_rank: int, size: int) -> None:
        self.hooks.enters(Phase.JOIN)
        self.engine.join_replica_plane(generation=generation, member_rank=member_rank, size=size)

    def join_sync_plan(self, plan: SyncPlan) -> None:
        self.engine.join_sync_plan(plan)

    def broadcast_state(self, src: int) -> None:
        """Copies replica-group member ``src``'s full state to this rank (a heal, or the job's
        start)."""
        self.hooks.enters(Phase.HEAL)
        self.engine.broadcast_state(src=src)
        self.hooks.healed()

    def broadcast_dense(self, src: int, gang_src: int = 0) -> None:
        self.engine.broadcast_dense(src=src, gang_src=gang_src)

    def settle_failed_step(self, finish: bool) -> None:
        self.engine.settle_failed_step(finish=finish)

    def set_step(self, step: int) -> None:
        """A rank that joins a running job takes the job's step count (after healing)."""
        self.engine.step = step

    def step(self) -> int:
        return self.engine.step

    def prepare(self, num_steps: int, *, first: bool = False) -> float:
        """Waits until the next ``num_steps`` batches are in memory; returns the seconds waited.

        Called on every rank before :meth:`train`, so bad input or the end of the data stops
        the job between steps rather than inside a collective (see :mod:`raytrec.data.feed`).
        ``first``: the wait for the very first batches (the data pipeline starting up) is
        reported by the caller on its own, not counted as a training interval's data wait.
        """
        assert self._feed is not None, "build() first"
        try:
            waited = self._feed.prepare(num_steps)
            if first:
                self._feed.wait_s = 0.0
            return waited
        except DataExhausted:
            raise RuntimeError(
                f"rank {self.spec.rank}: the data source ran out after {self._feed.taken} "
                "steps; lower num_steps or raise the source's epochs"
            ) from None

    def set_shard(
        self, shard: BatchShard, replay: list[int], embedding_only: list[int] | None = None
    ) -> None:
        """Reads the batches ``replay`` and then ``shard`` from its first batch on (the rows
        left, shared again after the job's ranks changed); batches read ahead before are
        dropped untrained. ``embedding_only``: as for :meth:`replay`."""
        self.shard = shard
        self._open_feed()
        if replay:
            self.replay(replay, embedding_only)

    def set_streams(self, streams: dict[int, Stream]) -> None:
        """The job's table of re-shared streams after a join that left this rank's stream
        running (its own now ends sooner): what it reads goes on as it was; replays of any
        batch of those streams read the table."""
        shard = self.shard
        if not isinstance(shard, IndexedParquetShard):
            raise TypeError(f"a {type(shard).__name__} has no table of streams")
        self.shard = shard.with_stream(shard.index, streams)

    def extend_stream(self, shard: BatchShard, keep: int) -> None:
        """Reads on: this rank's stream is ``shard``'s now, the same up to its batch ``keep``
        and longer (a loss's rows taken over, :func:`~raytrec.data.parquet_recut.take_over`).
        What the feed holds before ``keep``, replays included, stays; what it read from there
        is dropped. The batches from ``keep`` on come from a pipeline that starts
        ``_READ_ON_LEAD`` batches before them, so it delivers when they are due without
        reading beside the one the rank has all along."""
        assert self._feed is not None, "build() first"
        if not isinstance(shard, IndexedParquetShard) or shard.index != getattr(
            self.shard, "index", None
        ):
            raise TypeError(f"rank {self.spec.rank} reads on its own stream only, not {shard!r}")
        own = shard.index
        self.shard = shard
        size = self.spec.config.data.batch_size

        def step(item: Item) -> int:
            sid, k = split_batch_id(item[0]) if item[0] is not None else (own, -1)
            return k if sid == own else -1

        self._feed.continue_with(
            lambda item: step(item) < keep,
            lambda: shard.identified_batches(size, start_step=keep, ahead=True),
            soon=lambda item: step(item) >= keep - _READ_ON_LEAD,
        )

    def replay(self, batch_ids: list[int], embedding_only: list[int] | None = None) -> int:
        """Queues the batches ``batch_ids`` (a lost gang's uncommitted ones) ahead of this
        rank's own stream; returns how many are queued. Those also in ``embedding_only`` update
        their embedding rows only (their dense gradient is already in the dense parameters)."""
        assert self._feed is not None, "build() first"
        size = self.spec.config.data.batch_size
        shard = self.shard
        if isinstance(shard, IndexedParquetShard):  # consecutive ones read in one pass
            batches = shard.replay_many(batch_ids, size)
        else:
            batches = [shard.replay(i, size) for i in batch_ids]
        self._feed.push_front(list(zip(batch_ids, batches, strict=True)))
        self._embedding_only.update(embedding_only or ())
        return len(batch_ids)

    def train(
        self, num_steps: int, ready_steps: int = 0, *, seq: int = -1, after: int | None = None
    ) -> RankReport:
        """Trains ``num_steps`` prepared batches, then makes sure the next ``ready_steps`` are
        in memory.

        Returns losses, metric states, the batches trained, timings and ``"ready"``, how many
        batches this rank holds prepared now. Preparing the next intervals here saves the
        coordinator a round trip per interval; a data problem found while preparing is
        returned in ``"stop"`` (not raised): the coordinator sends only intervals that every
        rank said it holds, so the job ends at the step boundary before the bad batch.

        ``seq`` numbers the call; ``after``: the call this one was queued behind
        (:class:`IntervalOrder`). A queued call runs only if that call succeeded on every rank
        of the gang: the ranks agree on it over the gang world first, because a rank that went
        on alone would wait in the gang's collectives for a peer that stopped (say one whose
        replica group lost a member in the last step, while this rank's group finished). A
        call skipped returns a report with ``skipped`` set and changes nothing.
        """
        go = self._order.wait_turn(after)
        # Idle from the last call's end to here; the gang's agreement below is a collective
        # like the interval's own, and its wait for a peer still finishing the last interval
        # counts as training time, as it would in the interval's first step.
        last, started = self._last_end, time.perf_counter()
        succeeded = False
        try:
            if after is not None:
                go = self.engine.gang_agrees(go)
            if not go:
                return RankReport(rank=self.spec.rank, step=self.engine.step, skipped=True)
            report = self._train(num_steps, ready_steps, started=started)
            succeeded = True
            return dataclasses.replace(report, idle_s=0.0 if last is None else started - last)
        finally:
            self._last_end = time.perf_counter()
            self._order.ended(seq, succeeded=succeeded)

    def _train(self, num_steps: int, ready_steps: int, *, started: float) -> RankReport:
        assert self._feed is not None, "build() first"
        feed, engine = self._feed, self.engine
        stall_s = 0.0
        # Waits for data since the last interval (a pipeline started again at a membership
        # change, say) belong to this interval: in its time as in its data wait, so that the
        # wait stays a share of the rank's time.
        carried = feed.wait_s
        data_s = carried
        feed.wait_s = 0.0
        self.metrics.reset()
        rows = 0

        def inputs() -> Iterator[StepInput]:
            while True:
                batch_id, batch = feed.take()
                dense = batch_id is None or batch_id not in self._embedding_only
                yield StepInput(batch, dense=dense, batch_id=batch_id)

        sync_s = 0.0
        failed: StepFailed | None = None
        try:
            for event in engine.train_steps(inputs(), num_steps):
                if isinstance(event, StepBegins):
                    stall_s += self.hooks.step_begins(event.step)
                elif isinstance(event, StepResult):
                    self._log_trained(event.step, event.batch_id, event.rows, loss=event.loss)
                    self.metrics.update(event.logits, event.labels)
                    rows += event.rows
                elif isinstance(event, SyncBegins):
                    self.hooks.enters(Phase.SYNC)
                else:
                    sync_s += event.seconds
        except StepFailed as e:
            failed = e
        if failed is not None:
            if failed.began is not None:  # its embedding update may have happened: it counts
                self._log_trained(failed.step, failed.began.batch_id, failed.began.rows)
            # Batches a pipeline took ahead and never started go back to the feed's front, to
            # be trained next (or re-read, if the job re-shares the rows left).
            if failed.unstarted:
                feed.push_front([(i.batch_id, i.batch) for i in failed.unstarted])
            raise failed.error
        stop: BaseException | None = None
        if ready_steps:
            try:
                data_s += self.prepare(ready_steps)
            except Exception as e:  # bad input or the end of the data: the caller decides
                stop = e
            self._feed.wait_s = 0.0
        trained, losses, short = self._take_log()
        return RankReport(
            rank=self.spec.rank,
            step=engine.step,
            losses=tuple(losses),
            trained=tuple(trained),
            rows=rows,
            short=short,
            seconds=time.perf_counter() - started + carried,
            data_wait_s=data_s,
            sync_s=sync_s,
            stall_s=stall_s,
            metrics=self.metrics.state(),
            stop=stop,
            ready=self._feed.buffered(),
        )

    def _log_trained(
        self, step: int, batch_id: int | None, rows: int, *, loss: torch.Tensor | None = None
    ) -> None:
        """Books batch ``batch_id`` as trained at ``step`` (and its loss), for the next report."""
        with self._lock:
            self._trained.append((step, batch_id))
            if batch_id is not None and rows != self.spec.config.data.batch_size:
                self._short.append((batch_id, rows))
            if loss is not None:
                self._losses.append(loss)
        if batch_id is not None:
            self._embedding_only.discard(batch_id)

    def _take_log(
        self,
    ) -> tuple[list[TrainedBatch], list[float], tuple[tuple[int, int], ...]]:
        with self._lock:
            trained, self._trained = self._trained, []
            losses, self._losses = self._losses, []
            short, self._short = tuple(self._short), []
        # One read of the device for the interval's losses (each step's stays where it was made).
        return trained, torch.stack(losses).tolist() if losses else [], short

    def _beat(self) -> None:
        """The heartbeat: every ``elastic.poll_s / 2`` seconds, the step count goes to the job's
        store when it moved, so the coordinator sees a rank that finishes no step within
        ``step_timeout_s + poll_s`` whatever the interval's length. A thread of its own with
        its own connection, so the training loop pays nothing for it; a rank whose process
        is stuck (even holding the GIL) simply stops beating."""
        spec = self.spec
        store = spec.store.connect(timedelta(seconds=300))
        key, sent = progress_key(spec.rank), -1
        while not self._closed.wait(spec.config.elastic.poll_s / 2):
            step = self.engine.step
            if step != sent:
                try:
                    store.set(key, str(step))
                except Exception:  # the coordinator, and with it the store, is gone
                    return
                sent = step

    def abort_replica_planes(self) -> None:
        """Fails this rank's pending replica-plane collectives now (runs beside ``train``)."""
        self.engine.abort_replica_planes()

    def recover(self) -> RankReport:
        """After a failed ``train``: returns the batches trained since the last report, the
        step count, and whether this rank holds the failed step's dense update, not applied
        (the coordinator settles it once the job has re-formed: :meth:`settle_failed_step`)."""
        self.hooks.enters(Phase.REFORM)
        abandoned = self.engine.abandon_failed_step()
        trained, losses, short = self._take_log()
        return RankReport(
            rank=self.spec.rank,
            step=self.engine.step,
            trained=tuple(trained),
            losses=tuple(losses),
            short=short,
            abandoned_dense_update=abandoned,
        )

    def sync(self) -> None:
        self.hooks.enters(Phase.SYNC)
        self.engine.sync()

    def evaluate(
        self, shard: BatchShard, batch_ids: list[int | None], batch_size: int
    ) -> MetricState:
        """Scores held-out batches ``batch_ids`` of ``shard`` (None: a padding round, scored
        for the gang's sharded forward and left out); returns the metric states of the rows
        scored (raytrec.eval_plan)."""
        self.hooks.enters(Phase.EVAL)
        metrics = RankMetrics(auc_window=1 << 62)  # every row counts for the AUC
        pad = next((i for i in batch_ids if i is not None), 0)
        for batch_id in batch_ids:
            # Read once in this rank's life (or ahead: prefetch_held_out), then kept.
            batch = self._held_out.get(shard, pad if batch_id is None else batch_id, batch_size)
            logits, labels = self.engine.score(batch)
            if batch_id is not None:
                metrics.update(logits, labels)
        return metrics.state()

    def prefetch_held_out(self, shard: BatchShard, batch_ids: list[int], batch_size: int) -> None:
        """Starts reading held-out batches ``batch_ids`` of ``shard`` into this rank's keep, in
        the background (:mod:`raytrec.data.held_out`); returns at once. The coordinator sends
        those the rank's next evaluation scores, so the evaluation does not wait on a read."""
        self._held_out.read_ahead(shard, batch_ids, batch_size)

    def save_checkpoint(
        self,
        root: str,
        generation: int,
        extra: dict[str, object],
        retention: CheckpointConfig,
        num_gangs: int,
    ) -> tuple[int, str]:
        """Writes the training state as a checkpoint (a collective in this gang; one gang
        writes for the job). Returns its step and location."""
        from raytrec.checkpoint.state import save_checkpoint

        self.hooks.enters(Phase.CHECKPOINT)
        ref = save_checkpoint(
            self.engine,
            root,
            generation=generation,
            extra=extra,
            num_to_keep=retention,
            num_gangs=num_gangs,
        )
        return ref.step, ref.uri

    def load_checkpoint(
        self, uri: str, stream_start: int | None = None, *, init: bool = False
    ) -> LoadedCheckpoint:
        """Loads a checkpoint (a collective in this gang) and restarts this rank's data stream
        at batch ``stream_start`` of its shard (default: the checkpoint's step). With ``init``
        only the model is taken (weights and optimizer state): the step counter goes back to 0.
        Nothing changes when the checkpoint does not fit."""
        from raytrec.checkpoint.state import load_checkpoint

        loaded = load_checkpoint(self.engine, uri)
        if init:
            self.engine.step = 0
        self._open_feed(start_step=loaded.step if stream_start is None else stream_start)
        return LoadedCheckpoint(
            step=loaded.step, generation=loaded.generation, extra=dict(loaded.extra)
        )

    def save(self, path: str) -> None:
        """Writes this gang's model with torch.distributed.checkpoint (a collective in the gang)."""
        import torch.distributed.checkpoint as dcp

        from raytrec.serving.model_spec import write_model_spec

        self.engine.write_back_caches()
        state: dict[str, Any] = dict(self.engine.model.state_dict())
        if self.engine.state.ids is not None:  # the managed ids' maps, for serving raw ids
            state["managed_ids"] = self.engine.state.ids.named_state()
        dcp.save(state, checkpoint_id=path)
        if self.spec.gang_rank == 0:  # what rebuilds the model outside the job (raytrec.export)
            write_model_spec(path, self.spec.model_spec())

    def unpublished_rows(self, dense: bool, every_row: bool = False) -> PublishedRows:
        """The rows of this rank's shards that changed since the last publish (``every_row``:
        all of them), copied out under their tables' global ids; with ``dense``, the dense
        state dict too (one rank sends it)."""
        from raytrec.engine.publish_rows import read_unpublished

        state = self.engine.state
        assert state.unpublished is not None, "publish.every_n_steps is not set"
        state.write_back_caches()
        return read_unpublished(
            state.model, state.tables, state.unpublished, dense=dense, every_row=every_row
        )

    def rows_published(self) -> None:
        """The job published the model as it is now: no row is unpublished."""
        assert self.engine.state.unpublished is not None, "publish.every_n_steps is not set"
        self.engine.state.unpublished.published()

    def state_digest(self) -> StateDigest:
        """Content hashes of this rank's shard state and dense state, to compare replicas. The
        managed ids' maps, the same on every rank of the job, count as dense state."""
        engine = self.engine
        return StateDigest(
            shards=_digest(engine.shard_state()),
            dense=_digest(engine.dense_state() + engine.state.ids_state()),
        )

    def close(self) -> None:
        self._closed.set()
        self._held_out.close()
        if self._feed is not None:
            self._feed.close()
        self.engine.close()


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


_PROTOCOL: type[RankProtocol] = RankWorker  # mypy checks that the actor answers the protocol
