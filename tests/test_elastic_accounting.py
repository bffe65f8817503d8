"""Exactly-once batch accounting through a failure, a replay and the final commit (pure)."""

from __future__ import annotations

import pytest

from raytrec.elastic.accounting import BatchAccounting
from raytrec.elastic.streams import StreamError

GANGS = {0: (0, 1), 1: (2, 3)}  # gang id -> job ranks


def stream_id(shard: int, k: int) -> int:
    return shard * 1000 + k


def gang_of(rank: int) -> int:
    return next(g for g, ranks in GANGS.items() if rank in ranks)


def every_second_step(step: int) -> bool:
    return step % 2 == 0


def report(rank: int, steps: range, ids: list[int]) -> dict[str, object]:
    return {"rank": rank, "step": steps[-1], "trained": list(zip(steps, ids, strict=True))}


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
    assert [x["trained"] for x in lost] == [
        [(4, stream_id(2, 3)), (5, stream_id(2, 4))],
        [(4, stream_id(3, 3)), (5, stream_id(3, 4))],
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
    replay = acc.drop([1], [0], ranks_of=lambda g: GANGS[g])
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
    replay = acc.drop([1], [0], ranks_of=lambda g: GANGS[g])
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
    assert acc.drop([1], [0], ranks_of=lambda g: GANGS[g]) == {}
