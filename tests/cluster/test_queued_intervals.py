"""Intervals queued on the ranks while the one before them runs.

The coordinator sends interval k+1 while k is still running, so the ranks go from one interval
to the next without waiting for it (``TrainingSteps._top_up``, which asks
:func:`raytrec.elastic.control.intervals_to_queue`). Three things make that safe:

- *When* it may (pure, ms): only when nothing has to run on the ranks at the boundary (a
  checkpoint, a gang joining, the end of the job), and only intervals every rank said it holds
  the batches of, so bad input or the end of the data stops every rank at the same boundary.
- *Order* on the rank (pure, ms): a queued call runs after the call it follows, and only if
  that one succeeded (``actors.rank.IntervalOrder``); after a failure it changes nothing.
- *A failure with an interval queued* (a Ray cluster, tens of seconds): the surviving gang
  goes on into the queued interval; what it trained there is booked like the rest, every batch
  exactly once.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from actors.rank import IntervalOrder
from raytrec.api import fit
from raytrec.checkpoint.config import CheckpointConfig, save_decision
from raytrec.config import (
    DataConfig,
    ModelConfig,
    ScalingConfig,
    SyncConfig,
    TestingConfig,
    TrainConfig,
    criteo_tables,
)
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.control import Boundary, intervals_to_queue
from raytrec.elastic.events import GangDropped, GenerationStarted, RankDied
from raytrec.elastic.faults import FaultKind, FaultSpec

# -- when the coordinator may queue an interval ---------------------------------------------


def queue(
    step: int,
    ready: int,
    *,
    in_flight: list[tuple[int, int]] = (),  # type: ignore[assignment]
    end_step: int = 100,
    every_n_steps: int | None = None,
    live: int = 2,
    min_gangs: int = 1,
    depth: int = 2,
    changing: bool = False,
) -> list[tuple[int, int]]:
    """What the coordinator sends after collecting the interval that ended at ``step``, with
    every rank holding ``ready`` batches beyond it and ``in_flight`` intervals (start, steps)
    already sent."""
    boundary = Boundary(
        step=step,
        end_step=end_step,
        every=25,
        depth=depth,
        ready=ready,
        work_at_boundary=changing,
        live_gangs=live,
        min_gangs=min_gangs,
    )
    policy = CheckpointConfig(every_n_steps=every_n_steps)

    def save_due(at: int) -> bool:
        d = save_decision(
            policy, step=at, now_s=0.0, last_save_step=0, last_save_s=0.0, sync_every=1
        )
        return d.save and at != 0

    end = in_flight[-1][0] + in_flight[-1][1] if in_flight else None
    return intervals_to_queue(boundary, end, len(in_flight), save_due)


def test_the_next_interval_is_queued_behind_the_running_one() -> None:
    # Interval 25..50 collected, the ranks hold the next two intervals: both are sent, the
    # second queued behind the first.
    assert queue(25, 50) == [(25, 25), (50, 25)]
    # 50 collected: 50..75 runs, so 75..100 is queued behind it; nothing beyond the end.
    assert queue(50, 50, in_flight=[(50, 25)]) == [(75, 25)]
    assert queue(75, 25, in_flight=[(75, 25)]) == []


def test_a_short_last_interval() -> None:
    assert queue(25, 35, end_step=60) == [(25, 25), (50, 10)]


def test_depth_one_sends_the_next_interval_only_after_the_last() -> None:
    assert queue(25, 50, depth=1) == [(25, 25)]


def test_only_what_every_rank_holds_is_sent() -> None:
    # A rank could prepare only 30 batches beyond step 25 (bad input, or its data ended):
    # 25..50 goes, 50..75 does not; the job stops at 50, where that rank's data gives out.
    assert queue(25, 30) == [(25, 25)]
    assert queue(25, 10) == []


@pytest.mark.parametrize(
    ("why", "kwargs", "step"),
    [
        ("the job is at its end", {"end_step": 50}, 50),
        ("a checkpoint is due", {"every_n_steps": 50}, 50),
        ("the job is below its minimum gangs", {"live": 1, "min_gangs": 2}, 25),
        ("a gang is being added, a drain or a stop is due", {"changing": True}, 25),
    ],
)
def test_nothing_is_sent_early_when_the_boundary_has_work(
    why: str, kwargs: dict[str, Any], step: int
) -> None:
    assert queue(step, 50, **kwargs) == [], why


def test_nothing_is_queued_past_a_checkpoint() -> None:
    # 50..75 may run, but the interval after it starts where a save is due: it waits.
    assert queue(50, 50, every_n_steps=75) == [(50, 25)]


# -- the order of train calls on a rank -----------------------------------------------------


def run_queued(order: IntervalOrder, after: int | None, out: list[Any]) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(order.wait_turn(after)), daemon=True)
    t.start()
    return t


def test_a_queued_call_waits_for_the_one_it_follows_and_runs_when_it_succeeded() -> None:
    order, out = IntervalOrder(), []
    assert order.wait_turn(None)  # nothing before it: runs at once
    t = run_queued(order, 1, out)
    time.sleep(0.1)
    assert out == []  # call 1 is still running
    order.ended(1, succeeded=True)
    t.join(timeout=5)
    assert out == [True]


def test_a_call_queued_behind_a_failed_one_is_skipped() -> None:
    order, out = IntervalOrder(), []
    t = run_queued(order, 1, out)
    order.ended(1, succeeded=False)
    t.join(timeout=5)
    assert out == [False]
    # Calls sent after the recovery follow nothing (or a call that succeeded) and run.
    assert order.wait_turn(None)
    order.ended(2, succeeded=True)
    assert order.wait_turn(2)


def test_a_queued_call_that_arrives_after_its_predecessor_ended_does_not_wait() -> None:
    order = IntervalOrder()
    order.ended(4, succeeded=True)
    assert order.wait_turn(4)
    order.ended(5, succeeded=False)
    assert not order.wait_turn(5)


# -- a failure while an interval is queued --------------------------------------------------


@pytest.mark.cluster
def test_a_survivor_trains_the_queued_interval_and_every_batch_counts_once(
    local_ray: None, tmp_path: str
) -> None:
    from test_elastic_cluster import assert_every_batch_once, assert_replicas_agree

    # Two gangs that share nothing between syncs (dense state too synced every 8 steps only).
    # Rank 2 dies before step 4, inside interval 3..4; gang 0 finishes that interval, goes on
    # into 5..6, queued behind it, and trains it: no collective there waits for gang 1.
    config = TrainConfig(
        model=ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=200)),
        scaling=ScalingConfig(num_workers=4, gang_size=2, ranks_per_host=2),
        sync=SyncConfig(sync_every=8, dense="with_schedule"),
        data=DataConfig(batch_size=32),
        elastic=ElasticConfig(collective_timeout_s=10, step_timeout_s=60, poll_s=0.2),
        testing=TestingConfig(faults=(FaultSpec(kind=FaultKind.KILL_RANK, step=4, rank=2),)),
        num_steps=16,
        log_every=2,
        storage_path=str(tmp_path),
    )
    result = fit(config, shutdown_ray=False)

    assert result.steps == 16, result.events
    died = result.events.of(RankDied)
    # Rank 3 goes with its gang: booked as killed with it when its call was still running as
    # Ray's notice of rank 2's death came, or not booked when its own call failed first (their
    # collective broke); which comes first is a race.
    assert [e.job_rank for e in died] in ([2, 3], [2]), result.events
    (dropped,) = result.events.of(GangDropped)
    assert dropped.gang_id == 1, result.events
    # The job re-formed at step 6: the survivor had trained the queued interval.
    generations = result.events.of(GenerationStarted)
    assert [e.step for e in generations][-1] == 6, generations
    assert result.history[-1].gangs == 1
    assert_replicas_agree(result)
    assert_every_batch_once(result)
    assert result.replayed_batches  # gang 1's batches since step 0 were trained again
