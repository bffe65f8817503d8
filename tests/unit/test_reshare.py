"""The coordinator's re-sharing of the rows left (actors/reshare.py), driven without Ray: ranks
that train batch by batch in lockstep, a rank lost after a sync (its uncommitted batches
replayed), a rank that joins later. Every row of the job's data is trained once, every rank
reaches the end of the data at the same step, and nothing is re-shared when nothing needs it."""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from actors.data_growth import DataGrowth
from actors.job import AccountingOutcome, DataEnds, Outcome, Prepared, apply_to_accounting
from actors.reshare import DataStreams, StreamTable
from raytrec.data.config import GrowingConfig
from raytrec.data.feed import BatchFeed, DataExhausted
from raytrec.data.generate import write_synthetic_parquet
from raytrec.data.parquet import IndexedParquetShard, ParquetSource
from raytrec.data.parquet_recut import take_over
from raytrec.data.parquet_streams import remaining_rows, stream_length
from raytrec.data.spec import criteo_spec
from raytrec.data.synthetic import batch_id, split_batch_id
from raytrec.elastic.accounting import BatchAccounting
from raytrec.elastic.events import DataReshared, EventLog, FilesLanded
from raytrec.elastic.report import RankReport
from raytrec.elastic.workers import RankLost

ROWS, B, STEPS = 1000, 16, 20  # 3 ranks x 21 batches per epoch; the job takes 20


