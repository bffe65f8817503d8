"""Exactly-once batch accounting through a failure, a replay, a rewind to a checkpoint and the
final commit (pure)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from raytrec.elastic.accounting import BatchAccounting
from raytrec.elastic.ledger import LedgerError
from raytrec.elastic.report import RankReport
from raytrec.elastic.rollback import plan_streams
from raytrec.elastic.streams import StreamError

GANGS = {0: (0, 1), 1: (2, 3)}  # gang id -> job ranks


def stream_id(shard: int, k: int) -> int:
    return shard * 1000 + k


def gang_of(rank: int) -> int:
    return next(g for g, ranks in GANGS.items() if rank in ranks)


def every_second_step(step: int) -> bool:
    return step % 2 == 0


def report(rank: int, steps: range, ids: list[int]) -> RankReport:
    return RankReport(rank=rank, step=steps[-1], trained=tuple(zip(steps, ids, strict=True)))


def expand(ranges: list[tuple[int, int]]) -> set[int]:
    return {i for a, b in ranges for i in range(a, b)}


def test_a_lost_gangs_uncommitted_batches_are_replayed_once() -> None:
    acc = BatchAccounting(GANGS, stream_id=stream_id)
    for r in range(4):
        acc.add_rank(r, shard=r, step=0)
    # Steps 1..3 everywhere; the job-wide sync at step 2 commits steps 1 and 2.
    own = {r: [stream_id(r, k) for k in range(3)] for r in range(4)}
    last = acc.record(
        [report(r, range(1, 4), own[r]) for r in range(4)],
        gang_of=gang_of,
        live_gangs=[0, 1],
        last_sync_step=0,
        is_job_wide_sync=every_second_step,
    )
    assert last == 2
    assert expand(acc.committed()) == {stream_id(r, k) for r in range(4) for k in (0, 1)}

    # Gang 1 dies in step 5. Survivors report steps 4 and 5; the lost ranks' batches of steps 4
    # and 5 are the next ones of their streams. The sync at step 4 completed, the one at 6 not.
    survivors = [report(r, range(4, 6), [stream_id(r, 3), stream_id(r, 4)]) for r in (0, 1)]
    lost = acc.lost_rank_reports([2, 3], fail_step=5)
    assert [x.trained for x in lost] == [
        ((4, stream_id(2, 3)), (5, stream_id(2, 4))),
        ((4, stream_id(3, 3)), (5, stream_id(3, 4))),
    ]
    assert (
        acc.record(
            survivors + lost,
            gang_of=gang_of,
            live_gangs=[0, 1],
            last_sync_step=2,
            is_job_wide_sync=every_second_step,
            completed_through=4,
        )
        == 4
    )
    replay = acc.apply_drop(acc.plan_drop([1], [0], ranks_of=lambda g: GANGS[g]))
    assert replay == {0: [stream_id(2, 4)], 1: [stream_id(3, 4)]}
    acc.commit([0])  # the re-formed job's first sync

    # Survivors train the replayed batches first, then their own streams.
    with pytest.raises(StreamError, match="stream order says 2004"):
        acc.record(
            [report(0, range(6, 7), [stream_id(0, 5)])],
            gang_of=gang_of,
            live_gangs=[0],
            last_sync_step=5,
            is_job_wide_sync=every_second_step,
        )


def test_replayed_batches_end_in_the_model_exactly_once() -> None:
    acc = BatchAccounting(GANGS, stream_id=stream_id)
    for r in range(4):
        acc.add_rank(r, shard=r, step=0)
    acc.record(
        [report(r, range(1, 4), [stream_id(r, k) for k in range(3)]) for r in range(4)],
        gang_of=gang_of,
        live_gangs=[0, 1],
        last_sync_step=0,
        is_job_wide_sync=every_second_step,
    )
    lost = acc.lost_rank_reports([2, 3], fail_step=3)
    acc.record(
        lost,
        gang_of=gang_of,
        live_gangs=[0, 1],
        last_sync_step=2,
        is_job_wide_sync=every_second_step,
        completed_through=2,
    )
    replay = acc.apply_drop(acc.plan_drop([1], [0], ranks_of=lambda g: GANGS[g]))
    acc.commit([0])
    assert acc.replay_pending() == 2
    # Step 4: the replays; step 5: own batches; sync at 4 commits the replays.
    reports = [report(r, range(4, 6), [replay[r][0], stream_id(r, 3)]) for r in (0, 1)]
    acc.record(
        reports,
        gang_of=gang_of,
        live_gangs=[0],
        last_sync_step=3,
        is_job_wide_sync=every_second_step,
    )
    acc.commit([0])
    committed = expand(acc.committed())
    assert acc.committed_count() == len(committed)  # nothing twice
    assert committed == {stream_id(r, k) for r in (0, 1) for k in range(4)} | {
        stream_id(r, k) for r in (2, 3) for k in range(3)
    }
    assert expand(acc.replayed()) == {stream_id(2, 2), stream_id(3, 2)}
    assert acc.replay_pending() == 0 and acc.lost_batches == 0


def test_a_source_without_batch_ids_counts_what_it_loses() -> None:
    acc = BatchAccounting(GANGS, stream_id=None)
    for r in range(4):
        acc.add_rank(r, shard=r, step=0)
    acc.lost_rank_reports([2, 3], fail_step=3)
    assert acc.lost_batches == 6
    assert acc.apply_drop(acc.plan_drop([1], [0], ranks_of=lambda g: GANGS[g])) == {}


# -- back to a checkpoint after a total loss ---------------------------------------------------


def train(
    acc: BatchAccounting,
    ranks: dict[int, int],
    ids: dict[int, list[int]],
    *,
    first: int,
    last_sync: int,
    gangs: dict[int, tuple[int, ...]],
) -> int | None:
    """Every rank in ``ranks`` (job rank -> gang) trains ``ids[rank]`` from step ``first`` on."""
    reports = [report(r, range(first, first + len(ids[r])), ids[r]) for r in ranks]
    return acc.record(
        reports,
        gang_of=ranks.__getitem__,
        live_gangs=sorted(gangs),
        last_sync_step=last_sync,
        is_job_wide_sync=every_second_step,
    )


def test_a_rewind_to_a_checkpoint_retrains_later_batches_once() -> None:
    acc = BatchAccounting(GANGS, stream_id=stream_id)
    for r in range(4):
        acc.add_rank(r, shard=r, step=0)
    ranks = {r: gang_of(r) for r in range(4)}
    own = {r: [stream_id(r, k) for k in range(4)] for r in range(4)}
    assert train(acc, ranks, own, first=1, last_sync=0, gangs=GANGS) == 4
    # The checkpoint of step 4, written to JSON as it is into the manifest.
    saved = json.loads(json.dumps(acc.snapshot([0, 1, 2, 3])))
    assert saved["streams"]["live"] == [[r, 4, []] for r in range(4)]
    # Steps 5 and 6 are trained and committed, then every gang is lost.
    later = {r: [stream_id(r, k) for k in (4, 5)] for r in range(4)}
    train(acc, ranks, later, first=5, last_sync=4, gangs=GANGS)
    assert expand(acc.committed()) >= {stream_id(0, 5)}

    # Rebuilt as gangs 2 and 3 (job ranks 4..7), each rank continuing a saved stream.
    new_gangs = {2: (4, 5), 3: (6, 7)}
    rebuilt = BatchAccounting.rewound(saved, gang_ids=new_gangs, stream_id=stream_id)
    assert expand(rebuilt.committed()) == {stream_id(r, k) for r in range(4) for k in range(4)}
    starts = plan_streams(saved["streams"], num_ranks=4, spare_shards=range(4), step=4)
    new_ranks = {4: 2, 5: 2, 6: 3, 7: 3}
    for rank, start in zip(new_ranks, starts, strict=True):
        rebuilt.add_rank(rank, shard=start.shard, step=4)
        rebuilt.resume_rank(rank, gang=new_ranks[rank], step=4, stream_at=start.at)
    # Steps 5..8 again: the stream order says the same batches as before the loss come next.
    again = {4 + r: [stream_id(r, k) for k in range(4, 8)] for r in range(4)}
    assert train(rebuilt, new_ranks, again, first=5, last_sync=4, gangs=new_gangs) == 8
    committed = expand(rebuilt.committed())
    assert rebuilt.committed_count() == len(committed)  # steps 5 and 6 are in once, not twice
    assert committed == {stream_id(r, k) for r in range(4) for k in range(8)}


def test_a_rewind_restores_unread_replays_and_continues_stopped_shards() -> None:
    acc = BatchAccounting(GANGS, stream_id=stream_id)
    for r in range(4):
        acc.add_rank(r, shard=r, step=0)
    ranks = {r: gang_of(r) for r in range(4)}
    first3 = {r: [stream_id(r, k) for k in range(3)] for r in range(4)}
    train(acc, ranks, first3, first=1, last_sync=0, gangs=GANGS)
    # Gang 1 dies in step 3: its step-3 batches go to gang 0 for replay; gang 0 syncs alone.
    lost = acc.lost_rank_reports([2, 3], fail_step=3)
    acc.record(
        lost,
        gang_of=gang_of,
        live_gangs=[0, 1],
        last_sync_step=2,
        is_job_wide_sync=every_second_step,
        completed_through=2,
    )
    replay = acc.apply_drop(acc.plan_drop([1], [0], ranks_of=lambda g: GANGS[g]))
    acc.commit([0])
    assert replay == {0: [stream_id(2, 2)], 1: [stream_id(3, 2)]}
    # The checkpoint is written before the survivors train their replays.
    saved = json.loads(json.dumps(acc.snapshot([0, 1])))
    assert saved["streams"] == {
        "live": [[0, 3, [stream_id(2, 2)]], [1, 3, [stream_id(3, 2)]]],
        "retired": [[2, 3], [3, 3]],
    }

    # Rebuilt at the initial shape (2 gangs): ranks 4, 5 continue the live streams with their
    # replays first; ranks 6, 7 take the stopped shards 2 and 3 where they stopped.
    starts = plan_streams(saved["streams"], num_ranks=4, spare_shards=range(4), step=3)
    assert [(s.shard, s.at, s.replay) for s in starts] == [
        (0, 3, (stream_id(2, 2),)),
        (1, 3, (stream_id(3, 2),)),
        (2, 3, ()),
        (3, 3, ()),
    ]
    new_gangs = {2: (4, 5), 3: (6, 7)}
    new_ranks = {4: 2, 5: 2, 6: 3, 7: 3}
    rebuilt = BatchAccounting.rewound(saved, gang_ids=new_gangs, stream_id=stream_id)
    for rank, start in zip(new_ranks, starts, strict=True):
        rebuilt.add_rank(rank, shard=start.shard, step=3)
        rebuilt.resume_rank(
            rank, gang=new_ranks[rank], step=3, stream_at=start.at, replay=start.replay
        )
    assert rebuilt.replay_pending() == 2
    # Steps 4..5: replays first where there are any, then own streams; a sync at 4.
    trained = {
        4: [stream_id(2, 2), stream_id(0, 3)],
        5: [stream_id(3, 2), stream_id(1, 3)],
        6: [stream_id(2, 3), stream_id(2, 4)],
        7: [stream_id(3, 3), stream_id(3, 4)],
    }
    train(rebuilt, new_ranks, trained, first=4, last_sync=3, gangs=new_gangs)
    rebuilt.commit(new_gangs)
    committed = expand(rebuilt.committed())
    assert rebuilt.committed_count() == len(committed)
    assert committed == {stream_id(r, k) for r in range(4) for k in range(5 if r > 1 else 4)}
    assert rebuilt.replay_pending() == 0
    assert expand(rebuilt.replayed()) == {stream_id(2, 2), stream_id(3, 2)}


def test_a_snapshot_keeps_a_batch_committed_twice() -> None:
    acc = BatchAccounting({0: (0,)}, stream_id=None)
    acc.add_rank(0, shard=0, step=0)
    twice = [report(0, range(1, 3), [7, 8]), report(0, range(3, 5), [8, 9])]
    for rep in twice:
        acc.record(
            [rep],
            gang_of=lambda r: 0,
            live_gangs=[0],
            last_sync_step=0,
            is_job_wide_sync=lambda s: True,
        )
    saved = json.loads(json.dumps(acc.snapshot([0])))
    back = BatchAccounting.rewound(saved, gang_ids=[1], stream_id=None)
    assert back.committed() == [(7, 10)] and back.committed_count() == 4  # 8 still twice
    assert saved["streams"] is None


def test_a_snapshot_is_refused_between_syncs() -> None:
    acc = BatchAccounting(GANGS, stream_id=stream_id)
    for r in range(4):
        acc.add_rank(r, shard=r, step=0)
    ranks = {r: gang_of(r) for r in range(4)}
    train(acc, ranks, {r: [stream_id(r, 0)] for r in range(4)}, first=1, last_sync=0, gangs=GANGS)
    with pytest.raises(LedgerError, match=r"sync boundary, but gangs \[0, 1\] have pending"):
        acc.snapshot([0, 1, 2, 3])


def test_committed_rows_count_short_batches_and_replays_once_each() -> None:
    """The ledger's rows: a batch's rows are counted when it commits, a short one's as the rank
    reported them; a lost gang's uncommitted batches count only when their replay commits."""
    acc = BatchAccounting(GANGS, stream_id=stream_id, batch_size=10)
    for r in range(4):
        acc.add_rank(r, shard=r, step=0)
    reports = [report(r, range(1, 4), [stream_id(r, k) for k in range(3)]) for r in range(4)]
    # Rank 0's second batch and rank 2's third hold 7 and 4 rows.
    reports[0] = dataclasses.replace(reports[0], short=((stream_id(0, 1), 7),))
    reports[2] = dataclasses.replace(reports[2], short=((stream_id(2, 2), 4),))
    acc.record(
        reports,
        gang_of=gang_of,
        live_gangs=[0, 1],
        last_sync_step=0,
        is_job_wide_sync=every_second_step,
    )
    assert acc.committed_rows == 8 * 10 - 3  # steps 1-2 of 4 ranks; rank 0's short batch
    lost = acc.lost_rank_reports([2, 3], fail_step=3)
    acc.record(
        lost,
        gang_of=gang_of,
        live_gangs=[0, 1],
        last_sync_step=2,
        is_job_wide_sync=every_second_step,
        completed_through=2,
    )
    replay = acc.apply_drop(acc.plan_drop([1], [0], ranks_of=lambda g: GANGS[g]))
    acc.commit([0])
    assert acc.committed_rows == 97  # gang 0's step 3 too; not gang 1's (replayed)
    replays = [
        dataclasses.replace(
            report(r, range(4, 6), [replay[r][0], stream_id(r, 3)]),
            short=((stream_id(2, 2), 4),) if replay[r][0] == stream_id(2, 2) else (),
        )
        for r in (0, 1)
    ]
    acc.record(
        replays,
        gang_of=gang_of,
        live_gangs=[0],
        last_sync_step=3,
        is_job_wide_sync=every_second_step,
    )
    acc.commit([0])
    # Every committed batch: 14 of them, one short by 3 rows and one by 6.
    assert acc.committed_count() == 14
    assert acc.committed_rows == 14 * 10 - 3 - 6
    # A checkpoint's snapshot keeps the figure.
    back = BatchAccounting.rewound(
        acc.snapshot([0, 1]), gang_ids=[0], stream_id=stream_id, batch_size=10
    )
    assert back.committed_rows == acc.committed_rows
