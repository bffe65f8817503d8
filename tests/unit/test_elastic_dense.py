"""Where a failure leaves the dense parameters, and which replays update embedding rows only
(pure): :func:`settle_failed_step` and the accounting's embedding-only replays, through a loss,
a second loss of a survivor that was replaying, and a rewind to a checkpoint."""

from __future__ import annotations

import json

import pytest

from raytrec.elastic.accounting import BatchAccounting
from raytrec.elastic.dense import FailedStepSettlement, settle_failed_step
from raytrec.elastic.report import RankReport

GANGS = {0: (0,), 1: (1,), 2: (2,)}  # three gangs of one rank


def stream_id(shard: int, k: int) -> int:
    return shard * 1000 + k


def gang_of(rank: int) -> int:
    return rank


def rec(rank: int, step: int, *, abandoned: bool = False) -> RankReport:
    return RankReport(rank=rank, step=step, abandoned_dense_update=abandoned)


def test_survivors_that_all_abandoned_the_failed_step_finish_it_from_the_first_ones_state() -> None:
    got = settle_failed_step(
        [rec(4, 7, abandoned=True), rec(5, 7, abandoned=True)], every_step=True, committed_through=4
    )
    assert got == FailedStepSettlement(step=7, dense_through=6, source=4, finish=True)


def test_a_survivor_that_finished_the_failed_steps_all_reduce_is_the_source() -> None:
    # Rank 5's replica group completed step 7 with the lost gang's gradient: its state has it.
    got = settle_failed_step(
        [rec(4, 7, abandoned=True), rec(5, 7), rec(6, 7, abandoned=True)],
        every_step=True,
        committed_through=4,
    )
    assert got == FailedStepSettlement(step=7, dense_through=7, source=5, finish=False)


def test_a_failure_in_a_sync_after_the_step_leaves_nothing_to_finish() -> None:
    got = settle_failed_step([rec(0, 8), rec(1, 8)], every_step=True, committed_through=4)
    assert got == FailedStepSettlement(step=8, dense_through=8, source=0, finish=False)


def test_a_survivor_behind_the_others_contributes_nothing_to_the_finish() -> None:
    got = settle_failed_step(
        [rec(0, 6), rec(1, 7, abandoned=True)], every_step=True, committed_through=4
    )
    assert got == FailedStepSettlement(step=7, dense_through=6, source=0, finish=True)


def test_dense_averaged_with_the_schedule_holds_only_the_last_job_wide_sync() -> None:
    got = settle_failed_step([rec(0, 7), rec(1, 6)], every_step=False, committed_through=4)
    assert got == FailedStepSettlement(step=7, dense_through=4, source=0, finish=False)
    with pytest.raises(ValueError, match="at least one survivor"):
        settle_failed_step([], every_step=True, committed_through=0)


def book(
    acc: BatchAccounting,
    reports: list[RankReport],
    *,
    live: list[int],
    last: int,
    through: int | None = None,
) -> int:
    got = acc.record(
        reports,
        gang_of=gang_of,
        live_gangs=live,
        last_sync_step=last,
        is_job_wide_sync=lambda s: s % 4 == 0,
        completed_through=through,
    )
    return last if got is None else got


def trained(rank: int, first_step: int, ids: list[int]) -> RankReport:
    steps = range(first_step, first_step + len(ids))
    return RankReport(rank=rank, step=steps[-1], trained=tuple(zip(steps, ids, strict=True)))