class Job:
    """What :class:`DataStreams` needs of the job (its ports, and its shared state as ``view``),
    with ranks that keep their feed in memory: ``feeds[r]``: the batch ids it trains next,
    replays first."""

    def __init__(self, shards: Sequence[IndexedParquetShard], *, sync: int = 4) -> None:
        self.sync = sync
        self.step = 0
        self.events = EventLog()
        self.view, self.call, self.now, self.record = (
            self,
            self._call,
            self._now,
            self.events.append,
        )
        self.table = StreamTable(shards[0], batch_size=B)
        self.streams = DataStreams(self, self.table)  # type: ignore[arg-type]
        self.end_step = STEPS
        self.accounting = BatchAccounting(range(len(shards)), stream_id=batch_id)
        self.feeds: dict[int, collections.deque[int]] = {}
        self.gang_of: dict[int, int] = {}
        for r, shard in enumerate(shards):
            self.accounting.add_rank(r, shard=r, step=0)
            self._read(r, shard)
        self.trained: list[tuple[int, int]] = []  # (rank, batch id)
        self.last_sync = 0
        self.reopened: list[int] = []  # ranks given a new stream, in order
        self.extended: list[int] = []  # ranks that read on in a longer stream, in order
        self.lost: set[int] = set()  # ranks whose next set_shard fails (they died)
        self.clock = FakeClock()

    def _now(self) -> float:
        return time.monotonic()

    def ranks_in_gang_order(self) -> list[int]:
        return sorted(self.feeds)

    def apply(self, outcome: Outcome) -> None:
        """The outcome of a re-share: where the data now ends (the ranks' prepared batches,
        which they keep in their feeds here, are not counted), or what it changed in the
        batch accounting, applied as the loop applies it."""
        assert isinstance(outcome, DataEnds | Prepared | AccountingOutcome)
        if isinstance(outcome, DataEnds):
            self.end_step = outcome.end_step
        elif not isinstance(outcome, Prepared):
            apply_to_accounting(self.accounting, outcome)

    def _call(self, ranks: list[int], invoke: Any) -> list[Any]:
        """A call on ranks, as the coordinator makes it (``invoke(rank, job_rank)``)."""
        return [invoke(FeedRank(self, r), r) for r in ranks]

    def _read(self, rank: int, shard: IndexedParquetShard, replay: Sequence[int] = ()) -> None:
        own = [batch_id(shard.index, k) for k in range(stream_length(shard.stream(B)))]
        self.feeds[rank] = collections.deque([*replay, *own])

    def _run(self, rank: int, steps: int) -> RankReport:
        ids = [self.feeds[rank].popleft() for _ in range(steps)]
        self.trained += [(rank, i) for i in ids]
        trained = tuple(zip(range(self.step + 1, self.step + steps + 1), ids, strict=True))
        return RankReport(rank=rank, step=self.step + steps, trained=trained)

    def _record(self, reports: list[RankReport], **kw: Any) -> None:
        last = self.accounting.record(
            reports,
            gang_of=lambda r: r,
            live_gangs=sorted(self.feeds),
            last_sync_step=self.last_sync,
            is_job_wide_sync=lambda s: s % self.sync == 0,
            **kw,
        )
        self.last_sync = self.last_sync if last is None else last

    def train(self, steps: int) -> None:
        """Every live rank trains ``steps`` batches (a job-wide sync every ``sync`` steps)."""
        self._record([self._run(r, steps) for r in sorted(self.feeds)])
        self.step += steps

    def lose(self, rank: int, *, steps: int, fed: bool = False) -> None:
        """``rank`` dies ``steps`` steps into an interval, as the coordinator sees it: the
        survivors report what they trained, the lost rank's batches are the next ones of its
        stream; the sync at the failed step did not complete."""
        fail = self.step + steps
        survivors = sorted(r for r in self.feeds if r != rank)
        reports = [self._run(r, steps) for r in survivors]
        reports += self.accounting.lost_rank_reports([rank], fail_step=fail)
        self._record(reports, completed_through=fail - 1)
        del self.feeds[rank]
        self.step = fail
        replay = self.accounting.apply_drop(
            self.accounting.plan_drop([rank], survivors, ranks_of=lambda g: [g])
        )
        assert replay  # batches it trained after the last sync
        if fed:  # the re-form hands the replays over, as the coordinator's does
            for r, ids in replay.items():
                self.feeds[r].extendleft(reversed(ids))
        self.accounting.commit(survivors)  # the re-formed job's first sync
        self.last_sync = fail
        assert self.streams.reshare(survivors, fed=fed)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[IndexedParquetShard]:
    out = tmp_path_factory.mktemp("reshare")
    write_synthetic_parquet(
        out, rows=ROWS, files=3, row_groups_per_file=2, seed=1, num_embeddings=50
    )
    source = ParquetSource(paths=str(out), spec=criteo_spec(50), read_mode="indexed")
    split = source.split(3)
    assert all(isinstance(s, IndexedParquetShard) for s in split)
    return [
        s.with_table({"made": {}}, limit=STEPS) for s in split if isinstance(s, IndexedParquetShard)
    ]


def rows_of(job: Job, ids: Sequence[int]) -> np.ndarray:
    """Global row numbers (file order) of the batches ``ids``."""
    shard = job.table.shard(0)
    paths = shard.paths
    firsts = np.cumsum([0] + [sum(g) for g in shard.row_groups])
    out = [
        np.arange(p.file_row, p.file_row + p.rows) + firsts[paths.index(p.path)]
        for i in ids
        for p in shard.batch_pieces(i, B)
    ]
    return np.concatenate(out)


