"""The real coordinator's control loop over the in-process fake worker group (milliseconds each).

Each scenario runs :class:`actors.coordinator.Coordinator` end to end over
:class:`simulation.doubles.fake_group.FakeWorkerGroup` with a manual clock, and checks what it
decided: the gangs it ended with, the generation, the events with their measured fields, and the
batch accounting. Every run ends by checking that each batch is in the final model exactly once (the
fake's own record of the saved model's batches against the coordinator's committed ones) and that
the replicas agree (the coordinator's final check, which raises otherwise).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

import pytest

import actors.job_training
from actors.coordinator import Coordinator
from raytrec.checkpoint.config import CheckpointConfig
from raytrec.config import DataConfig, ScalingConfig, SyncConfig, TrainConfig
from raytrec.data.synthetic import batch_id, split_batch_id
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.control import group_broke
from raytrec.elastic.decisions import Continue, Decision, Fail, Grow, Reform, Wait
from raytrec.elastic.drain_policy import request_drain, request_stop
from raytrec.elastic.events import (
    CheckpointRestored,
    CheckpointSaved,
    DataReshared,
    DomainShared,
    GangDrained,
    GangDropped,
    GangHealed,
    GangJoined,
    GangPlaced,
    GangRequested,
    GenerationStarted,
    HangDetected,
    HealFailed,
    JobFailed,
    NodeDied,
    RankDied,
    StragglerEvicted,
    TotalLoss,
)
from raytrec.elastic.run_record import RunSummary
from raytrec.elastic.workers import NODE_DIED, RankLost
from raytrec.errors import JobFailedError, StopRequested
from simulation.doubles.fake_faults import (
    AtStep,
    FakeShard,
    Fault,
    GroupBreaks,
    HealCorrupted,
    NodeDies,
    NodeDrains,
    NodesJoin,
    RankDies,
    RankFails,
    RankHangs,
    SlowRank,
)
from simulation.doubles.fake_group import FakeWorkerGroup
from simulation.fault_invariants import check_invariants
from simulation.fault_schedule import Settings
from simulation.fault_space import parquet_shards

BUILD_S = 1.0  # the fake's build time: training starts then
STEP_S = 0.1
ELASTIC = {"collective_timeout_s": 10.0, "step_timeout_s": 30.0, "poll_s": 1.0}


@dataclasses.dataclass
class Job:
    coordinator: Coordinator
    group: FakeWorkerGroup
    run_dir: str

    def run(self) -> RunSummary:
        summary = self.coordinator.run()
        assert_exactly_once(summary, self.group)
        return summary


def job(
    tmp_path: Any,
    *faults: Fault | NodesJoin,
    gangs: int = 3,
    gang_size: int = 2,
    nodes: int | None = None,
    cpus_per_node: int | None = None,
    num_steps: int = 16,
    log_every: int = 2,
    layout: str = "replicas_across_hosts",
    checkpoint: CheckpointConfig | None = None,
    sync_every: int = 4,
    reshared: bool = False,
    **elastic: Any,
) -> Job:
    """A job over the fake; ``reshared``: it reads a tiny Parquet file by index (its rows shared
    again among the live ranks at every membership change), else the synthetic ids."""
    world = gangs * gang_size
    ranks_per_host = cpus_per_node or gang_size
    cfg = TrainConfig(
        scaling=ScalingConfig(
            num_workers=world, gang_size=gang_size, ranks_per_host=ranks_per_host, layout=layout
        ),
        data=DataConfig(batch_size=8),
        sync=SyncConfig(sync_every=sync_every),
        elastic=ElasticConfig(**{"grow": False, **ELASTIC, **elastic}),
        checkpoint=checkpoint or CheckpointConfig(),
        num_steps=num_steps,
        log_every=log_every,
        storage_path=str(tmp_path),
    )
    group = FakeWorkerGroup(
        nodes=world // ranks_per_host if nodes is None else nodes,
        cpus_per_node=ranks_per_host,
        faults=faults,
        step_s=STEP_S,
        build_s=BUILD_S,
    )
    shards: list[Any] = [FakeShard(i) for i in range(world)]
    if reshared:
        shards = parquet_shards(world, num_steps)
    coordinator = Coordinator(
        cfg,
        plan=None,  # type: ignore[arg-type]  # only the ranks read it
        shards=shards,
        num_dense=13,
        run_dir=str(tmp_path),
        new_shard=None if reshared else FakeShard,
        group=group,
        clock=group.clock,
    )
    return Job(coordinator, group, str(tmp_path))


def assert_exactly_once(summary: RunSummary, group: FakeWorkerGroup) -> None:
    """Every batch trained went into the final model once: the coordinator's committed batches
    are the fake model's, none twice, none lost, and each shard's are a gap-free prefix."""
    committed = [i for a, b in summary.committed_batches for i in range(a, b)]
    assert summary.lost_batches == 0
    assert summary.committed_count == len(committed) == len(set(committed))
    assert group.model_batches(summary.final_state_path or "") == collections.Counter(committed)
    steps: dict[int, list[int]] = {}
    for i in committed:
        shard, step = split_batch_id(i)
        steps.setdefault(shard, []).append(step)
    for shard, taken in steps.items():
        assert sorted(taken) == list(range(len(taken))), f"shard {shard} has gaps"
    replayed = {i for a, b in summary.replayed_batches for i in range(a, b)}
    assert replayed <= set(committed)
    dense = {d["dense"] for d in summary.state_digests.values()}
    assert len(dense) == 1


def kinds(summary: RunSummary) -> list[str]:
    return summary.events.kinds()


def gangs_of(summary: RunSummary) -> list[int]:
    return list(summary.events.of(GenerationStarted)[-1].gang_ids)


def ids(*pairs: tuple[int, int]) -> set[int]:
    return {batch_id(shard, k) for shard, k in pairs}


def replayed(summary: RunSummary) -> set[int]:
    return {i for a, b in summary.replayed_batches for i in range(a, b)}


# -- losses ---------------------------------------------------------------------------------


def test_a_rank_dies_its_gang_is_dropped_and_its_batches_replayed(tmp_path: Any) -> None:
    summary = job(tmp_path, RankDies(rank=3, step=5)).run()
    assert summary.steps == 16 and summary.generation == 1
    assert gangs_of(summary) == [0, 2]
    died = {e.job_rank: e.cause for e in summary.events.of(RankDied)}
    assert died == {3: "ActorDiedError: the rank's process exited", 2: "its gang lost a rank"}
    # Learned as rank 3's call failed (step 5 began at 1 s + 4 steps of 0.1 s); booked once
    # the interval's other calls had answered.
    for e in summary.events.of(RankDied):
        assert e.noticed_at is not None and 1.4 <= e.noticed_at <= e.at
    [dropped] = summary.events.of(GangDropped)
    assert dropped.gang_id == 1 and dropped.reason == "rank(s) [2, 3] died"
    # Synced at step 4: gang 1's batches of step 5 (the 5th of ranks 2 and 3) go to the others.
    assert replayed(summary) == ids((2, 4), (3, 4))


def test_a_node_dies_every_gang_on_it_is_dropped(tmp_path: Any) -> None:
    j = job(tmp_path, NodeDies(node=1, step=7), nodes=4)
    summary = j.run()
    assert gangs_of(summary) == [0, 2] and summary.generation == 1
    [node] = summary.events.of(NodeDied)
    assert node.node == 1 and node.gang_ids == (1,) and node.step == 6
    assert {e.job_rank: e.cause for e in summary.events.of(RankDied)} == {
        2: NODE_DIED,
        3: NODE_DIED,
    }
    assert [n.alive for n in j.group.nodes()] == [True, False, True, True]
    assert replayed(summary) == ids((2, 4), (2, 5), (2, 6), (3, 4), (3, 5), (3, 6))


def test_one_rank_hangs_its_gang_is_dropped_after_the_collective_timeouts(tmp_path: Any) -> None:
    summary = job(tmp_path, RankHangs(rank=2, step=6)).run()
    assert gangs_of(summary) == [0, 2]
    [hang] = summary.events.of(HangDetected)
    assert hang.job_ranks == (2,) and hang.gang_ids == (1,) and hang.last_step == 5
    # Its peers' collectives time out 10 s after it stopped (at the end of step 5); the rank
    # still running 2 x 10 s + one poll after that is the hung one.
    stopped = BUILD_S + 5 * STEP_S
    timeout, poll = ELASTIC["collective_timeout_s"], ELASTIC["poll_s"]
    assert stopped + 3 * timeout + poll < hang.at <= stopped + 3 * timeout + 2 * poll
    assert 3 * timeout < hang.silent_s <= 3 * timeout + 2 * poll
    [dropped] = summary.events.of(GangDropped)
    assert dropped.reason == "rank(s) [2] hung"


def test_every_rank_hangs_found_within_step_timeout_plus_poll(tmp_path: Any) -> None:
    # Intervals of 25 steps (2.5 s): the heartbeat finds the hang, not the interval's end.
    j = job(
        tmp_path,
        RankHangs(step=40),
        num_steps=100,
        log_every=25,
        checkpoint=CheckpointConfig(every_n_steps=10),
    )
    summary = j.run()
    [hang] = summary.events.of(HangDetected)
    assert hang.job_ranks == (0, 1, 2, 3, 4, 5) and hang.last_step == 39
    step_timeout, poll = ELASTIC["step_timeout_s"], ELASTIC["poll_s"]
    stopped = BUILD_S + 39 * STEP_S
    assert stopped + step_timeout < hang.at <= stopped + step_timeout + poll
    assert step_timeout < hang.silent_s <= step_timeout + poll
    # No gang is intact: the job is rebuilt from the checkpoint of step 25 and trains on.
    [loss] = summary.events.of(TotalLoss)
    assert loss.checkpoint_step == 25 and loss.lost_gangs == (0, 1, 2)
    assert gangs_of(summary) == [3, 4, 5] and summary.steps == 100


def test_a_slow_rank_is_not_hung(tmp_path: Any) -> None:
    # 5 s a step, 40 s an interval: longer than step_timeout_s, yet every step is in time.
    summary = job(tmp_path, SlowRank(rank=4, step_s=5.0), log_every=8).run()
    assert "hang_detected" not in kinds(summary) and "gang_dropped" not in kinds(summary)
    assert summary.generation == 0 and summary.steps == 16
    assert [round(row.seconds, 3) for row in summary.history] == [40.0, 40.0]


def test_a_transient_error_is_retried_with_every_gang(tmp_path: Any) -> None:
    summary = job(tmp_path, RankFails(rank=1, step=6, after_s=10.0)).run()
    assert gangs_of(summary) == [0, 1, 2] and summary.generation == 1
    [generation] = summary.events.of(GenerationStarted)[1:]
    assert generation.reason == "collectives timed out with every rank alive"
    assert generation.step == 6  # the survivors' failed step kept its embedding update
    assert "gang_dropped" not in kinds(summary) and not replayed(summary)


def test_transient_errors_in_a_row_fail_the_job(tmp_path: Any) -> None:
    faults = [RankFails(rank=1, step=s) for s in (6, 7, 8, 9)]
    with pytest.raises(JobFailedError, match="collectives failed 4 times in a row"):
        job(tmp_path, *faults).coordinator.run()


# -- total loss -----------------------------------------------------------------------------

EVERY_GANG = (RankDies(rank=0, step=10), RankDies(rank=2, step=10), RankDies(rank=4, step=10))


def test_a_total_loss_is_rebuilt_from_the_last_checkpoint(tmp_path: Any) -> None:
    j = job(tmp_path, *EVERY_GANG, checkpoint=CheckpointConfig(every_n_steps=4))
    summary = j.run()
    [loss] = summary.events.of(TotalLoss)
    assert loss.checkpoint_step == 8 and loss.lost_gangs == (0, 1, 2)
    assert loss.dead_shards == (0,)
    [restored] = summary.events.of(CheckpointRestored)
    assert restored.saved_step == 8 and restored.uri == loss.uri
    # A new job of the initial shape under new gang ids and job ranks, trained to the end.
    assert gangs_of(summary) == [3, 4, 5] and summary.steps == 16
    assert sorted(summary.state_digests) == list(range(6, 12))


@pytest.mark.parametrize(("call", "every"), [("sync", 6), ("save_checkpoint", 4)])
def test_a_rank_lost_while_a_checkpoint_is_saved_is_recovered_from(
    tmp_path: Any, call: str, every: int
) -> None:
    # Rank 1 (of gang 0, the writer) dies in the job-wide sync before the save (due at step 6,
    # between two syncs of the schedule), or in the save itself (at step 4).
    ckpt = CheckpointConfig(every_n_steps=every)
    j = job(tmp_path, RankDies(rank=1, on=call), checkpoint=ckpt)
    summary = j.run()
    assert summary.steps == 16 and gangs_of(summary) == [1, 2]
    [died] = summary.events.of(RankDied)
    assert died.job_rank == 1 and died.step == every
    # That save was lost with the rank; the next ones come from gang 1, the new writer.
    saved = [e.step for e in summary.events.of(CheckpointSaved)]
    assert saved and saved[0] > every
    assert_exactly_once(summary, j.group)


def test_a_total_loss_without_a_checkpoint_fails_clearly(tmp_path: Any) -> None:
    j = job(tmp_path, *EVERY_GANG)
    with pytest.raises(JobFailedError, match="cannot go on without a checkpoint, and none is"):
        j.coordinator.run()
    [failed] = j.coordinator.events.of(JobFailed)
    assert failed.needs_checkpoint


def test_a_stop_asked_while_a_rebuild_waits_for_nodes_ends_the_job_at_once(
    tmp_path: Any,
) -> None:
    """Every node is lost at step 10 and none comes back: the rebuild from the checkpoint waits
    for resources. A stop asked meanwhile (``ray job stop``) ends the job then, naming the
    checkpoint to resume from, rather than after the whole resource wait."""
    run_dir = str(tmp_path)
    lost = [NodeDies(node=n, step=10) for n in range(3)]
    stop = AtStep(step=9, action=lambda: request_stop(run_dir))
    ckpt = CheckpointConfig(every_n_steps=4)
    j = job(tmp_path, *lost, stop, checkpoint=ckpt, resource_wait_s=3600.0)
    with pytest.raises(JobFailedError, match="stopped on request while it waited") as e:
        j.coordinator.run()
    assert "resume_from_checkpoint=" in str(e.value) and "checkpoint_0000000008" in str(e.value)
    assert j.group.clock.now < 600.0  # not the hour of the resource wait


WITHIN = {"gangs": 2, "cpus_per_node": 2, "layout": "replicas_within_host"}


def test_within_host_one_rank_lost_drops_its_gang_without_a_rebuild(tmp_path: Any) -> None:
    # Gang 0 is ranks 0 and 2; host 0 holds ranks 0 and 1 (shard 0 of both gangs).
    summary = job(tmp_path, RankDies(rank=0, step=5), **WITHIN).run()
    assert gangs_of(summary) == [1] and summary.generation == 1
    assert "total_loss" not in kinds(summary) and "gang_requested" not in kinds(summary)
    [dropped] = summary.events.of(GangDropped)
    assert dropped.gang_id == 0


def test_within_host_a_host_lost_is_a_total_loss(tmp_path: Any) -> None:
    j = job(tmp_path, NodeDies(node=0, step=5), **WITHIN)
    with pytest.raises(
        JobFailedError, match=r"replicas_within_host.*cannot go on without a checkpoint"
    ):
        j.coordinator.run()


def test_within_host_a_host_lost_is_rebuilt_on_a_spare_host(tmp_path: Any) -> None:
    checkpoint = CheckpointConfig(every_n_steps=4)
    j = job(tmp_path, NodeDies(node=0, step=7), nodes=3, checkpoint=checkpoint, **WITHIN)
    summary = j.run()
    [loss] = summary.events.of(TotalLoss)
    assert loss.checkpoint_step == 4 and loss.dead_shards == (0,)
    assert gangs_of(summary) == [2, 3] and summary.steps == 16
    assert {j.group.node_of(r) for r in summary.state_digests} == {1, 2}


# -- growth ---------------------------------------------------------------------------------


def test_a_gang_placed_later_joins_and_heals_from_a_peer(tmp_path: Any) -> None:
    j = job(tmp_path, NodesJoin(at=1.5), gangs=2, max_gangs=3, grow=True, num_steps=40)
    summary = j.run()
    [placed] = summary.events.of(GangPlaced)
    [healed] = summary.events.of(GangHealed)
    [joined] = summary.events.of(GangJoined)
    assert healed.gang_id == 2 and healed.peer_gang_id == 0
    # Requested at the start; the node comes at 1.5 s; the gang is started at the next boundary
    # (intervals of 0.2 s from 1.0 s: 1.6 s), builds for 1 s and joins at the boundary of 2.6 s.
    assert placed.at == joined.at == pytest.approx(2.6)
    assert joined.generation == 1 and joined.step == 16
    assert gangs_of(summary) == [0, 1, 2] and sorted(summary.state_digests) == list(range(6))


def test_a_gang_that_does_not_heal_is_dropped_and_placed_again(tmp_path: Any) -> None:
    faults = (NodesJoin(at=1.0), HealCorrupted(rank=4))
    j = job(tmp_path, *faults, gangs=2, max_gangs=3, grow=True, num_steps=40)
    summary = j.run()
    [failed] = summary.events.of(HealFailed)
    assert failed.gang_id == 2 and failed.job_ranks == (4,)
    assert [e.gang_id for e in summary.events.of(GangJoined)] == [3]
    assert gangs_of(summary) == [0, 1, 3]


# -- shrinking ------------------------------------------------------------------------------


def test_a_user_drain_gives_back_the_newest_gang(tmp_path: Any) -> None:
    run_dir = str(tmp_path)
    drain = AtStep(step=5, action=lambda: request_drain(run_dir, gangs=1))
    summary = job(tmp_path, drain, grow=True).run()
    [drained] = summary.events.of(GangDrained)
    assert drained.gang_id == 2 and drained.step == 8
    assert "giving back gangs [2], 2 left (at most 2 from now on)" in drained.reason
    assert gangs_of(summary) == [0, 1] and summary.generation == 1
    assert not replayed(summary) and "gang_requested" not in kinds(summary)


def test_a_stop_request_from_another_process_stops_at_the_next_boundary(tmp_path: Any) -> None:
    """``raytrec.stop(run_dir)`` (a file in the run directory) stops the job as a first
    SIGTERM does: at the next interval boundary, synced and saved, every batch once."""
    run_dir = str(tmp_path)
    stop = AtStep(step=5, action=lambda: request_stop(run_dir))
    summary = job(tmp_path, stop).run()
    assert isinstance(summary.stopped_by, StopRequested)
    # Asked as step 5 ends, the interval of steps 5-6 running and 7-8 queued behind it: the
    # first boundary with nothing in flight is step 8.
    assert summary.steps == 8 and str(summary.stopped_by) == "stopped on request at step 8"
    assert summary.final_state_path is not None


def test_a_lower_max_gangs_gives_back_the_gangs_above_it_for_good(tmp_path: Any) -> None:
    run_dir = str(tmp_path)
    drain = AtStep(step=9, action=lambda: request_drain(run_dir, max_gangs=1))  # as 9 ends
    summary = job(tmp_path, drain, NodesJoin(at=2.0, count=2), grow=True, num_steps=40).run()
    # Asked during step 10, with the interval to step 12 already queued: given back at 12.
    assert [(e.gang_id, e.step) for e in summary.events.of(GangDrained)] == [
        (1, 12),
        (2, 12),
    ]
    # Nodes come later, but the job, capped at one gang, asks for none.
    assert "gang_requested" not in kinds(summary) and gangs_of(summary) == [0]
    assert summary.steps == 40 and not replayed(summary)


def test_a_draining_node_gives_its_gang_back_and_a_new_one_replaces_it(tmp_path: Any) -> None:
    j = job(tmp_path, NodeDrains(node=1, step=3), nodes=4, grow=True, num_steps=40)
    summary = j.run()
    [drained] = summary.events.of(GangDrained)
    assert drained.gang_id == 1 and drained.step == 6
    assert "run on nodes marked for removal" in drained.reason
    assert [e.gang_id for e in summary.events.of(GangJoined)] == [3]
    assert gangs_of(summary) == [0, 2, 3] and not replayed(summary)
    assert {j.group.node_of(r) for r in range(6, 8)} == {3}  # not on the draining node


EVICTION = {"straggler_eviction": {"factor": 1.5, "intervals": 3}}


def test_a_persistent_straggler_is_evicted_and_replaced(tmp_path: Any) -> None:
    """Rank 2 takes 3x the others' step time for good: its gang (1) is slow in every interval,
    and after 3 in a row it is drained at a boundary and a new gang replaces it."""
    j = job(tmp_path, SlowRank(rank=2, step_s=0.3), nodes=4, grow=True, num_steps=40, **EVICTION)
    summary = j.run()
    [evicted] = summary.events.of(StragglerEvicted)
    assert evicted.gang_id == 1
    assert evicted.step_s == pytest.approx(0.3) and evicted.others_s == pytest.approx(STEP_S)
    # Its third slow interval ends at step 6 with steps 7-8 already queued (nothing has to
    # happen at 6 when that one is sent): it goes at the next boundary, slow 4 times by then.
    assert (evicted.step, evicted.intervals) == (8, 4)
    [drained] = summary.events.of(GangDrained)
    assert drained.gang_id == 1 and drained.step == 8 and "persistent straggler" in drained.reason
    assert [e.gang_id for e in summary.events.of(GangJoined)] == [3]
    assert gangs_of(summary) == [0, 2, 3] and summary.steps == 40 and not replayed(summary)
    # Back at the others' pace: 8 steps at 0.3 s, the join, then 0.1 s a step.
    assert summary.wall_s < 8 * 0.3 + BUILD_S + 2 + 32 * STEP_S
    # The replacement avoids the evicted gang's node (1) for the free one (3): first fit would
    # have put it back on node 1.
    assert [e.nodes for e in summary.events.of(GangPlaced)] == [("fake-node-3 at 127.0.0.1",) * 2]


def test_a_straggler_replacement_goes_back_to_its_node_when_no_other_has_room(
    tmp_path: Any,
) -> None:
    j = job(tmp_path, SlowRank(rank=2, step_s=0.3), nodes=3, grow=True, num_steps=40, **EVICTION)
    summary = j.run()
    assert [e.gang_id for e in summary.events.of(StragglerEvicted)] == [1]
    assert [e.nodes for e in summary.events.of(GangPlaced)] == [("fake-node-1 at 127.0.0.1",) * 2]
    assert not summary.events.of(DomainShared) and gangs_of(summary) == [0, 2, 3]


def test_gangs_that_must_share_a_node_start_and_say_which(tmp_path: Any) -> None:
    """3 gangs on 2 nodes with room for 2 each: one per node, the third beside gang 0."""
    summary = job(tmp_path, nodes=2, cpus_per_node=4).run()
    [shared] = summary.events.of(DomainShared)
    assert (shared.gang_id, shared.domain, shared.with_gangs) == (
        2,
        "node fake-node-0 at 127.0.0.1",
        (0,),
    )
    assert shared.step == 0 and summary.steps == 16


def test_a_gang_slow_for_fewer_intervals_than_configured_is_left_alone(tmp_path: Any) -> None:
    """Slow for one interval (steps 1-2), then again as fast as the others: never evicted."""
    once = SlowRank(rank=2, step_s=0.3, until_step=2)
    (tmp_path / "3").mkdir(), (tmp_path / "1").mkdir()
    summary = job(tmp_path / "3", once, nodes=4, grow=True, num_steps=40, **EVICTION).run()
    assert not summary.events.of(StragglerEvicted) and not summary.events.of(GangDrained)
    assert gangs_of(summary) == [0, 1, 2] and summary.steps == 40
    # The one slow interval was seen: asked for one interval, the same run evicts gang 1.
    eager = {"straggler_eviction": {"factor": 1.5, "intervals": 1}}
    summary = job(tmp_path / "1", once, nodes=4, grow=True, num_steps=40, **eager).run()
    assert [(e.gang_id, e.intervals) for e in summary.events.of(StragglerEvicted)] == [(1, 1)]


def test_straggler_eviction_never_goes_below_min_gangs(tmp_path: Any) -> None:
    slow = SlowRank(rank=2, step_s=0.3)
    summary = job(tmp_path, slow, num_steps=16, min_gangs=3, **EVICTION).run()
    assert not summary.events.of(StragglerEvicted) and gangs_of(summary) == [0, 1, 2]


# -- failures while the job changes ---------------------------------------------------------


def test_a_rank_that_dies_while_its_gang_builds_is_placed_again(tmp_path: Any) -> None:
    faults: Sequence[Fault | NodesJoin] = (NodesJoin(at=1.0), RankDies(rank=4, on="build"))
    summary = job(tmp_path, *faults, gangs=2, max_gangs=3, grow=True, num_steps=40).run()
    assert [e.gang_id for e in summary.events.of(GangJoined)] == [3]
    assert gangs_of(summary) == [0, 1, 3]
    assert len(summary.events.of(GangRequested)) == 2


def test_a_live_gang_lost_while_another_builds(tmp_path: Any) -> None:
    faults = (NodesJoin(at=1.0), RankDies(rank=1, step=8))
    summary = job(tmp_path, *faults, gangs=2, max_gangs=3, grow=True, num_steps=24).run()
    # Gang 2 goes on building through the recovery and joins the survivor; gang 3 replaces
    # gang 0 on the node it freed.
    assert [e.gang_id for e in summary.events.of(GangDropped)] == [0]
    joined = [(e.gang_id, e.generation) for e in summary.events.of(GangJoined)]
    assert joined == [(2, 2), (3, 3)]
    assert gangs_of(summary) == [1, 2, 3]


def test_a_rank_lost_during_recovery_starts_it_over(tmp_path: Any) -> None:
    faults = (RankDies(rank=3, step=5), RankDies(rank=4, on="recover"))
    j = job(tmp_path, *faults)
    summary = j.run()
    assert sorted(e.gang_id for e in summary.events.of(GangDropped)) == [1, 2]
    assert gangs_of(summary) == [0] and summary.steps == 16
    died = {e.job_rank: e.cause for e in summary.events.of(RankDied)}
    # Rank 4's gang peer is killed as soon as rank 4's death is known, in the recovery's
    # call, as rank 3's is in the interval's.
    assert died == {
        2: "its gang lost a rank",
        3: "ActorDiedError: the rank's process exited",
        4: "ActorDiedError: the rank's process exited",
        5: "its gang lost a rank",
    }
    assert sorted(j.group.killed) == [2, 5]  # the lost gangs' other ranks are ended too


def test_a_group_that_breaks_while_the_job_re_forms_is_a_total_loss(tmp_path: Any) -> None:
    """Every rank lives, but the re-forming's dense broadcast fails as a gloo pair closed after
    a timeout does: no gang's groups can be trusted, so the job is rebuilt from its checkpoint
    (and without one it fails saying why), never left with an unusable group."""
    faults = (RankDies(rank=3, step=5), GroupBreaks(rank=4, on="broadcast_dense"))
    j = job(tmp_path, *faults, checkpoint=CheckpointConfig(every_n_steps=4))
    summary = j.run()
    [loss] = summary.events.of(TotalLoss)
    assert loss.checkpoint_step == 4 and loss.lost_gangs == (0, 2)
    died = {e.job_rank: e.cause for e in summary.events.of(RankDied)}
    assert "pair closure" in died[4] and "every rank alive" in died[0]
    assert summary.steps == 16 and len(gangs_of(summary)) == 3
    assert_exactly_once(summary, j.group)

    j = job(tmp_path / "no-checkpoint", *faults)
    with pytest.raises(JobFailedError, match="cannot go on without a checkpoint"):
        j.coordinator.run()


def test_which_errors_say_a_process_group_broke() -> None:
    gloo = "[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"
    assert group_broke(RuntimeError(gloo))
    assert group_broke(RuntimeError("Application timeout caused pair closure"))
    assert group_broke(TimeoutError("a collective timed out"))
    assert not group_broke(ValueError("bad row 12 in part-0.parquet"))
    assert not group_broke(RuntimeError("shape mismatch in the dense arch"))
    assert not group_broke(RuntimeError("the runtime output of table t_cat_0 is empty"))


def test_a_hung_rank_stays_lost_when_its_recovery_starts_over(tmp_path: Any) -> None:
    # The hung rank still answers the probe that follows the second loss: it stays hung.
    faults = (RankHangs(rank=2, step=6), RankDies(rank=4, on="recover"))
    summary = job(tmp_path, *faults).run()
    assert sorted(e.gang_id for e in summary.events.of(GangDropped)) == [1, 2]
    [hang] = summary.events.of(HangDetected)
    assert hang.job_ranks == (2,)
    died = {e.job_rank: e.cause for e in summary.events.of(RankDied)}
    assert died == {
        4: "ActorDiedError: the rank's process exited",
        5: "its gang lost a rank",  # released at once, in the recovery's call
    }
    assert gangs_of(summary) == [0]


def test_control_plane_scenarios_take_no_real_time(tmp_path: Any) -> None:
    # An hour of job time with a hang in it: the manual clock jumps over the waits.
    j = job(tmp_path, RankHangs(rank=2, step=6), num_steps=4000, log_every=100)
    summary = j.run()
    assert summary.steps == 4000 and j.group.clock.now > 400
    assert re.match(r"rank\(s\) \[2\] hung", summary.events.of(GangDropped)[0].reason)


def test_a_call_on_a_killed_rank_fails_with_rank_lost_in_the_ray_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The protocol the fake follows: a recovery that starts over probes every member, the
    # peers it killed included. No Ray cluster is needed: the killed rank is never called.
    from actors import worker_group

    killed: list[object] = []
    monkeypatch.setattr(worker_group.ray, "kill", killed.append)
    group = worker_group.RayWorkerGroup()
    actor = object()  # stands for the rank's actor handle
    group._actors[3] = actor
    group.kill(3)
    assert killed == [actor]
    calls = group.call([3], lambda w, _r: w.step())
    assert group.wait(list(calls.values()), num_returns=1, timeout=0) == [calls[3]]
    with pytest.raises(RankLost, match="killed"):
        group.result(calls[3])


def test_the_scale_benchmark_measures_every_kind_of_decision() -> None:
    # The control-plane scale benchmark's storm at 64 ranks: each decision it reports was taken.
    from benchmarks.control_plane_scale import run_one

    run = run_one(64, 4)
    assert set(run.decisions) == {"loss", "heartbeat check", "heal", "drain"}
    # A rank, a node, a hang, a transient failure, a rank, and one lost during that recovery.
    assert len(run.decisions["loss"]) == 6
    assert run.events["gang_joined"] == 5 and run.events["gang_drained"] == 2
    assert len(run.interval_cpu_ms) == len(run.rows) - 1 > 10


# -- found by the fault-space simulation (simulation.fault_space) ------------------------


def test_a_joining_gang_lost_while_it_heals_on_re_shared_rows_is_placed_again(
    tmp_path: Any,
) -> None:
    """The replacement gang's rank dies in the heal's broadcast: the gang, not booked yet (its
    rows come once it has joined), is dropped and placed again; the coordinator used to fail
    with KeyError in RankStreams.peek."""
    faults = (NodesJoin(at=1.0), RankDies(rank=4, on="broadcast_state"))
    j = job(tmp_path, *faults, gangs=2, max_gangs=3, grow=True, num_steps=16, reshared=True)
    summary = j.run()
    died = {e.job_rank: e.cause for e in summary.events.of(RankDied)}
    # Its gang peer, released at once (ended) since the gang is dropped.
    assert sorted(died) == [4, 5] and died[5] == "its gang lost a rank"
    assert [e.gang_id for e in summary.events.of(GangDropped)] == [2]
    assert 2 not in gangs_of(summary) and summary.steps >= 16
    settings = Settings(gangs=2, gang_size=2, num_steps=16, data="reshared")
    assert check_invariants(summary, j.group, j.coordinator, settings) == []  # every row once


def test_gangs_found_hung_mid_step_keep_no_step_they_never_finished(tmp_path: Any) -> None:
    """Gang 0 dies at step 2; of the two replacement gangs one has a rank slower per step (40 s)
    than ``step_timeout_s`` (30 s) and than the others wait for it (10 s), so no rank finishes
    step 3: the others' collectives time out and the silent rank 3 is found hung. Step 3
    happened nowhere: the survivors abort it, book its batches for replay, and every row is
    trained once. (The fake used to carry out an interval's steps when the call was made, so
    step 3's batches stayed in the model.)"""
    faults = (RankDies(rank=0, step=2), SlowRank(rank=3, step_s=40.0))
    j = job(
        tmp_path,
        *faults,
        gangs=2,
        gang_size=1,
        nodes=3,
        num_steps=8,
        reshared=True,
        grow=True,
        max_gangs=3,
        min_gangs=2,
    )
    summary = j.run()
    [hang] = summary.events.of(HangDetected)
    assert hang.job_ranks == (3,) and hang.last_step == 2
    dropped = [(e.gang_id, e.reason) for e in summary.events.of(GangDropped)]
    assert dropped == [(0, "rank(s) [0] died"), (3, "rank(s) [3] hung")]
    assert summary.steps >= 8  # and on, while replays are left (rows read by index)
    settings = Settings(gangs=2, gang_size=1, num_steps=8, data="reshared")
    assert check_invariants(summary, j.group, j.coordinator, settings) == []  # every row once


def test_a_rank_slower_than_the_collective_timeout_is_found_and_its_gang_dropped(
    tmp_path: Any,
) -> None:
    """Rank 4 takes 40 s a step, longer than the others wait for it in a collective (10 s), and
    node 0 dies as step 1 starts. The others' collectives time out, so the silent rank 4 is the
    hung one: its gang is dropped with the dead node's, and two new gangs join. The coordinator
    used to blame the joining gangs (their heartbeats were the oldest by milliseconds) and looped
    dropping and replacing them, one step each time, until the fault-space budget ran out."""
    faults = (NodeDies(node=0, step=1), SlowRank(rank=4, step_s=40.0))
    summary = job(tmp_path, *faults, nodes=4, num_steps=8, min_gangs=3).run()
    [hang] = summary.events.of(HangDetected)
    assert hang.job_ranks == (4,)
    dropped = [(e.gang_id, e.reason) for e in summary.events.of(GangDropped)]
    assert dropped == [(0, "rank(s) [0, 1] died"), (2, "rank(s) [4] hung")]
    assert gangs_of(summary) == [1, 3, 4] and summary.steps == 8


def test_a_rank_stuck_in_a_control_call_is_hung_and_its_gang_dropped(tmp_path: Any) -> None:
    """Rank 0 never returns from the checkpoint save (its peer times out in the collective):
    it is hung, its gang dropped; the coordinator used to fail with TimeoutError."""
    ckpt = CheckpointConfig(every_n_steps=4)
    summary = job(tmp_path, RankHangs(rank=0, on="save_checkpoint"), checkpoint=ckpt).run()
    [hang] = summary.events.of(HangDetected)
    assert hang.job_ranks == (0,) and hang.step == 4
    assert [e.gang_id for e in summary.events.of(GangDropped)] == [0]
    assert gangs_of(summary) == [1, 2] and summary.steps == 16


@pytest.mark.parametrize("call", ["build", "join_replica_plane", "broadcast_state", "prepare"])
def test_a_rank_lost_while_the_job_starts_drops_its_gang(tmp_path: Any, call: str) -> None:
    """A rank dies in the start's build, replica plane, first broadcast or first prepare: its
    gang is dropped and the others train; the coordinator used to fail with RankLost."""
    summary = job(tmp_path, RankDies(rank=3, on=call)).run()
    died = {e.job_rank: e.cause for e in summary.events.of(RankDied)}
    assert 3 in died and died[3] != "its gang lost a rank" and set(died) <= {2, 3}
    assert [e.gang_id for e in summary.events.of(GangDropped)] == [1]
    assert gangs_of(summary) == [0, 2] and summary.steps == 16


def test_a_rank_stuck_in_its_build_at_the_start_is_hung(tmp_path: Any) -> None:
    summary = job(tmp_path, RankHangs(rank=5, on="build")).run()
    [hang] = summary.events.of(HangDetected)
    assert hang.job_ranks == (5,) and gangs_of(summary) == [0, 1]
    assert summary.events.kinds()[:3] == [
        "hang_detected",
        "gang_dropped",
        "generation_started",
    ]


def test_a_start_broadcast_that_leaves_a_copy_different_drops_that_gang(tmp_path: Any) -> None:
    """Gang 1's copy of gang 0's state at the start differs: it is dropped, not averaged in;
        the final replica check used to fail when the job stopped before its first sync (a sync
    averages the difference away, so the fake clears it there too)."""
    summary = job(tmp_path, HealCorrupted(rank=3)).run()
    [died] = summary.events.of(RankDied)
    assert died.job_rank == 3 and "differed from gang 0's" in died.cause
    assert gangs_of(summary) == [0, 2] and summary.steps == 16


def test_replays_handed_out_twice_are_trained_in_the_order_the_ranks_take_them(
    tmp_path: Any,
) -> None:
    """Gang 0 is lost, its batches go to gangs 1 and 2 for replay; at the same boundary gang 2
    is drained, its replays going to gang 1 too. A rank's feed puts the replays it is handed
    last first; the coordinator's record of its order used to put them last (StreamError),
    and a drain did not hand the drained gang's replays to the others at all."""
    faults = (RankDies(rank=0, step=6), NodeDrains(node=2, step=5))
    summary = job(tmp_path, *faults, gangs=3, gang_size=1, log_every=4, grow=True).run()
    assert [e.gang_id for e in summary.events.of(GangDropped)] == [0]
    [drained] = summary.events.of(GangDrained)
    assert drained.gang_id == 2 and drained.step == 6
    assert replayed(summary) == ids((0, 4), (0, 5))
    assert summary.steps == 16


def test_a_loss_in_the_last_step_runs_the_job_on_until_its_replays_are_trained(
    tmp_path: Any,
) -> None:
    """Rank 2 dies as the last step starts: its 4 batches since the sync at step 12 go to the
    3 others, 2 at most each, so the job ends at step 18; they used to stay untrained."""
    summary = job(tmp_path, RankDies(rank=2, step=16), gangs=4, gang_size=1).run()
    assert replayed(summary) == ids((2, 12), (2, 13), (2, 14), (2, 15))
    assert summary.steps == 18 and summary.lost_batches == 0


def test_a_loss_after_a_re_forming_synced_does_not_hand_its_batches_out_again(
    tmp_path: Any,
) -> None:
    """Rank 0 dies in the re-forming after its job-wide sync: what that sync put in every
    replica stays committed; the recovery that starts over used to replay it again."""
    faults = (RankDies(rank=3, step=5), RankDies(rank=0, on="settle_failed_step"))
    summary = job(tmp_path, *faults).run()
    assert sorted(e.gang_id for e in summary.events.of(GangDropped)) == [0, 1]
    assert gangs_of(summary) == [2] and summary.steps == 16


def test_a_gang_lost_right_after_a_sync_has_its_rows_shared_out(tmp_path: Any) -> None:
    """Rank 0 hangs in the checkpoint save, right after a sync: its gang has nothing to replay,
    and the rows it had not read yet are shared out all the same; they used to be skipped."""
    ckpt = CheckpointConfig(every_n_steps=4)
    j = job(tmp_path, RankHangs(rank=0, on="save_checkpoint"), checkpoint=ckpt, reshared=True)
    summary = j.run()
    assert [e.gang_id for e in summary.events.of(GangDropped)] == [0]
    [shared] = summary.events.of(DataReshared)
    assert shared.step == 4 and shared.ranks == 4
    settings = Settings(gangs=3, gang_size=2, num_steps=16, data="reshared")
    assert check_invariants(summary, j.group, j.coordinator, settings) == []


def test_a_rank_stuck_in_recover_leaves_the_others_reports_booked(tmp_path: Any) -> None:
    """Rank 1 never returns from ``recover`` after rank 2 died: rank 0's report of what it
    trained is kept for the recovery that starts over (a second ``recover`` returns nothing);
    its batches used to be missing from the books though they were in the model."""
    faults = (RankDies(rank=2, step=6), RankHangs(rank=1, on="recover"))
    summary = job(tmp_path, *faults, gangs=3, gang_size=1).run()
    assert gangs_of(summary) == [0] and summary.steps == 16
    [hang] = summary.events.of(HangDetected)
    assert hang.job_ranks == (1,)


def test_a_rank_lost_while_replays_are_handed_over_starts_the_recovery_over(
    tmp_path: Any,
) -> None:
    """Rank 0 dies as gang 2's replays are handed to it: the recovery starts over with the
    books and the membership in step (the replays used to be sent before the lost gang left
    the membership, and the second pass failed with KeyError in RankStreams.peek)."""
    faults = (RankDies(rank=0, on="replay"), NodeDies(node=2, step=21))
    summary = job(tmp_path, *faults, gangs=4, gang_size=1, num_steps=24).run()
    assert sorted(e.gang_id for e in summary.events.of(GangDropped)) == [0, 2]
    assert gangs_of(summary) == [1, 3] and summary.steps >= 24


def test_a_joining_gang_is_still_dropped_when_the_recovery_that_drops_it_starts_over(
    tmp_path: Any,
) -> None:
    """Rank 0 dies at step 2, below ``min_gangs``: gangs 3 and 4 join, and rank 3 dies in the
    heal's broadcast. The recovery drops both joiners (neither has healed), but rank 2 dies in
    its ``recover`` call and the recovery starts over. The joiners used to be forgotten as
    joining when the first pass began, so the second kept gang 4, never healed, and averaged
    its copy into the model (the fault-space campaign from seed 7,772,847)."""
    faults = (
        RankDies(rank=0, step=2),
        RankDies(rank=3, on="broadcast_state"),
        RankDies(rank=2, on="recover", nth=2),
    )
    growth = {"grow": True, "min_gangs": 3, "max_gangs": 4}  # below 3 gangs it waits for joiners
    summary = job(tmp_path, *faults, gangs=3, gang_size=1, nodes=4, num_steps=8, **growth).run()
    dropped = [(e.gang_id, e.reason) for e in summary.events.of(GangDropped)]
    assert dropped == [
        (0, "rank(s) [0] died"),
        (2, "rank(s) [2] died"),
        (3, "rank(s) [3] died"),
        (4, "it was joining and had not healed yet"),
    ]
    assert [e.gang_id for e in summary.events.of(GangHealed)] == [5, 6, 7]
    assert gangs_of(summary) == [1, 5, 6, 7] and summary.steps == 8


# -- whole runs: the decisions in order ------------------------------------------------------


@contextlib.contextmanager
def decided(j: Job) -> Iterator[list[tuple[int, float, Decision]]]:
    """Records every decision other than ``Continue`` that the coordinator's loop asked for,
    with the job's step and the clock when it was decided."""
    seen: list[tuple[int, float, Decision]] = []
    patches = contextlib.ExitStack()
    inner = actors.job_training.decide

    def record(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        now = j.group.clock.now
        seen.extend((j.coordinator.state.step, now, d) for d in out if not isinstance(d, Continue))
        return out

    patches.enter_context(mock.patch.object(actors.job_training, "decide", record))
    with patches:
        yield seen


def test_three_failures_and_three_growths_in_one_run(tmp_path: Any) -> None:
    """A rank killed, a node removed and a gang hung, each followed by a gang placed on the
    node freed (or a new one): the whole story, in order, over the real coordinator."""
    faults = (
        RankDies(rank=1, step=3),  # gang 0
        NodeDies(node=2, step=17),  # gang 2's node: it never comes back
        RankHangs(rank=6, step=25),  # gang 3, both ranks
        RankHangs(rank=7, step=25),
        NodesJoin(at=42.0),  # a fresh node, after the hang was dealt with
    )
    j = job(tmp_path, *faults, gangs=4, nodes=4, num_steps=64, grow=True, max_gangs=4)
    with decided(j) as seen:
        summary = j.run()
    kinds_ = [type(d).__name__ for _, _, d in seen if isinstance(d, Reform | Grow)]
    assert kinds_ == [
        "Reform",  # rank 1 killed at step 3: gang 0 dropped
        "Grow",  # its node is free again: gang 4 is placed there and joins
        "Reform",  # node 2 removed at step 17: gang 2 dropped
        "Reform",  # gang 3 hangs in step 25: singled out after the collective timeouts
        "Grow",  # node 3 is free again: gang 5 joins
        "Grow",  # a fresh node arrives: gang 6 joins
    ]
    reforms = [d for _, _, d in seen if isinstance(d, Reform)]
    assert [d.drop for d in reforms] == [(0,), (2,), (3,)]
    assert reforms[2].hung_ranks == (6, 7)
    grows = [(s, d) for s, _, d in seen if isinstance(d, Grow)]
    assert [(s, d.join_step, d.gangs[0].gang.gang_id) for s, d in grows] == [
        (15, 15, 4),
        (35, 35, 5),
        (53, 53, 6),
    ]
    m = j.coordinator.state.membership
    assert m.gang_ids == (1, 4, 5, 6) and m.generation == 6 == summary.generation
    assert [e.generation for e in summary.events.of(GenerationStarted)] == list(range(7))
    assert [e.gang_id for e in summary.events.of(GangDropped)] == [0, 2, 3]
    # The hang is acted on 2 x collective_timeout_s + a poll after its peers' collectives
    # time out (collective_timeout_s after its last finished step), within one more poll.
    [hang] = summary.events.of(HangDetected)
    timeout, poll = ELASTIC["collective_timeout_s"], ELASTIC["poll_s"]
    assert hang.last_step == 24 and 3 * timeout < hang.silent_s <= 3 * timeout + 2 * poll
    assert [x.member_index for x in m.replica_groups[1]] == [0, 1, 2, 3]
    # Batches the dropped gangs trained since their last sync went to replay.
    assert replayed(summary)


def test_production_size_node_loss_and_rank_kill_keep_every_batch(tmp_path: Any) -> None:
    """4,096 ranks in 512 gangs of 8, two gangs per 16-rank node."""
    faults = (NodeDies(node=40, step=3), RankDies(rank=1001, step=6))
    j = job(
        tmp_path,
        *faults,
        gangs=512,
        gang_size=8,
        cpus_per_node=16,
        num_steps=40,
        grow=True,
        min_gangs=500,
        max_gangs=512,
    )
    with decided(j) as seen:
        j.run()
    drops = [d.drop for _, _, d in seen if isinstance(d, Reform)]
    # Gangs go one per node first, then the second gang of each node (failure domains): node
    # 40 holds gangs 40 and 296.
    assert drops == [(40, 296), (125,)]
    # Gang 125's node still runs gang 381, so its 8 free slots place one gang right away
    # (the lost node's two gangs have nowhere to go).
    grows = [d for _, _, d in seen if isinstance(d, Grow)]
    assert [[n.gang.gang_id for n in d.gangs] for d in grows] == [[512]]
    assert (
        j.coordinator.state.membership.num_gangs == 510 and len(j.coordinator.growth.pending) == 2
    )


def below_min_gangs(tmp_path: Any, *faults: Fault | NodesJoin) -> Job:
    """4 gangs of 2, two per node, at least 3 of them; node 1 (gangs 1 and 3: one gang per
    node first, then a second) goes at step 5, at t = 1.4 s."""
    return job(
        tmp_path,
        NodeDies(node=1, step=5),
        *faults,
        gangs=4,
        cpus_per_node=4,
        grow=True,
        max_gangs=4,
        min_gangs=3,
        resource_wait_s=100.0,
    )


def test_below_min_gangs_waits_and_fails_at_the_deadline(tmp_path: Any) -> None:
    j = below_min_gangs(tmp_path)
    with decided(j) as seen, pytest.raises(JobFailedError, match=re.escape("elastic.min_gangs=3")):
        j.run()
    summary = j.coordinator.summary_so_far()
    waits = [(t, d) for _, t, d in seen if isinstance(d, Wait)]
    assert waits[0][0] == 1.4 and {d.deadline for _, d in waits} == {101.4}
    assert len(waits) == 101  # one poll per second, from t = 1.4 to the deadline
    (fail,) = [d for _, _, d in seen if isinstance(d, Fail)]
    assert fail.config_key == "elastic.resource_wait_s" and not fail.needs_checkpoint
    (failed,) = summary.events.of(JobFailed)
    assert failed.at == 102.4 and not failed.needs_checkpoint  # the first poll past it
    assert "elastic.min_gangs=3" in failed.reason


def test_below_min_gangs_recovers_when_a_node_arrives_in_time(tmp_path: Any) -> None:
    j = below_min_gangs(tmp_path, NodesJoin(at=60.0))
    with decided(j) as seen:
        summary = j.run()
    (grow,) = [(s, t, d) for s, t, d in seen if isinstance(d, Grow)]
    step, t, d = grow
    # Paused at step 5: the node comes at t = 60, its placements are seen at the next poll
    # (60.4), both gangs build for 1 s and join at once, healed from a live peer.
    assert (step, t, d.join_step) == (5, 61.4, 5)
    assert [(n.gang.gang_id, n.heal_from) for n in d.gangs] == [(4, 0), (5, 0)]
    assert [list(e.nodes) for e in summary.events.of(GangPlaced)] == [
        ["fake-node-2 at 127.0.0.1"] * 2
    ] * 2
    assert j.coordinator.state.membership.gang_ids == (0, 2, 4, 5) == tuple(gangs_of(summary))


def test_within_host_node_loss_without_a_checkpoint_fails_naming_the_lost_shards(
    tmp_path: Any,
) -> None:
    """Layout replicas_within_host, 2 hosts of 8 ranks, gangs of 4: host 1 holds every copy of
    shards 2 and 3, and no checkpoint was configured."""
    j = job(
        tmp_path,
        NodeDies(node=1, step=4),
        gangs=4,
        gang_size=4,
        cpus_per_node=8,
        sync_every=2,
        layout="replicas_within_host",
    )
    topo = j.coordinator.topology
    # Node 1 holds every copy of shards 2 and 3.
    assert [{topo.host_of(r) for r in grp} for grp in topo.replica_groups] == [{0}, {0}, {1}, {1}]
    with decided(j) as seen, pytest.raises(JobFailedError):
        j.run()
    (fail,) = [d for _, _, d in seen if isinstance(d, Fail)]
    assert fail.needs_checkpoint and fail.config_key == "checkpoint.every_n_steps"
    assert "replica groups [2, 3] lost every copy of their shard" in fail.reason
    (failed,) = j.coordinator.summary_so_far().events.of(JobFailed)
    # The node went as step 4 started, in the interval from step 2 (the job's step then).
    assert failed.needs_checkpoint and failed.step == 2


def test_a_slow_rank_only_costs_time_unless_it_outlasts_the_collective_timeout(
    tmp_path: Any,
) -> None:
    def run(name: str, *faults: Fault) -> tuple[RunSummary, list[tuple[int, float, Decision]]]:
        (tmp_path / name).mkdir()
        j = job(tmp_path / name, *faults, gangs=4, num_steps=10)
        with decided(j) as seen:
            return j.run(), seen

    plain, _ = run("plain")
    slow, slow_seen = run("slow", SlowRank(rank=5, step_s=4.0))  # under collective_timeout_s
    assert plain.steps == slow.steps == 10
    # Every rank goes at the slowest one's pace: 4 s a step instead of 0.1 s.
    assert slow.wall_s - plain.wall_s == pytest.approx(10 * (4.0 - STEP_S))
    assert not any(isinstance(d, Reform) for _, _, d in slow_seen)
    # A step so slow that its peers' collectives time out and it is still silent 2 x
    # collective_timeout_s + a poll later: it counts as hung and its gang is dropped.
    stuck, stuck_seen = run("stuck", SlowRank(rank=5, step_s=40.0))
    (reform,) = [d for _, _, d in stuck_seen if isinstance(d, Reform)]
    assert reform.hung_ranks == (5,) and reform.drop == (2,) and stuck.steps == 10


# -- calls per change -----------------------------------------------------------------------


def record_calls(j: Job, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The method of every call the coordinator makes on the ranks, in order, from now on."""
    names: list[str] = []
    call = j.group.call

    class Name:
        def __getattr__(self, method: str) -> Any:
            return lambda *_a, **_k: method

    def recording(ranks: Sequence[int], invoke: Any) -> Any:
        if ranks:
            names.append(invoke(Name(), ranks[0]))
        return call(ranks, invoke)

    monkeypatch.setattr(j.group, "call", recording)
    return names


def test_a_loss_and_a_join_re_form_the_ranks_in_one_call_each_between_barriers(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a loss the survivors are waited on five times (abort, recover, then one re-form
    call to join the new generation with their replays, one to take the step and sync, one to
    settle the dense state); a joining gang's heal is one call after the generation's."""
    faults = (NodesJoin(at=1.0), RankDies(rank=1, step=8))
    j = job(tmp_path, *faults, gangs=2, max_gangs=3, grow=True, num_steps=40)
    names = record_calls(j, monkeypatch)
    summary = j.run()
    assert [e.gang_id for e in summary.events.of(GangDropped)] == [0]
    assert [e.gang_id for e in summary.events.of(GangJoined)] == [2, 3]
    loss = names.index("recover") - 1
    assert names[loss : loss + 5] == [
        "abort_replica_planes",
        "recover",
        "reform",  # replays and the new generation
        "reform",  # the step and the re-formed job's sync
        "reform",  # the dense state and the failed step
    ]
    joins = [
        i
        for i in range(len(names))
        if names[i : i + 4] == ["sync", "reform", "reform", "state_digest"]
    ]
    assert len(joins) == 2  # sync, generation, heal (the step and the peer's state), check
    parts = {"replay", "join_replica_plane", "join_sync_plan", "set_step", "broadcast_dense"}
    assert parts.isdisjoint(names) and "settle_failed_step" not in names
    assert_exactly_once(summary, j.group)