def test_replays_whose_dense_gradient_is_in_the_model_update_embeddings_only() -> None:
    acc = BatchAccounting(GANGS, stream_id=stream_id)
    for r in GANGS:
        acc.add_rank(r, shard=r, step=0)
    last = book(
        acc,
        [trained(r, 1, [stream_id(r, k) for k in range(6)]) for r in (0, 1, 2)],
        live=[0, 1, 2],
        last=0,
    )
    assert last == 4
    # Gang 2 dies as step 7 starts; the survivors' all-reduce of step 7 failed.
    lost = acc.lost_rank_reports([2], fail_step=7)
    survivors = [trained(r, 7, [stream_id(r, 6)]) for r in (0, 1)]
    last = book(acc, survivors + lost, live=[0, 1, 2], last=last, through=6)
    settled = settle_failed_step(
        [rec(0, 7, abandoned=True), rec(1, 7, abandoned=True)],
        every_step=True,
        committed_through=last,
    )
    replay = acc.apply_drop(
        acc.plan_drop([2], [0, 1], ranks_of=lambda g: GANGS[g], dense_through=settled.dense_through)
    )
    queued = sorted(i for ids in replay.values() for i in ids)
    assert queued == [stream_id(2, 4), stream_id(2, 5), stream_id(2, 6)]
    # Steps 5 and 6 went through the all-reduce; step 7's batch never reached anyone.
    assert acc.embedding_only(queued) == [stream_id(2, 4), stream_id(2, 5)]
    acc.commit([0, 1])  # the re-formed job's first sync

    assert replay == {0: [stream_id(2, 4), stream_id(2, 5)], 1: [stream_id(2, 6)]}

    # Both survivors replay at step 8 (rank 1 the batch that needs its dense gradient); rank 1
    # dies in the job-wide sync at step 8, after that step's all-reduce. Its replay went
    # through the all-reduce: it is now embedding-only too.
    reports = [trained(0, 8, [stream_id(2, 4)]), trained(1, 8, [stream_id(2, 6)])]
    book(acc, reports, live=[0, 1], last=7, through=7)
    assert acc.lost_rank_reports([1], fail_step=8)[0].trained == ()  # it reported step 8
    settled = settle_failed_step([rec(0, 8)], every_step=True, committed_through=7)
    assert (settled.dense_through, settled.finish) == (8, False)
    again = acc.apply_drop(
        acc.plan_drop([1], [0], ranks_of=lambda g: GANGS[g], dense_through=settled.dense_through)
    )
    assert again == {0: [stream_id(2, 6)]}
    assert acc.embedding_only(again[0]) == [stream_id(2, 6)]
    # The embedding-only replay rank 0 trained at step 8 is its own pending batch, and the one
    # it has not read yet is queued: both stay marked until a sync commits them.
    assert acc.embedding_only([stream_id(2, 4), stream_id(2, 5)]) == [
        stream_id(2, 4),
        stream_id(2, 5),
    ]
    acc.commit([0])
    assert acc.embedding_only([stream_id(2, 4), stream_id(2, 5)]) == [stream_id(2, 5)]

    # A checkpoint at a sync boundary keeps which queued replays are embedding-only.
    snapshot = json.loads(json.dumps(acc.snapshot([0])))
    assert snapshot["dense_applied"] == [stream_id(2, 5), stream_id(2, 6)]
    rewound = BatchAccounting.rewound(snapshot, gang_ids=[0], stream_id=stream_id)
    assert rewound.embedding_only([stream_id(2, 5), stream_id(2, 6), stream_id(0, 9)]) == [
        stream_id(2, 5),
        stream_id(2, 6),
    ]


def test_a_commit_forgets_the_embedding_only_marks_of_what_it_commits() -> None:
    acc = BatchAccounting(GANGS, stream_id=stream_id)
    for r in GANGS:
        acc.add_rank(r, shard=r, step=0)
    book(
        acc,
        [trained(r, 1, [stream_id(r, 0), stream_id(r, 1)]) for r in (0, 1, 2)],
        live=[0, 1, 2],
        last=0,
    )
    acc.lost_rank_reports([2], fail_step=2)
    replay = acc.apply_drop(
        acc.plan_drop([2], [0, 1], ranks_of=lambda g: GANGS[g], dense_through=2)
    )
    ids = [i for v in replay.values() for i in v]
    assert sorted(acc.embedding_only(ids)) == sorted(ids)
    book(
        acc,
        [trained(r, 3, replay.get(r, [])) for r in (0, 1) if replay.get(r)],
        live=[0, 1],
        last=0,
    )
    acc.commit([0, 1])
    assert acc.embedding_only(ids) == []
    assert acc.snapshot([0, 1])["dense_applied"] == []


def test_at_4096_ranks_the_one_survivor_that_finished_the_step_is_the_source() -> None:
    reports = [rec(r, 100, abandoned=True) for r in range(4096)]
    reports[2501] = rec(2501, 100)  # its replica group's all-reduce completed
    got = settle_failed_step(reports, every_step=True, committed_through=96)
    assert got == FailedStepSettlement(step=100, dense_through=100, source=2501, finish=False)