def test_a_loss_and_a_join_leave_every_row_of_the_job_trained_once(
    shards: list[IndexedParquetShard],
) -> None:
    job = Job(shards)
    expected = rows_of(job, [batch_id(r, k) for r in range(3) for k in range(STEPS)])
    job.train(6)
    job.lose(2, steps=3)  # at step 9: it trained 5..8 after the sync of step 4
    reshares = job.events.of(DataReshared)
    assert len(reshares) == 1 and reshares[0].ranks == 2 and reshares[0].left_over == 0
    assert len(job.feeds[0]) == len(job.feeds[1]) == job.end_step - job.step
    assert job.end_step > STEPS  # the survivors train the lost rank's rows too
    job.train(3)
    # Rank 7 joins (not booked yet): it is given the ends of the others' streams, which go on.
    job.accounting.add_gangs([7])
    job.feeds[7] = collections.deque()
    before = {r: list(job.feeds[r]) for r in (0, 1)}
    job.reopened = []
    assert job.streams.reshare([0, 1, 7], joining=[7]) == [7]
    assert job.reopened == [7]
    assert len({len(f) for f in job.feeds.values()}) == 1
    assert job.end_step - job.step == len(job.feeds[7])
    for r in (0, 1):  # the same batches next, fewer of them
        assert list(job.feeds[r]) == before[r][: len(job.feeds[r])] and job.feeds[r]
    (_, handoff) = job.events.of(DataReshared)
    assert handoff.handed_off and handoff.ranks == 1
    job.train(job.end_step - job.step)
    assert all(not f for f in job.feeds.values())
    job.accounting.commit(sorted(job.feeds))

    committed = [i for a, b in job.accounting.committed() for i in range(a, b)]
    assert job.accounting.committed_count() == len(committed)  # none twice
    assert job.accounting.replay_pending() == 0
    assert sorted(rows_of(job, committed).tolist()) == sorted(expected.tolist())
    # Nothing left to share: a change that orphans no rows keeps the streams.
    assert not job.streams.reshare([0, 1, 7])


def test_survivors_of_a_loss_read_on_and_take_the_lost_rank_s_rows_after_their_part(
    shards: list[IndexedParquetShard],
) -> None:
    """With the replays in their feeds already (``fed``), the survivors of a loss keep their
    streams: the batches to the end of the part they are in stay next in their feeds, in the
    same order, after the replays; the rows after those and the lost rank's are appended. Two
    losses, then every row of the job was trained once."""
    job = Job(shards)
    expected = rows_of(job, [batch_id(r, k) for r in range(3) for k in range(STEPS)])
    job.train(6)
    before = {r: list(job.feeds[r]) for r in (0, 1)}
    job.lose(2, steps=3, fed=True)
    assert job.reopened == [] and job.extended == [0, 1]
    (reshared,) = job.events.of(DataReshared)
    assert reshared.taken_over and reshared.ranks == 2 and reshared.left_over == 0
    assert len(job.feeds[0]) == len(job.feeds[1]) == job.end_step - job.step
    assert job.end_step > STEPS
    for r in (0, 1):  # replays first, then the same batches as before, up to the part's end
        _, at, queued = job.accounting.streams.position(r)  # type: ignore[union-attr]
        assert list(job.feeds[r])[: len(queued)] == list(queued)
        own = list(job.feeds[r])[len(queued) :]
        assert own[: STEPS - at] == before[r][3 : STEPS - at + 3]
    job.train(4)
    job.lose(1, steps=2, fed=True)
    assert job.extended == [0, 1, 0]
    job.train(job.end_step - job.step)
    assert not job.feeds[0]
    job.accounting.commit([0])

    committed = [i for a, b in job.accounting.committed() for i in range(a, b)]
    assert job.accounting.committed_count() == len(committed)  # none twice
    assert job.accounting.replay_pending() == 0
    assert sorted(rows_of(job, committed).tolist()) == sorted(expected.tolist())


def test_a_loss_at_the_very_end_of_the_data_ends_with_the_shortest_rank(
    shards: list[IndexedParquetShard],
) -> None:
    """Rank 2 dies in the job's last step, after a sync at step 15: its 5 uncommitted batches
    go 3 and 2 to the survivors and no rows are left to even that out. The job ends when the
    rank with 2 is done; the one replay beyond it is not trained, and is counted."""
    job = Job(shards, sync=5)
    job.train(STEPS - 1)
    job.lose(2, steps=1)
    assert [len(job.feeds[0]), len(job.feeds[1])] == [3, 2]
    (reshared,) = job.events.of(DataReshared)
    assert reshared.rows == 0 and reshared.batches == 2
    assert job.end_step == STEPS + 2
    job.train(2)
    job.accounting.commit(sorted(job.feeds))
    assert job.accounting.replay_pending() == 1


