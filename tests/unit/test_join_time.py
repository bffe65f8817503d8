"""The join-time benchmark's reading of Ray's records (pure, milliseconds): each milestone is the
last rank's, the coordinator's clock is put on the wall clock, and the table runs in time order."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.join_time import breakdown, table

T0 = 1_000.0  # the new node's `ray start`, wall clock (s)


def build_task(node: str, worker: str, *, created: float, handed: float, ran: float, done: float):
    events = [("PENDING_NODE_ASSIGNMENT", created), ("SUBMITTED_TO_WORKER", handed)]
    events += [("RUNNING", ran), ("FINISHED", done)]
    return {
        "name": "RankWorker.build",
        "node_id": node,
        "worker_id": worker,
        "creation_time_ms": created * 1000,
        "events": [{"state": s, "created_ms": t * 1000} for s, t in events],
    }


def worker(worker_id: str, *, launch: float, launched: float, ready: float) -> dict[str, Any]:
    return {
        "worker_id": worker_id,
        "worker_launch_time_ms": launch * 1000,
        "worker_launched_time_ms": launched * 1000,
        "start_time_ms": ready * 1000,
    }


def test_the_last_rank_of_the_gang_sets_each_milestone() -> None:
    seen = {
        "node_start": T0, "raylet_start": T0 + 8, "registered": T0 + 8.5, "placed": T0 + 9,
        "ray_start_done": T0 + 10, "node_id": "new",
        "gang_placed": 40.0, "gang_joined": 40.5,  # the coordinator's clock
    }  # fmt: skip
    tasks = [
        build_task("new", "w1", created=T0 + 9.5, handed=T0 + 25, ran=T0 + 25, done=T0 + 26),
        build_task("new", "w2", created=T0 + 9.6, handed=T0 + 27, ran=T0 + 27, done=T0 + 27.5),
        build_task("old", "w0", created=T0 - 100, handed=T0 - 90, ran=T0 - 90, done=T0 - 80),
    ]
    workers = [
        worker("w1", launch=T0 + 10, launched=T0 + 13, ready=T0 + 14),
        worker("w2", launch=T0 + 10.5, launched=T0 + 12, ready=T0 + 12.5),
    ]
    times = breakdown(seen, tasks, workers, offset=T0 - 12)  # coordinator's 0 is T0 - 12
    assert times["requested"] == pytest.approx(T0 + 9.6)
    assert times["launch"] == pytest.approx(T0 + 10.5)
    assert times["launched"] == pytest.approx(T0 + 13)
    assert times["worker_ready"] == pytest.approx(T0 + 14)
    assert times["constructed"] == pytest.approx(T0 + 27)
    assert times["built"] == pytest.approx(T0 + 27.5)
    assert times["join_started"] == pytest.approx(T0 + 28)
    assert times["joined"] == pytest.approx(T0 + 28.5)
    lines = table(times).splitlines()[2:]
    # In time order: `ray start` returned (10 s) comes after the placement (9 s).
    assert [x.split(" | ")[0] for x in lines][3:5] == [
        "| the replacement gang's placement group is ready",
        "| the coordinator created the gang's rank actors",
    ]
    assert lines[5].startswith("| `ray start` returned | 10.00 | +0.40 |")
    assert lines[-1] == "| `gang_joined`: sync, generation, heal broadcast done | 28.50 | +0.50 |"


def test_a_rank_without_a_record_leaves_its_milestones_unknown() -> None:
    seen = {"node_start": T0, "node_id": "new", "gang_joined": 1.0}
    tasks = [build_task("new", "w1", created=T0 + 1, handed=T0 + 2, ran=T0 + 2, done=T0 + 3)]
    times = breakdown(seen, tasks, [], offset=T0)
    assert times["launched"] is None and times["constructed"] == pytest.approx(T0 + 2)
    assert table(times).splitlines()[-1].endswith("| - | - |")  # unknown ones come last
