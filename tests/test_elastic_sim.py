"""Whole runs of a simulated elastic job: failures, waits, growth, and every row exactly once.

Each run ends with the ledger's exactly-once check, cross-checked by a ledger double that counts
every committed id in a Counter."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from raytrec.cluster.topology import Layout, Topology
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import GangDropped, GenerationStarted, HangDetected, JobFailed
from raytrec.elastic.faults import FaultConfig
from raytrec.elastic.ledger import DataLedger, ReplayPlan
from raytrec.elastic.policy import Continue, Fail, Grow, Reform, Unrecoverable, WaitForResources
from raytrec.elastic.rows import RowRanges
from raytrec.elastic.sim import NodeArrival, SimJob, SimResult

CFG = ElasticConfig(
    min_gangs=2, step_timeout_s=30, collective_timeout_s=10, resource_wait_s=100, poll_s=1
)

CFG3 = ElasticConfig(
    min_gangs=3, step_timeout_s=30, collective_timeout_s=10, resource_wait_s=100, poll_s=1
)


class CountingLedger(DataLedger):
    """Keeps its own per-id Counter of what each gang read and what got committed."""

    def __init__(self, rows_per_epoch: int, gang_ids: Iterable[int]) -> None:
        self.reads: dict[int, Counter[tuple[int, int]]] = {}
        self.counted: Counter[tuple[int, int]] = Counter()
        super().__init__(rows_per_epoch, gang_ids)

    def add_gangs(self, gang_ids: Iterable[int]) -> None:
        gang_ids = list(gang_ids)
        super().add_gangs(gang_ids)
        self.reads.update({g: Counter() for g in gang_ids})

    def consume(self, gang_id: int, epoch: int, rows: RowRanges) -> None:
        super().consume(gang_id, epoch, rows)
        self.reads[gang_id].update((epoch, i) for i in rows)

    def commit(self, gang_ids: Iterable[int]) -> int:
        gang_ids = list(gang_ids)
        for g in gang_ids:
            self.counted.update(self.reads[g])
            self.reads[g] = Counter()
        return super().commit(gang_ids)

    def drop(self, gang_ids: Iterable[int], survivors: Sequence[int]) -> ReplayPlan:
        gang_ids = list(gang_ids)
        plan = super().drop(gang_ids, survivors)
        for g in gang_ids:
            del self.reads[g]
        return plan


def run(topo: Topology, **kw: Any) -> SimResult:
    job = SimJob(topo, **kw)
    job.ledger = CountingLedger(job.ledger.rows_per_epoch, job.ledger.gang_ids)
    return job.run()


def assert_every_row_once(result: SimResult) -> None:
    ledger = result.ledger
    assert isinstance(ledger, CountingLedger)
    n = ledger.rows_per_epoch
    for epoch in range(result.epochs):
        report = ledger.check_exactly_once(epoch)
        assert report.ok, report
        assert all(ledger.counted[(epoch, i)] == 1 for i in range(n))
    assert sum(ledger.counted.values()) == n * result.epochs
    assert all(not ledger.pending(g) for g in result.state.membership.gang_ids)


def test_three_failures_and_one_growth_in_one_run() -> None:
    topo = Topology(world_size=8, gang_size=2, ranks_per_host=2)  # 4 gangs, node i = gang i
    faults = FaultConfig.parse("kill_rank@3:rank=1, remove_node@7:node=2, hang_rank@12:gang=3")
    result = run(
        topo,
        config=CFG,
        sync_every=4,
        rows_per_epoch=1000,
        rows_per_step=16,
        epochs=2,
        faults=faults,
        arrivals=[NodeArrival(step=21, count=1)],
    )
    assert isinstance(result.outcome, Continue)
    kinds = [d for _, _, d in result.decisions if not isinstance(d, Continue)]
    assert [type(d).__name__ for d in kinds] == [
        "Reform",  # rank 1 killed at step 3: gang 0 dropped
        "Grow",  # its node is free again: a new gang joins at the boundary of step 4
        "Reform",  # node 2 removed at step 7: gang 2 dropped
        "Reform",  # gang 3 hangs in step 13: singled out after step_timeout_s
        "Grow",  # node 3 is free again, but step 13 was started and aborted: join at 16
        "Grow",  # a fresh node arrives at step 21: joins at step 24
    ]
    reforms = [d for d in kinds if isinstance(d, Reform)]
    assert [d.drop for d in reforms] == [(0,), (2,), (3,)]
    assert reforms[2].hung_ranks == (6, 7)
    grows = [(s, d) for s, _, d in result.decisions if isinstance(d, Grow)]
    assert [(s, d.join_step, d.gangs[0].gang.gang_id) for s, d in grows] == [
        (4, 4, 4),
        (16, 16, 5),
        (24, 24, 6),
    ]
    m = result.state.membership
    assert m.gang_ids == (1, 4, 5, 6) and m.generation == 6
    assert [e.generation for e in result.events.of(GenerationStarted)] == [1, 2, 3, 4, 5, 6]
    assert [e.gang_id for e in result.events.of(GangDropped)] == [0, 2, 3]
    # The hang is acted on within step_timeout_s + poll_s of the last finished step (t=12).
    (hang,) = result.events.of(HangDetected)
    assert hang.last_step == 12 and 30 < hang.silent_s <= 31 and hang.at == 12 + hang.silent_s
    assert [x.member_index for x in m.replica_groups[1]] == [0, 1, 2, 3]
    # Rows the dropped gangs had read since their last sync went to replay.
    assert result.ledger.replayed(0).count > 0
    assert_every_row_once(result)


def test_production_size_node_loss_and_rank_kill_keep_every_row() -> None:
    topo = Topology(world_size=4096, gang_size=8, ranks_per_host=16)
    faults = FaultConfig.parse("remove_node@3:node=40, kill_rank@6:rank=1001")
    result = run(
        topo,
        config=ElasticConfig(min_gangs=500, max_gangs=512),
        sync_every=4,
        rows_per_epoch=512 * 64 * 10,
        rows_per_step=64,
        faults=faults,
    )
    drops = [d.drop for _, _, d in result.decisions if isinstance(d, Reform)]
    assert drops == [(80, 81), (125,)]
    # Gang 125's node still runs gang 124, so its 8 free slots place one gang right away
    # (the lost node's two gangs have nowhere to go).
    grows = [d for _, _, d in result.decisions if isinstance(d, Grow)]
    assert [[n.gang.gang_id for n in d.gangs] for d in grows] == [[512]]
    assert result.state.membership.num_gangs == 510 and result.state.outstanding == 2
    assert_every_row_once(result)


def test_below_min_gangs_waits_and_fails_at_the_deadline() -> None:
    topo = Topology(world_size=8, gang_size=2, ranks_per_host=4)  # two gangs per node
    faults = FaultConfig.parse("remove_node@5:node=1")
    result = run(
        topo,
        config=CFG3,
        sync_every=4,
        rows_per_epoch=1000,
        rows_per_step=10,
        faults=faults,
    )
    assert isinstance(result.outcome, Fail)
    waits = [(t, d) for _, t, d in result.decisions if isinstance(d, WaitForResources)]
    assert waits[0][0] == 5.0 and {d.deadline for _, d in waits} == {105.0}
    assert len(waits) == 100  # one poll per second until t = 105
    (failed,) = result.events.of(JobFailed)
    assert failed.at == 105.0 and not failed.needs_checkpoint
    assert "below elastic.min_gangs=3" in failed.reason


def test_below_min_gangs_recovers_when_a_node_arrives_in_time() -> None:
    topo = Topology(world_size=8, gang_size=2, ranks_per_host=4)
    faults = FaultConfig.parse("remove_node@5:node=1")
    result = run(
        topo,
        config=CFG3,
        sync_every=4,
        rows_per_epoch=1000,
        rows_per_step=10,
        faults=faults,
        arrivals=[NodeArrival(at=60.0, count=1)],
    )
    assert isinstance(result.outcome, Continue)
    (grow,) = [(s, t, d) for s, t, d in result.decisions if isinstance(d, Grow)]
    step, t, d = grow
    # Paused at step 5 (not a sync boundary): the survivors sync there and both gangs join.
    assert (step, t, d.join_step) == (5, 60.0, 5)
    assert [(n.gang.gang_id, n.heal_from, n.gang.nodes) for n in d.gangs] == [
        (4, 0, (2,)),
        (5, 1, (2,)),
    ]
    assert result.state.membership.gang_ids == (0, 1, 4, 5)
    assert_every_row_once(result)


def test_within_host_node_loss_is_unrecoverable() -> None:
    topo = Topology(
        world_size=16, gang_size=4, ranks_per_host=8, layout=Layout.REPLICAS_WITHIN_HOST
    )
    result = run(
        topo,
        config=CFG,
        sync_every=2,
        rows_per_epoch=500,
        rows_per_step=5,
        faults=FaultConfig.parse("remove_node@4:node=1"),
    )
    assert isinstance(result.outcome, Unrecoverable)
    assert result.outcome.lost_shards == topo.shards_without_live_copy([1]) == (2, 3)
    (failed,) = result.events.of(JobFailed)
    assert failed.needs_checkpoint and failed.step == 4


def test_slow_rank_only_costs_time_unless_it_outlasts_the_collective_timeout() -> None:
    topo = Topology(world_size=8, gang_size=2, ranks_per_host=2)
    common: dict[str, Any] = dict(config=CFG, sync_every=4, rows_per_epoch=400, rows_per_step=10)
    plain = run(topo, **common)
    slow = run(topo, faults=FaultConfig.parse("slow_rank@2:rank=5:stall_s=4:steps=3"), **common)
    assert plain.steps == slow.steps == 10
    end = lambda r: r.decisions[-1][1]  # noqa: E731
    assert end(slow) - end(plain) == 3 * 4.0
    assert not any(isinstance(d, Reform) for _, _, d in slow.decisions)
    assert_every_row_once(slow)
    stuck = run(topo, faults=FaultConfig.parse("slow_rank@2:rank=5:stall_s=15"), **common)
    (reform,) = [d for _, _, d in stuck.decisions if isinstance(d, Reform)]
    assert reform.hung_ranks == (5,) and reform.drop == (2,)
    assert_every_row_once(stuck)
