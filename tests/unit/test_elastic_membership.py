"""Membership at production sizes, checked against raytrec.cluster.topology as the reference."""

from __future__ import annotations

import pytest

from raytrec.cluster.topology import Layout, Topology
from raytrec.elastic.membership import Membership, MembershipError, ReplicaMember

ACROSS = Layout.REPLICAS_ACROSS_HOSTS
WITHIN = Layout.REPLICAS_WITHIN_HOST

SIZES = [
    # The seed's production example: 1024 ranks, sharding group 256, one gang per host.
    Topology(world_size=1024, gang_size=256, ranks_per_host=256),
    # 512 gangs of 8, two gangs per 16-rank host.
    Topology(world_size=4096, gang_size=8, ranks_per_host=16),
    Topology(world_size=1024, gang_size=256, ranks_per_host=8, layout=WITHIN),
]


def expected_groups(topo: Topology, gangs: list[int]) -> list[list[ReplicaMember]]:
    """Reference: replica group k = rank k of each surviving topology gang, in gang order."""
    return [
        [
            ReplicaMember(job_rank=topo.gangs[g][k], gang_id=g, member_index=i)
            for i, g in enumerate(gangs)
        ]
        for k in range(topo.gang_size)
    ]


@pytest.mark.parametrize("topo", SIZES, ids=lambda t: f"{t.world_size}x{t.gang_size}-{t.layout}")
def test_initial_membership_matches_the_topology(topo: Topology) -> None:
    m = Membership.initial(topo)
    assert m.generation == 0 and m.num_gangs == topo.num_gangs
    assert [g.job_ranks for g in m.gangs] == list(topo.gangs)
    assert [[s.node for s in g.ranks] for g in m.gangs] == [
        [topo.host_of(r) for r in ranks] for ranks in topo.gangs
    ]
    groups = m.replica_groups
    assert [[x.job_rank for x in grp] for grp in groups] == [list(g) for g in topo.replica_groups]
    assert [list(grp) for grp in groups] == expected_groups(topo, list(range(topo.num_gangs)))


@pytest.mark.parametrize("topo", SIZES[:2], ids=["1024x256", "4096x8"])
def test_node_loss_drops_the_gangs_on_it_and_reforms_the_groups(topo: Topology) -> None:
    m = Membership.initial(topo)
    host = topo.num_hosts // 2 + 1
    lost = m.gangs_on_nodes([host])
    assert lost == tuple(sorted({topo.position(r).gang for r in topo.ranks_on_host(host)}))
    after = m.without(lost)
    survivors = [g for g in range(topo.num_gangs) if g not in lost]
    assert after.generation == 1 and list(after.gang_ids) == survivors
    assert [list(grp) for grp in after.replica_groups] == expected_groups(topo, survivors)
    # Member indices are dense 0..G'-1 in every group and a gang keeps one index in all groups.
    for gid in survivors:
        idx = after.member_index(gid)
        assert all(grp[idx].gang_id == gid for grp in after.replica_groups)
    assert after.gang_of_rank(topo.gangs[lost[0]][0]) is None


def test_node_loss_at_4096_drops_exactly_the_two_gangs_of_that_host() -> None:
    topo = SIZES[1]
    m = Membership.initial(topo)
    assert m.gangs_on_nodes([5]) == (10, 11)
    assert m.gangs_on_nodes([5, 7, 5]) == (10, 11, 14, 15)
    after = m.without((10, 11, 14, 15))
    assert after.num_gangs == 508
    grp3 = after.replica_groups[3]
    assert len(grp3) == 508
    # Gang 16 was member 16; four gangs below it are gone, so it is member 12 now.
    assert grp3[12] == ReplicaMember(job_rank=16 * 8 + 3, gang_id=16, member_index=12)


def test_new_gangs_get_fresh_ids_and_ranks_never_reused() -> None:
    topo = Topology(world_size=16, gang_size=4, ranks_per_host=4)
    m = Membership.initial(topo).without([1, 3])
    new, reserved = m.reserve([(7, 7, 7, 7)])
    assert [g.gang_id for g in new] == [4] and new[0].job_ranks == (16, 17, 18, 19)
    grown = reserved.with_gangs(new, step=12)
    assert grown.generation == 2 and grown.gang_ids == (0, 2, 4) and grown.last_sync_step == 12
    assert grown.gang(4).nodes == (7,)
    # Drop the new gang: the next one is 5, not 4 again, and ranks continue from 20.
    again, _ = grown.without([4]).reserve([(8, 8, 8, 8), (9, 9, 9, 9)])
    assert [g.gang_id for g in again] == [5, 6]
    assert again[1].job_ranks == (24, 25, 26, 27)
    assert [[x.member_index for x in grp] for grp in grown.replica_groups] == [[0, 1, 2]] * 4


def test_within_host_dead_shards_match_the_topology() -> None:
    topo = SIZES[2]  # G=4, hosts of 8 ranks: host h holds replica groups 2h and 2h+1
    m = Membership.initial(topo)
    for hosts in ([0], [3, 100], [5, 6, 7]):
        lost = [r for h in hosts for r in topo.ranks_on_host(h)]
        # Independently: the replica groups whose every member sits on a lost host.
        gone = {h for h in hosts if h < topo.num_hosts}
        assert m.dead_shards(lost) == tuple(
            k for k, grp in enumerate(topo.replica_groups) if {topo.host_of(r) for r in grp} <= gone
        )
    assert m.dead_shards(topo.ranks_on_host(0)) == (0, 1)
    # One rank lost: its shard still has three live copies.
    assert m.dead_shards([0]) == ()


def test_membership_errors() -> None:
    topo = Topology(world_size=8, gang_size=4, ranks_per_host=4)
    m = Membership.initial(topo)
    with pytest.raises(MembershipError, match=r"gang 5 is not live in generation 0; live gangs: "):
        m.without([5])
    with pytest.raises(MembershipError, match=r"no gang to drop"):
        m.without([])
    with pytest.raises(MembershipError, match=r"placement 0 names 2 nodes, one per gang rank"):
        m.reserve([(1, 1)])
    with pytest.raises(MembershipError, match=r"sync at step 3 is before the last committed"):
        m.synced(8).synced(3)
