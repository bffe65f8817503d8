"""Placement groups follow the layout: whole gangs per group, or per-host bundles."""

from __future__ import annotations

from raytrec.cluster.placement import PlacementSpec, placement_specs, rank_resources
from raytrec.cluster.topology import Layout, Topology


def bundle_of(spec: PlacementSpec, rank: int) -> int:
    (bundle,) = [b for b, ranks in enumerate(spec.ranks) if rank in ranks]
    return bundle


def test_across_hosts_places_each_gang_in_its_own_group() -> None:
    topo = Topology(world_size=8, gang_size=4, ranks_per_host=4)
    per_rank = rank_resources(cpus_per_rank=2, use_gpu=True)
    specs = placement_specs(topo, per_rank=per_rank)
    assert [s.name for s in specs] == ["gang0", "gang1"]
    assert [s.ranks for s in specs] == [((0, 1, 2, 3),), ((4, 5, 6, 7),)]
    assert specs[0].bundles == ({"CPU": 8.0, "GPU": 4.0},)
    assert {s.strategy for s in specs} == {"STRICT_PACK"}
    assert bundle_of(specs[1], 6) == 0


def test_a_gang_spanning_hosts_gets_one_bundle_per_host() -> None:
    topo = Topology(world_size=1024, gang_size=256, ranks_per_host=8)
    specs = placement_specs(topo, per_rank=rank_resources(cpus_per_rank=1, use_gpu=True))
    assert len(specs) == 4
    for g, spec in enumerate(specs):
        assert spec.strategy == "PACK"
        assert len(spec.bundles) == 32
        assert all(b == {"CPU": 8.0, "GPU": 8.0} for b in spec.bundles)
        assert sorted(r for rs in spec.ranks for r in rs) == list(topo.gangs[g])
        assert all(len({topo.host_of(r) for r in rs}) == 1 for rs in spec.ranks)
    # Only the requested gangs, e.g. when a new gang joins.
    assert [s.name for s in placement_specs(topo, per_rank={"CPU": 1}, gangs=(2,))] == ["gang2"]


def test_within_host_places_replica_groups_together() -> None:
    topo = Topology(world_size=8, gang_size=4, ranks_per_host=4, layout=Layout.REPLICAS_WITHIN_HOST)
    (spec,) = placement_specs(topo, per_rank={"CPU": 1.0})
    assert spec.ranks == ((0, 1, 2, 3), (4, 5, 6, 7))
    for group in topo.replica_groups:
        assert len({bundle_of(spec, r) for r in group}) == 1
