"""Held-out batches read ahead (raytrec.data.held_out, actors.evaluation): a rank reads each
batch once, in the background or at the evaluation that needs it first, and the coordinator
sends each rank the batches its next evaluation will assign it after the start and after every
membership change, so that no evaluation waits on a rank's first read."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

from actors.coordinator import Coordinator
from actors.evaluation import JobEvaluation
from actors.rank import RankHooks, RankWorker
from raytrec.config import DataConfig, EvalConfig, ScalingConfig, SyncConfig, TrainConfig
from raytrec.data.held_out import HeldOutBatches
from raytrec.data.parquet_indexed import IndexedParquetShard
from raytrec.data.source import Batch, BatchShard
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import GangDropped, GangJoined, GenerationStarted
from raytrec.eval_plan import EvalPlan, assign_eval_batches
from raytrec.observability.rec_metrics import MetricState
from simulation.doubles.fake_faults import FakeShard, NodesJoin, RankDies
from simulation.doubles.fake_group import FakeWorkerGroup
from simulation.fault_space import parquet_shards

BATCH = 8
WAIT_S = 30.0  # a bound on waits for the reader thread, never reached when the code is right


@pytest.fixture(scope="module")
def shard() -> IndexedParquetShard:
    """A held-out set read by index (a tiny generated Parquet file)."""
    held_out = parquet_shards(1, 4)[0]
    assert isinstance(held_out, IndexedParquetShard)
    return held_out


def _same(a: Batch, b: Batch) -> bool:
    return bool(
        (a.dense_features == b.dense_features).all()
        and (a.labels == b.labels).all()
        and (a.sparse_features.values() == b.sparse_features.values()).all()
        and (a.sparse_features.lengths() == b.sparse_features.lengths()).all()
    )


class Reads:
    """Every read of a held-out batch (``IndexedParquetShard.replay``): its id and the thread
    that read it. ``hold``: batch ids whose read waits for ``release``; ``fail``: batch id ->
    how many of its reads raise (then reads succeed)."""

    def __init__(self, hold: Collection[int] = (), fail: dict[int, int] | None = None) -> None:
        self.hold, self.fail = set(hold), dict(fail or {})
        self.log: list[tuple[int, str]] = []
        self.started = threading.Event()  # a held read began
        self.release = threading.Event()
        self.tried = threading.Event()  # a failing read raised
        self._original = IndexedParquetShard.replay

    def __call__(self, shard: IndexedParquetShard, batch_id: int, batch_size: int) -> Batch:
        self.log.append((batch_id, threading.current_thread().name))
        if batch_id in self.hold:
            self.started.set()
            assert self.release.wait(WAIT_S)
        if self.fail.get(batch_id, 0) > 0:
            self.fail[batch_id] -= 1
            self.tried.set()
            raise ValueError(f"bad rows in row group 0 of {shard.paths[0]} (batch {batch_id})")
        return self._original(shard, batch_id, batch_size)

    def of(self, batch_id: int) -> list[str]:
        """The threads that read ``batch_id``, in order."""
        return [t for b, t in self.log if b == batch_id]


@contextlib.contextmanager
def reads(**kwargs: Any) -> Iterator[Reads]:
    counter = Reads(**kwargs)
    with mock.patch.object(IndexedParquetShard, "replay", autospec=True, side_effect=counter):
        yield counter


def _settled(cache: HeldOutBatches) -> None:
    """Waits until every read under way or queued ended (each batch's future is done)."""
    for future in list(cache._batches.values()):
        with contextlib.suppress(Exception):
            future.exception(timeout=WAIT_S)


# -- the rank's side -------------------------------------------------------------------------


def test_a_read_ahead_then_an_evaluation_reads_each_batch_once(
    shard: IndexedParquetShard,
) -> None:
    expected = {b: shard.replay(b, BATCH) for b in (0, 2, 3)}  # read directly, the reference
    cache = HeldOutBatches()
    with reads() as counted:
        cache.read_ahead(shard, [0, 2, 3], BATCH)
        cache.read_ahead(shard, [2, 3], BATCH)  # sent again: nothing read again
        _settled(cache)
        got = {b: cache.get(shard, b, BATCH) for b in (3, 0, 2, 3)}
    assert {b: len(counted.of(b)) for b in (0, 2, 3)} == {0: 1, 2: 1, 3: 1}
    assert {t for _, t in counted.log} == {"held-out-reader"}  # none read at the evaluation
    assert all(_same(got[b], expected[b]) for b in expected)
    cache.close()


def test_an_evaluation_waits_for_a_read_under_way_and_reads_one_not_reached_itself(
    shard: IndexedParquetShard,
) -> None:
    cache = HeldOutBatches()
    with reads(hold={1}) as counted:
        cache.read_ahead(shard, [1, 4], BATCH)
        assert counted.started.wait(WAIT_S)  # the reader is inside batch 1's read
        # Batch 4 is queued behind it: the evaluation reads it itself rather than wait.
        four = cache.get(shard, 4, BATCH)
        got: list[Batch] = []
        waiter = threading.Thread(target=lambda: got.append(cache.get(shard, 1, BATCH)))
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive() and not got  # waits for the reader's batch 1
        counted.release.set()
        waiter.join(WAIT_S)
        _settled(cache)
    assert got and _same(got[0], shard.replay(1, BATCH)) and _same(four, shard.replay(4, BATCH))
    assert counted.of(1) == ["held-out-reader"]
    assert counted.of(4) == ["MainThread"]  # read once: the reader skipped it
    cache.close()


@pytest.mark.parametrize("failures", [1, 2])
def test_a_failed_read_ahead_leaves_the_evaluation_to_read_and_raise(
    shard: IndexedParquetShard, failures: int
) -> None:
    """The read ahead fails; the evaluation's own read succeeds (``failures`` 1) or fails too
    and raises its error (2), and the batch is then read again at the next evaluation."""
    cache = HeldOutBatches()
    with reads(fail={2: failures}) as counted:
        cache.read_ahead(shard, [2], BATCH)
        assert counted.tried.wait(WAIT_S)
        _settled(cache)
        if failures == 2:
            with pytest.raises(ValueError, match=r"bad rows in row group 0 of .*\(batch 2\)"):
                cache.get(shard, 2, BATCH)
        batch = cache.get(shard, 2, BATCH)
        assert cache.get(shard, 2, BATCH) is batch  # kept once read
    assert counted.of(2) == ["held-out-reader"] + ["MainThread"] * failures
    assert _same(batch, shard.replay(2, BATCH))
    cache.close()


def test_closing_does_not_wait_for_a_read_under_way(shard: IndexedParquetShard) -> None:
    cache = HeldOutBatches()
    with reads(hold={0}) as counted:
        cache.read_ahead(shard, [0, 1], BATCH)
        assert counted.started.wait(WAIT_S)
        cache.close()  # returns while batch 0's read is stuck
        cache.read_ahead(shard, [3], BATCH)  # closed: nothing more is read ahead
        counted.release.set()
        assert cache._reader is not None
        cache._reader.join(WAIT_S)
        assert not cache._reader.is_alive()
        one = cache.get(shard, 1, BATCH)  # never read ahead: read here
    assert counted.of(0) == ["held-out-reader"] and counted.of(1) == ["MainThread"]
    assert counted.of(3) == [] and _same(one, shard.replay(1, BATCH))


class ScoringEngine:
    """A rank engine that scores every row 0 (logit) and books the batches it scored."""

    def __init__(self) -> None:
        self.scored: list[Batch] = []

    def score(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        self.scored.append(batch)
        return torch.zeros(batch.labels.shape[0]), batch.labels


def test_a_rank_prefetches_then_scores_each_batch_read_once(shard: IndexedParquetShard) -> None:
    """:meth:`RankWorker.prefetch_held_out`, then :meth:`RankWorker.evaluate` over the same
    batches (and a padding round): every batch read once, by the reader thread."""
    rank = RankWorker.__new__(RankWorker)  # the parts evaluate uses, without a gang world
    rank.hooks, rank._held_out, rank.engine = RankHooks(), HeldOutBatches(), ScoringEngine()
    with reads() as counted:
        rank.prefetch_held_out(shard, [1, 3], BATCH)
        _settled(rank._held_out)
        state = rank.evaluate(shard, [1, 3, None], BATCH)
        state_again = rank.evaluate(shard, [1, 3, None], BATCH)
    assert counted.log == [(1, "held-out-reader"), (3, "held-out-reader")]
    expected = [shard.replay(b, BATCH) for b in (1, 3, 1)]
    assert all(_same(a, b) for a, b in zip(rank.engine.scored[:3], expected, strict=True))
    rows = sum(len(b.labels) for b in expected[:2])  # the padding round is not counted
    assert state["rows"] == state_again["rows"] == rows
    rank._held_out.close()


class CountedShard(FakeShard):
    """A shard not read by index: its batches are not kept."""

    def __init__(self) -> None:
        super().__init__(0)
        self.read: list[int] = []

    def replay(self, batch_id: int, batch_size: int) -> Batch:
        self.read.append(batch_id)
        return mock.sentinel.batch  # type: ignore[no-any-return]


def test_a_source_not_read_by_index_is_neither_read_ahead_nor_kept() -> None:
    other = CountedShard()
    cache = HeldOutBatches()
    cache.read_ahead(other, [0, 1], BATCH)
    assert cache._reader is None and other.read == []
    cache.get(other, 1, BATCH), cache.get(other, 1, BATCH)
    assert other.read == [1, 1]


# -- the coordinator's side ------------------------------------------------------------------


class Ports:
    """The ports :class:`JobEvaluation` calls, over ranks that book what they are sent."""

    def __init__(self, gang_of: dict[int, int]) -> None:
        self.gangs = dict(gang_of)
        self.sent: dict[int, list[list[int]]] = {}
        self.scored: dict[int, list[int | None]] = {}

    def live_ranks(self) -> list[int]:
        return sorted(self.gangs)

    def gang_of(self, rank: int) -> int:
        return self.gangs[rank]

    def call(self, ranks: list[int], invoke: Callable[[Any, int], Any]) -> list[Any]:
        return [invoke(Rank(self, r), r) for r in ranks]

    def step(self) -> int:
        return 8

    def sync(self) -> None:
        pass

    def record(self, event: Any) -> None:
        pass

    def now(self) -> float:
        return 0.0


class Rank:
    """One rank as :class:`Ports` calls it."""

    def __init__(self, ports: Ports, rank: int) -> None:
        self.ports, self.rank = ports, rank

    def prefetch_held_out(self, shard: BatchShard, batch_ids: list[int], batch_size: int) -> None:
        self.ports.sent.setdefault(self.rank, []).append(list(batch_ids))

    def evaluate(
        self, shard: BatchShard, batch_ids: list[int | None], batch_size: int
    ) -> MetricState:
        self.ports.scored[self.rank] = list(batch_ids)
        return {"ne": np.zeros(4), "preds": np.zeros(0), "labels": np.zeros(0), "rows": 0}


def _evaluation(shard: BatchShard, gang_of: dict[int, int], batches: int) -> tuple[Any, Ports]:
    ports = Ports(gang_of)
    plan = EvalPlan(num_batches=batches, batch_size=BATCH, rows=batches * BATCH)
    return JobEvaluation(shard, plan, config=EvalConfig(every_n_steps=4), job=ports), ports


def _started(
    shard: BatchShard, gang_of: dict[int, int], batches: int
) -> tuple[Any, Ports, dict[int, list[int]]]:
    """An evaluation whose ranks were sent their batches at the start (what each was sent)."""
    ev, ports = _evaluation(shard, gang_of, batches)
    ev.read_ahead()
    return ev, ports, _sent(ports)


def _sent(ports: Ports) -> dict[int, list[int]]:
    """Rank -> the ids sent in its one call since the last look (and forgets them)."""
    assert all(len(calls) == 1 for calls in ports.sent.values()), ports.sent
    sent = {r: calls[0] for r, calls in ports.sent.items()}
    ports.sent.clear()
    return sent


def _real(batches: list[int | None]) -> list[int]:
    return [b for b in batches if b is not None]


def test_after_the_start_each_rank_is_sent_the_batches_of_its_first_evaluation(
    shard: IndexedParquetShard,
) -> None:
    ev, ports = _evaluation(shard, {0: 0, 1: 0, 2: 1, 3: 1}, batches=10)
    ev.read_ahead()
    first = assign_eval_batches(10, [0, 1, 2, 3])
    assert _sent(ports) == {r: _real(first[r]) for r in range(4)}
    ev.run()
    assert {r: _real(b) for r, b in ports.scored.items()} == {r: _real(first[r]) for r in first}
    ev.read_ahead()  # nothing changed: nothing to send
    assert ports.sent == {}


def test_after_a_loss_only_the_lost_ranks_batches_are_sent_to_the_survivors_taking_them(
    shard: IndexedParquetShard,
) -> None:
    ev, ports, first = _started(shard, {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}, batches=12)
    ev.run()
    del ports.gangs[2], ports.gangs[3]  # gang 1 lost
    ev.read_ahead()
    sent = _sent(ports)
    assert sorted(b for ids in sent.values() for b in ids) == sorted(first[2] + first[3])
    assert all(not set(ids) & set(first[r]) for r, ids in sent.items())
    ports.scored.clear()
    ev.run()  # the survivors score what they held and what they were sent, nothing else
    for r, batches in ports.scored.items():
        assert sorted(_real(batches)) == sorted(first[r] + sent.get(r, []))
    assert sorted(b for x in ports.scored.values() for b in _real(x)) == list(range(12))


def test_a_loss_before_any_evaluation_keeps_what_the_survivors_read_ahead(
    shard: IndexedParquetShard,
) -> None:
    ev, ports, first = _started(shard, {0: 0, 1: 0, 2: 1, 3: 1}, batches=8)
    del ports.gangs[0], ports.gangs[1]
    ev.read_ahead()
    assert sorted(b for ids in _sent(ports).values() for b in ids) == sorted(first[0] + first[1])
    ev.run()
    assert all(set(first[r]) <= set(_real(ports.scored[r])) for r in (2, 3))


def test_a_joined_gang_is_sent_the_lost_gangs_batches_or_what_it_pads_with(
    shard: IndexedParquetShard,
) -> None:
    ev, ports, first = _started(shard, {0: 0, 1: 0, 2: 1, 3: 1}, batches=8)
    ev.run()
    del ports.gangs[0], ports.gangs[1]
    ports.gangs.update({4: 2, 5: 2})  # gang 0 lost and gang 2 joined, in one change
    ev.read_ahead()
    assert _sent(ports) == {4: first[0], 5: first[1]}  # the joined gang takes them first
    ev.run()
    # A gang that joins with nothing to take scores nothing, and is sent nothing.
    ports.gangs.update({6: 3, 7: 3})
    ev.read_ahead()
    assert ports.sent == {}
    # With fewer batches than ranks, a rank with only a padding round scores batch 0 again:
    # it is sent batch 0 once.
    ev, ports = _evaluation(shard, {0: 0, 1: 0, 2: 1, 3: 1}, batches=3)
    ev.read_ahead()
    assert _sent(ports) == {0: [0], 1: [1], 2: [2], 3: [0]}
    ev.run()
    assert ports.scored[3] == [None]
    ev.read_ahead()
    assert ports.sent == {}


def test_a_held_out_set_not_read_by_index_is_not_read_ahead() -> None:
    ev, ports = _evaluation(CountedShard(), {0: 0, 1: 1}, batches=4)
    ev.read_ahead()
    assert ports.sent == {} and ev.held == {}


# -- the real coordinator over the fake worker group ------------------------------------------


def _job(tmp_path: Any, *faults: Any, eval_batches: int = 6) -> tuple[Coordinator, FakeWorkerGroup]:
    """3 gangs of 2 ranks for 24 steps, evaluating every 8 steps, over the fake."""
    cfg = TrainConfig(
        scaling=ScalingConfig(num_workers=6, gang_size=2, ranks_per_host=2),
        data=DataConfig(batch_size=BATCH),
        sync=SyncConfig(sync_every=4),
        elastic=ElasticConfig(
            grow=True, max_gangs=3, collective_timeout_s=10.0, step_timeout_s=30.0, poll_s=1.0
        ),
        eval=EvalConfig(every_n_steps=8),
        num_steps=24,
        log_every=2,
        storage_path=str(tmp_path),
    )
    group = FakeWorkerGroup(nodes=3, cpus_per_node=2, faults=faults, step_s=0.1, build_s=1.0)
    (held_out,) = parquet_shards(1, 4)
    plan = EvalPlan(num_batches=eval_batches, batch_size=BATCH, rows=eval_batches * BATCH)
    coordinator = Coordinator(
        cfg,
        plan=None,  # type: ignore[arg-type]  # only the ranks read it
        shards=[FakeShard(i) for i in range(6)],
        num_dense=13,
        run_dir=str(tmp_path),
        new_shard=FakeShard,
        evaluation=(held_out, plan),
        group=group,
        clock=group.clock,
    )
    return coordinator, group


def _check_read_ahead(summary: Any, group: FakeWorkerGroup, batches: int) -> None:
    """Every live rank scored only batches it had been sent to read ahead, each sent once;
    every held-out batch was scored; every trained batch is in the final model once."""
    scored_anywhere: set[int] = set()
    for r in sorted(summary.state_digests):  # the live ranks at the end
        read_ahead, scored = group.held_out(r)
        assert len(read_ahead) == len(set(read_ahead)), f"rank {r} was sent a batch twice"
        assert set(scored) <= set(read_ahead), f"rank {r} scored a batch it did not read ahead"
        scored_anywhere |= set(scored)
    assert scored_anywhere == set(range(batches))
    committed = [i for a, b in summary.committed_batches for i in range(a, b)]
    assert summary.lost_batches == 0 and len(committed) == len(set(committed))
    assert group.model_batches(summary.final_state_path) == collections.Counter(committed)


def test_every_batch_a_rank_scores_was_read_ahead_on_it_across_a_loss_and_a_join(
    tmp_path: Any,
) -> None:
    # Rank 3 dies at step 6 (gang 1 dropped); a node joins and gang 3 heals in (step 16).
    coordinator, group = _job(tmp_path, RankDies(rank=3, step=6), NodesJoin(at=2.0))
    summary = coordinator.run()
    assert summary.steps == 24 and [e.gang_id for e in summary.events.of(GangJoined)] == [3]
    assert len(summary.events.of(GenerationStarted)) == 3  # start, the loss, the join
    _check_read_ahead(summary, group, 6)
    # Gang 1's batches went to gang 0 as the job re-formed (step 6); gang 3 joined later (step
    # 16), with none left to take: it was sent nothing and scored nothing.
    assert [group.held_out(r)[0] for r in range(4)] == [[0, 2], [1, 3], [2], [3]]
    assert group.held_out(6) == group.held_out(7) == ([], [])


def test_a_rank_lost_as_it_is_sent_its_batches_is_recovered_from(tmp_path: Any) -> None:
    coordinator, group = _job(tmp_path, RankDies(rank=1, on="prefetch_held_out"))
    summary = coordinator.run()
    assert summary.steps == 24
    assert [e.gang_id for e in summary.events.of(GangDropped)] == [0]
    assert sorted(summary.state_digests) == [2, 3, 4, 5, 6, 7]
    _check_read_ahead(summary, group, 6)
