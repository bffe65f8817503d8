"""Jobs a cluster can never hold are refused before anything starts (raytrec.cluster.capacity)."""

from __future__ import annotations

import pytest

from raytrec.cluster.capacity import NodeShape, capacity_refusal
from raytrec.config import ScalingConfig, TrainConfig


def job(**scaling: object) -> TrainConfig:
    return TrainConfig(scaling=ScalingConfig(**scaling))  # type: ignore[arg-type]


def nodes(count: int | None, cpus: float, gpus: float = 0, name: str = "alive") -> NodeShape:
    res = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return NodeShape(name=name, resources=res, count=count)


def test_a_job_that_fits_is_not_refused() -> None:
    # 4 gangs of 2 ranks, one gang per host: four bundles of 2 CPUs on two 4-CPU nodes.
    assert capacity_refusal(job(num_workers=8, gang_size=2), [nodes(2, 4)]) is None
    assert capacity_refusal(job(num_workers=8, gang_size=2), [nodes(1, 8)]) is None


def test_more_workers_than_the_nodes_can_hold_at_once() -> None:
    refusal = capacity_refusal(job(num_workers=8, gang_size=2), [nodes(3, 2)])
    assert refusal == (
        "scaling: 8 workers (4 gangs x 2 ranks, {CPU: 1} each) are placed as 4 groups of ranks "
        "that each share a node, and the cluster holds at most 3 of them at once (nodes: 3 x "
        "{CPU: 2} (alive)); lower scaling.num_workers or scaling.cpus_per_rank, or add nodes"
    )
    # Packing counts: 3 CPUs per node hold one 2-CPU bundle each, not one and a half.
    assert "at most 2 of them" in str(
        capacity_refusal(job(num_workers=6, gang_size=2), [nodes(2, 3)])
    )


def test_a_gang_bigger_than_any_node() -> None:
    refusal = capacity_refusal(job(num_workers=8, gang_size=4), [nodes(4, 2), nodes(1, 3)])
    assert refusal == (
        "scaling: 4 ranks of a gang share a host (scaling.ranks_per_host=4) and must be placed "
        "on one node together, needing {CPU: 4}, but no node is that big (nodes: 4 x {CPU: 2} "
        "(alive), 1 x {CPU: 3} (alive)); lower scaling.ranks_per_host or scaling.cpus_per_rank, "
        "or add bigger nodes"
    )
    # Spread over hosts of 2 ranks, the same gang fits.
    assert (
        capacity_refusal(job(num_workers=8, gang_size=4, ranks_per_host=2), [nodes(4, 2)]) is None
    )


def test_a_gpu_job_on_a_cluster_without_gpus() -> None:
    refusal = capacity_refusal(job(num_workers=2, gang_size=2, use_gpu=True), [nodes(2, 16)])
    assert refusal is not None and refusal.startswith(
        "scaling.use_gpu is set: 2 workers (1 gang x 2 ranks, {CPU: 1, GPU: 1} each) need a GPU "
        "per rank, but no node of the cluster has a GPU (nodes: 2 x {CPU: 16} (alive))"
    )
    # A node type the autoscaler may add with GPUs is enough.
    gpu_type = nodes(None, 8, gpus=2, name="node type gpu")
    assert (
        capacity_refusal(job(num_workers=2, gang_size=2, use_gpu=True), [nodes(1, 4), gpu_type])
        is None
    )


def test_node_types_an_autoscaler_may_add_count() -> None:
    big = job(num_workers=16, gang_size=4)
    assert capacity_refusal(big, [nodes(1, 4)]) is not None
    assert capacity_refusal(big, [nodes(1, 4), nodes(None, 4, name="node type cpu")]) is None
    limited = capacity_refusal(big, [nodes(1, 4), nodes(2, 4, name="node type cpu")])
    assert "at most 3 of them" in str(limited) and "2 x {CPU: 4} (node type cpu)" in str(limited)


@pytest.mark.parametrize("cpus, refused", [(8, True), (9, False)])
def test_ray_data_needs_a_cpu_beside_the_ranks(cpus: float, refused: bool) -> None:
    cfg = job(num_workers=8, gang_size=2)
    refusal = capacity_refusal(cfg, [nodes(1, cpus)], ray_data=True)
    assert (refusal is not None) is refused
    if refused:
        assert "whose tasks need at least 1 CPU of their own" in str(refusal)
