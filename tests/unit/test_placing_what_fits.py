"""A job placed again from a checkpoint (a new coordinator's resume, a rebuild after a total
loss) places what the cluster holds now, down to ``elastic.min_gangs``, and grows back later;
and the driver books a coordinator's loss on the clock of the coordinators' own events."""

from __future__ import annotations

import tempfile
from typing import Any

from raytrec.cluster.capacity import gangs_that_fit
from raytrec.elastic.boundary import gangs_to_place
from raytrec.elastic.events import (
    CheckpointRestored,
    CoordinatorLost,
    CoordinatorRestarted,
    GangJoined,
    GenerationStarted,
    TotalLoss,
)
from simulation.fault_schedule import Schedule, Settings
from simulation.fault_space import _Budget, _build, _follow, run_schedule

#: 3 gangs of one rank, one node each, a checkpoint every 2 steps; node 1 dies at step 3.
SETTINGS = Settings(gangs=3, gang_size=1, checkpoint_every=2, num_steps=12, sync_every=2)
NODE_LOST = {"kind": "node_dies", "node": 1, "step": 3}


def test_the_gangs_placed_again_are_what_fits_between_min_gangs_and_the_initial_number() -> None:
    assert gangs_to_place(initial=4, fitting=9, min_gangs=1) == 4
    assert gangs_to_place(initial=4, fitting=2, min_gangs=1) == 2
    assert gangs_to_place(initial=4, fitting=2, min_gangs=3) == 3  # then it waits, and fails
    assert gangs_to_place(initial=4, fitting=0, min_gangs=1) == 1


def test_gangs_that_fit_count_whole_gangs_first_fit() -> None:
    gang = [{"CPU": 2.0}]  # one bundle per gang
    assert gangs_that_fit([gang] * 3, [{"CPU": 4.0}, {"CPU": 2.0}]) == 3
    assert gangs_that_fit([gang] * 3, [{"CPU": 3.0}, {"CPU": 3.0}]) == 2  # no half bundles
    # A gang over two hosts needs both of its bundles placed.
    two_hosts = [{"CPU": 2.0}, {"CPU": 2.0}]
    assert gangs_that_fit([two_hosts] * 2, [{"CPU": 2.0}] * 3) == 1
    assert gangs_that_fit([[{"CPU": 1.0, "GPU": 1.0}]] * 2, [{"CPU": 8.0}]) == 0


def _run(schedule: Schedule) -> tuple[Any, list[Any], Any]:
    """The schedule's run: the last coordinator, its events, the seat's events."""
    seat_events: list[Any] = []
    with tempfile.TemporaryDirectory() as run_dir:
        seat, group = _build(schedule, run_dir, [])
        group.budget = _Budget(200_000.0, 20_000, 20.0)
        keep = seat._on_event
        seat._on_event = lambda e: (seat_events.append(e), keep(e))
        _follow(seat)
        return seat, list(seat.current.events), seat_events


def test_a_coordinator_restarted_after_a_node_loss_goes_on_with_the_gangs_that_fit() -> None:
    """Before: the new coordinator asked for the 3 gangs again and failed with ConfigError
    after resource_wait_s (only 2 nodes live). Now it resumes on 2 gangs, every batch once."""
    schedule = Schedule(SETTINGS, (NODE_LOST, {"kind": "coordinator_dies", "step": 8}))
    outcome = run_schedule(schedule)
    # The invariants (every batch committed once, rows trained, replicas equal) were checked.
    assert (outcome.verdict, outcome.name, outcome.steps) == ("pass", "", 12), outcome
    seat, events, seat_events = _run(schedule)
    assert seat.restarts == 1
    first = next(e for e in events if isinstance(e, GenerationStarted))
    assert len(first.gang_ids) == 2, first
    assert [e.step for e in events if isinstance(e, CheckpointRestored)] == [7]
    # The seat books the loss on the coordinators' clock: between the lost one's last event and
    # the new one's first.
    lost = next(e for e in seat_events if isinstance(e, CoordinatorLost))
    restarted = next(e for e in seat_events if isinstance(e, CoordinatorRestarted))
    assert lost.at <= restarted.at <= first.at, (lost, restarted, first)


def test_the_restarted_job_grows_back_when_a_node_comes() -> None:
    settings = Settings(
        gangs=3, gang_size=1, checkpoint_every=2, num_steps=40, sync_every=2, grow=True
    )
    joins = {"kind": "nodes_join", "at": 3.8, "count": 1}
    schedule = Schedule(settings, (NODE_LOST, {"kind": "coordinator_dies", "step": 8}, joins))
    outcome = run_schedule(schedule)
    assert (outcome.verdict, outcome.name, outcome.steps) == ("pass", "", 40), outcome
    _, events, _ = _run(schedule)
    generations = [len(e.gang_ids) for e in events if isinstance(e, GenerationStarted)]
    assert generations[0] == 2 and generations[-1] == 3, generations
    assert len([e for e in events if isinstance(e, GangJoined)]) == 1


def test_a_total_loss_after_a_node_loss_is_rebuilt_on_the_gangs_that_fit() -> None:
    """Before: the rebuild asked for 3 gangs and failed (JobFailedError) after
    resource_wait_s."""
    schedule = Schedule(SETTINGS, (NODE_LOST, {"kind": "rank_hangs", "step": 6}))
    outcome = run_schedule(schedule)
    assert (outcome.verdict, outcome.name, outcome.steps) == ("pass", "", 12), outcome
    _, events, _ = _run(schedule)
    assert len([e for e in events if isinstance(e, TotalLoss)]) == 1
    rebuilt = [e for e in events if isinstance(e, GenerationStarted) and "rebuilt" in e.reason]
    assert [len(e.gang_ids) for e in rebuilt] == [2], rebuilt
