"""The elastic policy stepped with observations and a frozen clock, at production sizes."""

from __future__ import annotations

import json

import pytest

from raytrec.cluster.topology import Layout, Topology
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.decisions import Continue, Fail, Grow, Reform, TotalLoss, Wait
from raytrec.elastic.events import (
    EventLog,
    GangDropped,
    GenerationStarted,
    HangDetected,
    JobFailed,
    ResourcesWaited,
)
from raytrec.elastic.job_state import (
    CollectiveTimeout,
    ElasticState,
    NodeLost,
    Observation,
    PlacementReady,
    RankExited,
    StepDone,
    SyncDone,
    observe,
)
from raytrec.elastic.policy import (
    MembershipDecision,
    apply,
    decide_membership,
    placement_requests,
    request_placements,
)

T1024 = Topology(world_size=1024, gang_size=256, ranks_per_host=256)
T4096 = Topology(world_size=4096, gang_size=8, ranks_per_host=16)
W1024 = Topology(
    world_size=1024, gang_size=256, ranks_per_host=8, layout=Layout.REPLICAS_WITHIN_HOST
)
CFG = ElasticConfig(
    min_gangs=1, step_timeout_s=60, collective_timeout_s=20, resource_wait_s=300, poll_s=1
)


class Loop:
    """A controller double: folds observations, decides, applies, keeps the event log."""

    def __init__(self, topo: Topology, config: ElasticConfig = CFG, sync_every: int = 4) -> None:
        self.config, self.now, self.log = config, 0.0, EventLog()
        self.state = ElasticState.initial(topo, config=config, sync_every=sync_every, now=0.0)

    def see(self, *obs: Observation) -> None:
        self.state, events = observe(self.state, obs)
        self.log.append(*events)

    def decide(self) -> MembershipDecision:
        return decide_membership(self.state, now=self.now, config=self.config)

    def step(self) -> MembershipDecision:
        d = self.decide()
        self.state, events = apply(self.state, d, now=self.now, config=self.config)
        self.log.append(*events)
        return d

    def request(self) -> int:
        n = placement_requests(self.state, self.config)
        self.state, events = request_placements(self.state, n, now=self.now)
        self.log.append(*events)
        return n

    def train(self, steps: int, dt: float = 1.0) -> None:
        ranks = [r for g in self.state.membership.gangs for r in g.job_ranks]
        for _ in range(steps):
            self.now += dt
            s = self.state.step + 1
            self.see(*(StepDone(job_rank=r, step=s, at=self.now) for r in ranks))
            if s % self.state.sync_every == 0:
                self.see(SyncDone(step=s, at=self.now))


def test_node_loss_at_1024_drops_one_gang_and_reforms() -> None:
    loop = Loop(T1024)
    loop.train(6)
    assert isinstance(loop.decide(), Continue)
    loop.see(NodeLost(node=2, at=loop.now))
    d = loop.step()
    assert isinstance(d, Reform)
    assert (d.drop, d.survivors, d.generation) == ((2,), (0, 1, 3), 1)
    assert d.lost_ranks == tuple(range(512, 768)) and d.hung_ranks == ()
    assert d.reason.startswith("lost node(s) [2]: dropping gangs [2]; 3 gangs [0, 1, 3]")
    m = loop.state.membership
    assert m.generation == 1
    for k, grp in enumerate(m.replica_groups):
        assert [(x.job_rank, x.member_index) for x in grp] == [(k, 0), (256 + k, 1), (768 + k, 2)]
    assert loop.log.kinds() == ["node_died", "gang_dropped", "generation_started"]
    assert isinstance(loop.decide(), Continue)


def test_node_loss_at_4096_drops_the_two_gangs_on_the_host() -> None:
    loop = Loop(T4096)
    loop.see(NodeLost(node=100, at=0.0))
    d = loop.step()
    assert isinstance(d, Reform) and d.drop == (200, 201) and len(d.survivors) == 510
    m = loop.state.membership
    assert m.generation == 1 and m.num_gangs == 510
    grp = m.replica_groups[7]
    assert [x.member_index for x in grp] == list(range(510))
    assert grp[200].gang_id == 202 and grp[200].job_rank == 202 * 8 + 7
    assert [e.gang_id for e in loop.log.of(GangDropped)] == [200, 201]


def test_several_failures_at_once_are_one_reform() -> None:
    loop = Loop(T4096)
    loop.see(
        RankExited(job_rank=3 * 8 + 5, at=0.0, cause="ActorDiedError"),
        NodeLost(node=10, at=0.0),
        NodeLost(node=11, at=0.0),
        RankExited(job_rank=20 * 8, at=0.0),  # gang 20 is on node 10: no extra gang
    )
    d = loop.step()
    assert isinstance(d, Reform)
    assert d.drop == (3, 20, 21, 22, 23) and d.generation == 1
    assert len(d.lost_ranks) == 1 + 32
    assert len(loop.log.of(GenerationStarted)) == 1
    assert loop.state.membership.num_gangs == 507
    assert loop.state.dead_ranks == frozenset()
    # A death reported late for a rank of a dropped gang changes nothing.
    loop.see(RankExited(job_rank=3 * 8, at=1.0))
    assert isinstance(loop.decide(), Continue)


