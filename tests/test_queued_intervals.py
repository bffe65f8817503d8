"""Intervals queued on the ranks while the one before them runs.

The coordinator sends interval k+1 while k is still running, so the ranks go from one interval
to the next without waiting for it (``Coordinator._top_up``). Three things make that safe:

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
from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from actors.coordinator import Coordinator
from actors.rank import IntervalOrder
from raytrec.api import fit
from raytrec.checkpoint.config import CheckpointConfig
from raytrec.cluster import connect
from raytrec.config import (
    DataConfig,
    ModelConfig,
    ScalingConfig,
    SyncConfig,
    TrainConfig,
    criteo_tables,
)
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.faults import FaultConfig, FaultKind, FaultSpec

# -- when the coordinator may queue an interval ---------------------------------------------


def coordinator(
    *,
    end_step: int = 100,
    every_n_steps: int | None = None,
    live: int = 2,
    min_gangs: int = 1,
    depth: int = 2,
) -> tuple[Coordinator, list[tuple[int, int, int | None]]]:
    c = Coordinator.__new__(Coordinator)  # no __init__: no Ray, no store
    sent: list[tuple[int, int, int | None]] = []  # (start, steps, after)
    c.end_step = end_step
    c.cfg = SimpleNamespace(log_every=25, checkpoint=CheckpointConfig(every_n_steps=every_n_steps))
    c.elastic = SimpleNamespace(min_gangs=min_gangs)
    c.membership = SimpleNamespace(num_gangs=live)
    c._last_save = (0, time.monotonic())
    c._pending = []
    c._building = {}
    c._depth = depth
    c._ready = 0

    def dispatch(start: int, n: int, *, after: int | None = None, **_: Any) -> Any:
        sent.append((start, n, after))
        return SimpleNamespace(n=n, end=start + n, seq=len(sent))

    c._dispatch = dispatch
    return c, sent


def collected(c: Coordinator, step: int, ready: int, inflight: deque[Any]) -> None:
    """The coordinator collected the interval ending at ``step``; every rank holds ``ready``
    batches beyond it."""
    c._ready = ready
    c._top_up(inflight, step)


def test_the_next_interval_is_queued_behind_the_running_one() -> None:
    c, sent = coordinator(end_step=100)
    inflight: deque[Any] = deque()
    # Interval 25..50 collected, the ranks hold the next two intervals: both are sent, the
    # second queued behind the first.
    collected(c, 25, 50, inflight)
    assert sent == [(25, 25, None), (50, 25, 1)]
    # 50 collected: 50..75 runs, so 75..100 is queued behind it; nothing beyond the end.
    inflight.popleft()
    collected(c, 50, 50, inflight)
    assert sent[2:] == [(75, 25, 2)]
    inflight.popleft()
    collected(c, 75, 25, inflight)
    assert sent[3:] == []


def test_a_short_last_interval() -> None:
    c, sent = coordinator(end_step=60)
    collected(c, 25, 35, deque())
    assert sent == [(25, 25, None), (50, 10, 1)]


def test_depth_one_sends_the_next_interval_only_after_the_last() -> None:
    c, sent = coordinator(depth=1)
    inflight: deque[Any] = deque()
    collected(c, 25, 50, inflight)
    assert sent == [(25, 25, None)]


def test_only_what_every_rank_holds_is_sent() -> None:
    # A rank could prepare only 30 batches beyond step 25 (bad input, or its data ended):
    # 25..50 goes, 50..75 does not; the job stops at 50, where that rank's data gives out.
    c, sent = coordinator()
    collected(c, 25, 30, deque())
    assert sent == [(25, 25, None)]
    c, sent = coordinator()
    collected(c, 25, 10, deque())
    assert sent == []


@pytest.mark.parametrize(
    ("why", "kwargs", "step"),
    [
        ("the job is at its end", {"end_step": 50}, 50),
        ("a checkpoint is due", {"every_n_steps": 50}, 50),
        ("the job is below its minimum gangs", {"live": 1, "min_gangs": 2}, 25),
    ],
)
def test_nothing_is_sent_early_when_the_boundary_has_work(
    why: str, kwargs: dict[str, Any], step: int
) -> None:
    c, sent = coordinator(**kwargs)
    collected(c, step, 50, deque())
    assert sent == [], why


def test_nothing_is_queued_past_a_checkpoint() -> None:
    # 50..75 may run, but the interval after it starts where a save is due: it waits.
    c, sent = coordinator(every_n_steps=75)
    collected(c, 50, 50, deque())
    assert sent == [(50, 25, None)]


def test_nothing_is_sent_early_while_a_gang_is_being_added() -> None:
    c, sent = coordinator()
    c._pending = [object()]  # a placement group not ready yet
    collected(c, 25, 50, deque())
    c._pending, c._building = [], {3: object()}
    collected(c, 25, 50, deque())
    assert sent == []


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


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    connect(num_cpus=4)
    yield
    ray.shutdown()


@pytest.mark.cluster
def test_a_survivor_trains_the_queued_interval_and_every_batch_counts_once(
    cluster: None, tmp_path: str
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
        faults=FaultConfig(faults=(FaultSpec(kind=FaultKind.KILL_RANK, step=4, rank=2),)),
        num_steps=16,
        log_every=2,
        storage_path=str(tmp_path),
    )
    result = fit(config, shutdown_ray=False)

    assert result.steps == 16, result.events
    died = [e for e in result.events if e["kind"] == "rank_died"]
    assert [e["job_rank"] for e in died] == [2, 3], result.events  # 3: killed with its gang
    # The job re-formed at step 6: the survivor had trained the queued interval.
    generations = [e for e in result.events if e["kind"] == "generation_started"]
    assert [e["step"] for e in generations][-1] == 6, generations
    assert result.history[-1].gangs == 1
    assert_replicas_agree(result)
    assert_every_batch_once(result)
    assert result.replayed_batches  # gang 1's batches since step 0 were trained again