def growing_job(tmp_path: pathlib.Path) -> tuple[Job, ParquetSource, list[str]]:
    """A job of 3 ranks on the first two of three files in ``tmp_path``."""
    write_synthetic_parquet(
        tmp_path, rows=ROWS, files=3, row_groups_per_file=2, seed=1, num_embeddings=50
    )
    paths = sorted(str(p) for p in tmp_path.glob("*.parquet"))
    source = ParquetSource(paths=paths[:2], spec=criteo_spec(50), read_mode="indexed")
    split = [s for s in source.split(3) if isinstance(s, IndexedParquetShard)]
    return Job([s.with_table({"made": {}}, limit=100) for s in split]), source, paths


def test_files_that_land_mid_job_are_shared_with_the_rows_left_each_row_trained_once(
    tmp_path: pathlib.Path,
) -> None:
    """A growing source: the job starts on two of three files; the third lands at step 4 and
    its rows, with the rows left, are cut again among the ranks; a rank is lost after it. Every
    row of the three files is trained once, and the table saved in a checkpoint names the
    files in the order found."""
    job, source, paths = growing_job(tmp_path)
    job.table.growing = True
    job.end_step = job.table.length(0)
    job.train(4)
    (landed,) = source.footers(paths[2:])
    job.reopened = []
    rows, first = job.streams.grow([landed.path], [landed.row_group_rows]) or (0, 0)
    assert rows == landed.rows
    # The first batch of the new streams to hold a new row, found by reading every batch's rows.
    known = sum(i.rows for i in source.footers(paths[:2]))
    left = job.end_step - job.step
    new = range(job.table.next_id - 3, job.table.next_id)
    holds = [
        k for k in range(left) if any(rows_of(job, [batch_id(s, k)]).max() >= known for s in new)
    ]
    assert first == holds[0] and len(holds) > left // 2
    assert job.reopened == [0, 1, 2]  # every rank reads a new stream
    assert len({len(f) for f in job.feeds.values()}) == 1
    assert job.end_step - job.step == len(job.feeds[0])
    job.train(3)
    job.lose(2, steps=2)
    # Replays are queued: files found now wait for a later boundary.
    assert job.streams.grow([landed.path], [landed.row_group_rows]) is None
    job.train(job.end_step - job.step)
    job.accounting.commit(sorted(job.feeds))
    committed = [i for a, b in job.accounting.committed() for i in range(a, b)]
    assert job.accounting.committed_count() == len(committed)  # none twice
    assert sorted(rows_of(job, committed).tolist()) == list(range(ROWS))
    saved = job.table.to_json()
    assert saved["files"]["paths"] == paths
    fresh = StreamTable(job.table.template.with_files(paths[:2], []), batch_size=B)
    fresh.load(saved)
    assert fresh.template.paths == tuple(paths) and fresh.made == job.table.made


def test_too_few_new_rows_to_give_every_rank_a_batch_wait(
    shards: list[IndexedParquetShard],
) -> None:
    job = Job(shards)
    job.train(STEPS)  # every row of the job trained: none left
    assert job.streams.grow(["/nowhere.parquet"], [(2,)]) is None  # 2 rows, 3 ranks
    assert not job.events.of(DataReshared)