def test_within_host_host_loss_is_unrecoverable_and_names_the_replica_groups() -> None:
    loop = Loop(W1024)
    loop.now = 3.0
    loop.see(NodeLost(node=5, at=3.0))
    d = loop.step()
    assert isinstance(d, TotalLoss)
    assert d.lost_shards == W1024.shards_without_live_copy([5]) == (10, 11)
    assert "replica groups [10, 11] lost every copy of their shard" in d.reason
    assert "needs a checkpoint" in d.reason
    (failed,) = loop.log.of(JobFailed)
    assert failed.needs_checkpoint and failed.reason == d.reason
    assert isinstance(loop.step(), Fail) and len(loop.log.of(JobFailed)) == 1


def test_within_host_single_rank_death_only_drops_its_gang() -> None:
    loop = Loop(W1024)
    loop.see(RankExited(job_rank=41, at=0.0))  # gang 41 % 4 = 1
    d = loop.step()
    assert isinstance(d, Reform) and d.drop == (1,) and d.survivors == (0, 2, 3)


def below_min_loop() -> Loop:
    cfg = ElasticConfig(
        min_gangs=3, step_timeout_s=60, collective_timeout_s=20, resource_wait_s=300, poll_s=1
    )
    loop = Loop(T1024, cfg)
    loop.train(5)
    loop.see(NodeLost(node=0, at=loop.now), NodeLost(node=3, at=loop.now))
    assert isinstance(loop.step(), Reform)
    return loop


def test_below_min_gangs_waits_then_fails_after_the_deadline() -> None:
    loop = below_min_loop()
    assert loop.state.membership.gang_ids == (1, 2)
    assert loop.request() == 2  # back to max_gangs = 4: two gang placement groups
    d = loop.step()
    assert isinstance(d, Wait)
    assert (d.missing_gangs, d.deadline) == (1, 5.0 + 300)
    (waited,) = loop.log.of(ResourcesWaited)
    assert (waited.live_gangs, waited.min_gangs, waited.deadline) == (2, 3, 305.0)
    loop.now = 304.9
    d = loop.step()
    assert isinstance(d, Wait) and d.deadline == 305.0
    assert len(loop.log.of(ResourcesWaited)) == 1
    # Paused: silence for far longer than step_timeout_s is not a hang.
    assert isinstance(loop.decide(), Wait)
    loop.now = 305.0
    d = loop.step()
    assert isinstance(d, Fail)
    assert "below elastic.min_gangs=3" in d.reason and "resource_wait_s=300s" in d.reason
    assert loop.log.kinds()[-1] == "job_failed"
    assert placement_requests(loop.state, loop.config) == 0


def test_below_min_gangs_recovers_when_a_gang_is_placed_in_time() -> None:
    loop = below_min_loop()
    loop.request()
    assert isinstance(loop.step(), Wait)
    loop.now = 200.0
    loop.see(PlacementReady(nodes=(9,) * 256, at=loop.now))
    d = loop.step()
    assert isinstance(d, Grow)
    # Paused below min: the survivors sync now, at step 5, and the new gang joins there.
    assert d.join_step == 5 and d.generation == 2
    (new,) = d.gangs
    assert new.gang.gang_id == 4 and new.heal_from == 1
    assert new.gang.job_ranks == tuple(range(1024, 1280))
    m = loop.state.membership
    assert m.gang_ids == (1, 2, 4) and m.generation == 2 and m.last_sync_step == 5
    assert loop.state.waiting_since is None and loop.state.outstanding == 1
    assert loop.log.kinds()[-3:] == ["gang_healed", "gang_joined", "generation_started"]
    assert isinstance(loop.decide(), Continue)
    assert [x.member_index for x in m.replica_groups[0]] == [0, 1, 2]


def test_growth_waits_for_the_sync_boundary_and_is_capped_by_max_gangs() -> None:
    cfg = ElasticConfig(
        min_gangs=2, max_gangs=6, step_timeout_s=60, collective_timeout_s=20, poll_s=1
    )
    loop = Loop(Topology(world_size=32, gang_size=8, ranks_per_host=8), cfg, sync_every=4)
    assert loop.request() == 2  # 4 live, max 6
    assert loop.request() == 0  # already outstanding
    loop.train(5)
    loop.see(*(PlacementReady(nodes=(n,) * 8, at=loop.now) for n in (10, 11)))
    d = loop.decide()
    assert isinstance(d, Continue) and d.join_at == 8
    assert "2 placed gang(s) wait for the sync boundary at step 8" in d.reason
    loop.train(3)
    d = loop.step()
    assert isinstance(d, Grow) and d.join_step == 8
    assert [(n.gang.gang_id, n.heal_from) for n in d.gangs] == [(4, 0), (5, 1)]
    assert loop.state.membership.num_gangs == 6
    assert loop.request() == 0 and isinstance(loop.decide(), Continue)


