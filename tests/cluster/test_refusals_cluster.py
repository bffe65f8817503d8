"""Jobs a cluster can never hold are refused before any data is generated or any rank started,
with exit code 2 and a message naming the node sizes and what was asked; a placement that
stays unfulfilled says so while it waits and ends with the same exit code.

The main job's entry point (``jobs.train.main``, as ``python -m jobs.train`` runs it) trains
on a 2-node local cluster (2 CPUs each, 127.0.0.1) that this process is connected to, as a
job's driver under ``ray job submit`` is.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group

from jobs.train import main
from raytrec.testing import simulated_cluster

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with simulated_cluster(2, cpus_per_node=2) as c:
        yield c


@dataclasses.dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def train(capsys: pytest.CaptureFixture[str], storage: str, *sets: str) -> Run:
    args = [f"--set={s}" for s in ("num_steps=4", "log_every=2", *sets)]
    code = main(["--storage-path", storage, *args])
    out = capsys.readouterr()
    return Run(returncode=code, stdout=out.out, stderr=out.err)


def ranks_started() -> int:
    """Rank actors this cluster ever had, dead ones included (the GCS actor table)."""
    table = ray._private.state.actors()
    return sum(1 for a in table.values() if a["ActorClassName"].endswith("RankWorker"))


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ("scaling.num_workers=4", "scaling.gang_size=4"),
            "scaling: 4 ranks of a gang share a host (scaling.ranks_per_host=4) and must be "
            "placed on one node together, needing {CPU: 4}, but no node is that big (nodes: 2 x "
            "{CPU: 2} (alive))",
        ),
        (
            ("scaling.num_workers=6", "scaling.gang_size=2"),
            "scaling: 6 workers (3 gangs x 2 ranks, {CPU: 1} each) are placed as 3 groups of "
            "ranks that each share a node, and the cluster holds at most 2 of them at once "
            "(nodes: 2 x {CPU: 2} (alive))",
        ),
        (
            ("scaling.num_workers=2", "scaling.gang_size=2", "scaling.use_gpu=true"),
            "scaling.use_gpu is set: 2 workers (1 gang x 2 ranks, {CPU: 1, GPU: 1} each) need a "
            "GPU per rank, but no node of the cluster has a GPU (nodes: 2 x {CPU: 2} (alive))",
        ),
    ],
    ids=["gang-bigger-than-a-node", "too-many-workers", "gpu-without-gpus"],
)
def test_an_impossible_job_is_refused_before_anything_starts(
    cluster: Cluster,
    tmp_path: str,
    capsys: pytest.CaptureFixture[str],
    sets: tuple[str, ...],
    message: str,
) -> None:
    storage = os.path.join(tmp_path, "runs")
    before = ranks_started()
    out = train(capsys, storage, *sets)  # the main job's data.source: generated Parquet
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    assert message in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    # Nothing generated, no run directory, no rank.
    assert not os.path.exists(storage) or os.listdir(storage) == []
    assert ranks_started() == before


def test_a_placement_that_stays_unfulfilled_says_so_and_ends_with_the_config_exit_code(
    cluster: Cluster, tmp_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Another holder takes one of the two nodes: the job fits the cluster, but not now.
    held = placement_group([{"CPU": 2}], strategy="STRICT_PACK")
    ray.get(held.ready(), timeout=60)
    try:
        out = train(
            capsys,
            str(tmp_path),
            "scaling.num_workers=4",
            "scaling.gang_size=2",
            "data.source=synthetic",
            "elastic.resource_wait_s=6",
        )
    finally:
        remove_placement_group(held)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    waiting = [line for line in out.stdout.splitlines() if "placement_waiting" in line]
    assert len(waiting) >= 2, out.stdout[-3000:]
    assert "asked=2 x {CPU: 2} on one node each" in waiting[0], waiting
    assert "nodes=127.0.0.1 {CPU: 2}, 127.0.0.1 {CPU: 2}" in waiting[0], waiting
    assert (
        "the job's placement groups (2 x {CPU: 2} on one node each) were not ready within "
        "elastic.resource_wait_s=6s" in out.stderr
    ), out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