def test_files_being_shared_when_a_rank_dies_are_added_once(tmp_path: pathlib.Path) -> None:
    """The coordinator's watch (actors/data_growth.py) finds a third file; a rank dies as the
    rows are handed out. The file is in the job's data once: the next listing does not add it
    again (the recovery shares the rows left, its rows among them)."""
    job, _, paths = growing_job(tmp_path)
    job.end_step = job.table.length(0)
    growth = DataGrowth(job, job.streams, config=GrowingConfig(poll_s=5), root=str(tmp_path))  # type: ignore[arg-type]
    job.train(4)
    job.lost = {2}
    with pytest.raises(RankLost):
        growth.poll()
    assert job.table.template.paths == tuple(paths)
    (landed,) = job.events.of(FilesLanded)
    assert landed.paths == (paths[2],) and landed.first_step is None
    job.clock.now += 5
    assert not growth.poll() and job.table.template.paths == tuple(paths)
    assert job.events.of(FilesLanded) == (landed,)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class FeedRank:
    """What :class:`DataStreams` asks of a rank of :class:`Job`."""

    def __init__(self, job: Job, rank: int) -> None:
        self.job, self.rank = job, rank

    def set_shard(
        self, shard: IndexedParquetShard, replay: list[int], embedding_only: list[int]
    ) -> None:
        """A new stream, after the replays."""
        if self.rank in self.job.lost:
            raise RankLost(self.rank, "killed")
        assert embedding_only == []  # nothing here reached the dense parameters before
        self.job.reopened.append(self.rank)
        self.job._read(self.rank, shard, replay)

    def extend_stream(self, shard: IndexedParquetShard, keep: int) -> None:
        """A survivor of a loss reads on: its feed keeps what comes before ``keep`` of its own
        stream (replays included) and then has the stream's batches from ``keep`` on."""
        job = self.job
        sid = shard.index
        assert sid == job.accounting.streams.position(self.rank)[0]  # type: ignore[union-attr]
        job.extended.append(self.rank)
        kept = [
            i
            for i in job.feeds[self.rank]
            if split_batch_id(i)[0] != sid or split_batch_id(i)[1] < keep
        ]
        more = [batch_id(sid, k) for k in range(keep, stream_length(shard.stream(B)))]
        job.feeds[self.rank] = collections.deque([*kept, *more])

    def set_streams(self, streams: dict[int, Any]) -> None:
        """The others at a join that hands off their streams' ends: they read on; the
        coordinator will not ask them for the batches beyond their stream's new end."""
        job = self.job
        sid, _, _ = job.accounting.streams.position(self.rank)  # type: ignore[union-attr]
        end = stream_length(streams[sid])
        job.feeds[self.rank] = collections.deque(
            i
            for i in job.feeds[self.rank]
            if split_batch_id(i)[0] != sid or split_batch_id(i)[1] < end
        )


def test_a_rank_that_reads_on_gets_the_longer_stream_s_batches_bitwise(
    shards: list[IndexedParquetShard],
) -> None:
    """A survivor's feed, continued at ``keep`` with the longer stream read ahead, gives what
    reading that longer stream from the survivor's position gives: the same ids and the same
    rows, the batches it held before ``keep`` included."""
    own = [dataclasses.replace(s, in_process=True) for s in shards]
    at = 5
    orphaned = remaining_rows(own[2].stream(B), at)
    plan = take_over([(own[r].stream(B), at, 0) for r in (0, 1)], orphaned, batch_size=B)
    assert plan is not None
    longer = own[0].with_stream(0, {0: plan.streams[0]})
    feed = BatchFeed(own[0].identified_batches(B, start_step=at), prefetch=3, background=False)
    feed.prepare(4)
    got = [feed.take() for _ in range(2)]
    keep = plan.keep[0]
    feed.continue_with(
        lambda item: item[0] is None or split_batch_id(item[0])[1] < keep,
        lambda: longer.identified_batches(B, start_step=keep, ahead=True),
    )
    left = plan.batches - 2
    feed.prepare(left)
    got += [feed.take() for _ in range(left)]
    with pytest.raises(DataExhausted):
        feed.prepare(1)
    expected = list(longer.identified_batches(B, start_step=at))
    assert [i for i, _ in got] == [i for i, _ in expected]
    assert len(expected) > stream_length(own[0].stream(B)) - at  # it took rows over
    for (_, a), (_, b) in zip(got, expected, strict=True):
        assert torch.equal(a.labels, b.labels) and torch.equal(a.dense_features, b.dense_features)
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