def test_growth_never_exceeds_max_gangs_even_with_more_ready() -> None:
    cfg = ElasticConfig(max_gangs=5, step_timeout_s=60, collective_timeout_s=20, poll_s=1)
    loop = Loop(Topology(world_size=32, gang_size=8, ranks_per_host=8), cfg)
    loop.see(RankExited(job_rank=0, at=0.0))
    loop.step()
    assert loop.request() == 2  # 3 live, max 5
    loop.see(*(PlacementReady(nodes=(n,) * 8, at=0.0) for n in (10, 11)))
    d = loop.step()
    assert isinstance(d, Grow) and len(d.gangs) == 2
    assert loop.state.membership.num_gangs == 5
    # Without automatic growth, only the way back to min_gangs is requested.
    no_grow = ElasticConfig(min_gangs=4, grow=False, step_timeout_s=60, collective_timeout_s=20)
    loop = Loop(Topology(world_size=32, gang_size=8, ranks_per_host=8), no_grow)
    assert loop.request() == 0
    loop.see(RankExited(job_rank=9, at=0.0))
    loop.step()
    assert loop.request() == 1


def test_a_silent_rank_is_singled_out_as_hung() -> None:
    loop = Loop(T1024)
    loop.train(10)  # t = 10
    hung = 300
    others = [r for r in range(1024) if r != hung]
    # Step 11: everybody but rank 300 is blocked; they time out after collective_timeout_s.
    loop.now = 30.0
    loop.see(*(CollectiveTimeout(job_rank=r, step=11, at=loop.now) for r in others))
    loop.now = 70.0  # exactly step_timeout_s of silence: not yet
    assert isinstance(loop.decide(), Continue)
    loop.now = 70.5
    d = loop.step()
    assert isinstance(d, Reform)
    assert d.hung_ranks == (hung,) and d.drop == (1,) and d.survivors == (0, 2, 3)
    assert "hung rank(s) [300] (no step finished for 60.5s)" in d.reason
    (h,) = loop.log.of(HangDetected)
    assert (h.job_ranks, h.gang_ids, h.last_step, h.silent_s) == ((300,), (1,), 10, 60.5)
    # The survivors' clocks restart with the new generation.
    assert isinstance(loop.decide(), Continue)
    assert not loop.state.at_sync_boundary  # step 11 was started and aborted
    assert loop.state.next_sync_step == 12


def test_when_every_stalled_rank_timed_out_none_can_be_singled_out() -> None:
    loop = Loop(Topology(world_size=8, gang_size=4, ranks_per_host=4))
    loop.see(*(CollectiveTimeout(job_rank=r, step=1, at=20.0) for r in range(8)))
    loop.now = 61.0
    d = loop.step()
    assert isinstance(d, TotalLoss) and "hung rank(s) [0, 1, 2, 3, 4, 5, 6, 7]" in d.reason
    assert d.lost_shards == (0, 1, 2, 3)


def test_a_placement_on_a_lost_node_is_requested_again() -> None:
    loop = Loop(Topology(world_size=16, gang_size=8, ranks_per_host=8), sync_every=1)
    loop.see(RankExited(job_rank=0, at=0.0))
    loop.step()
    assert loop.request() == 1
    loop.see(PlacementReady(nodes=(5,) * 8, at=1.0))
    assert loop.state.ready == ((5,) * 8,) and loop.state.outstanding == 0
    loop.see(NodeLost(node=5, at=1.0))
    assert loop.state.ready == () and loop.state.outstanding == 1
    with pytest.raises(ValueError, match=r"never requested"):
        observe(loop.state, [PlacementReady(nodes=(6,) * 8, at=2.0)] * 2)


def test_events_are_json_ready_and_time_ordered() -> None:
    loop = below_min_loop()
    loop.request()
    loop.step()
    rows = json.loads(json.dumps(loop.log.to_dicts()))
    assert [r["kind"] for r in rows] == [
        "node_died",
        "node_died",
        "gang_dropped",
        "gang_dropped",
        "generation_started",
        "gang_requested",
        "resources_waited",
    ]
    assert rows[2] == {
        "kind": "gang_dropped",
        "at": 5.0,
        "step": 5,
        "gang_id": 0,
        "reason": "lost node(s) [0, 3]: dropping gangs [0, 3]; 2 gangs [1, 2] form generation 1",
    }
    assert rows[4]["gang_ids"] == [1, 2] and rows[5]["outstanding"] == 2
    with pytest.raises(ValueError, match=r"earlier than the last one"):
        loop.log.append(GangDropped(at=1.0, step=0, gang_id=9, reason=""))
