"""The control plane's rules on a local Ray cluster: hangs by heartbeat, heals checked.

- Every rank hangs in the middle of a 25-step interval. The rule is "a rank that finishes no
  step for ``elastic.step_timeout_s`` is hung", read from the ranks' heartbeats, so the hang is
  found within ``step_timeout_s + poll_s`` (plus scheduling slack), not after 25 times that; no
  gang survives, so the job is rebuilt from its checkpoint and finishes.
- A gang is given back on request in the middle of the epoch (``raytrec.drain``): the rows each
  rank actually trained, recorded by the model itself as it sees them, cover every row of the
  data exactly once.
- A node is marked for removal in Ray's GCS (as an autoscaler or a preemption notice does): the
  gang on it is given back at the next boundary, its work committed, and the job trains on.
  Its coordinator's process is then killed: the new one resumes from the checkpoint on the one
  gang the nodes that are not being removed hold, rather than waiting for a second.
- While the job trains, its rendezvous store listens on the loopback address only (as does
  every socket its processes listen on), and a client outside the job finds none of the job's
  keys: they lie under a secret that only the ranks were handed.
- A replacement gang's heal is corrupted (an injected fault leaves one weight off after the
  peer's state was copied). The coordinator compares digests before any averaging, drops that
  gang, places another, which heals, and the job ends with every replica identical and every
  batch trained once.
"""

from __future__ import annotations

import datetime
import glob
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray.cloudpickle
import torch
from ray.cluster_utils import Cluster
from test_elastic_cluster import assert_every_batch_once, assert_replicas_agree
from torch import nn

import raytrec
from raytrec.api import fit
from raytrec.checkpoint.config import CheckpointConfig
from raytrec.config import (
    DataConfig,
    ModelConfig,
    ScalingConfig,
    SyncConfig,
    TestingConfig,
    TrainConfig,
    criteo_tables,
)
from raytrec.data.generate import write_synthetic_parquet
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import (
    CheckpointRestored,
    CoordinatorRestarted,
    GangDrained,
    GangHealed,
    GangJoined,
    HangDetected,
    HealFailed,
    RankDied,
    TotalLoss,
)
from raytrec.elastic.faults import FaultKind, FaultSpec
from raytrec.models import build_dlrm
from raytrec.observability.metrics import IntervalMetrics
from raytrec.testing import (
    NodeDrainer,
    committed_row_ids,
    running_coordinator,
    simulated_cluster,
)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # Shared by the tests below (each job releases its placement groups); they keep its shape.
    with simulated_cluster(1, cpus_per_node=2) as c:  # two gangs of one rank
        yield c


def small_job(tmp_path: str, **kw: object) -> TrainConfig:
    base: dict[str, object] = {
        "model": ModelConfig(tables=criteo_tables(num_features=4, num_embeddings=200)),
        "scaling": ScalingConfig(num_workers=2, gang_size=1),
        "sync": SyncConfig(sync_every=2),
        "data": DataConfig(batch_size=32),
        "storage_path": str(tmp_path),
    }
    base.update(kw)
    return TrainConfig(**base)  # type: ignore[arg-type]


def test_every_rank_hung_is_found_by_the_heartbeat_rule(cluster: Cluster, tmp_path: str) -> None:
    elastic = ElasticConfig(step_timeout_s=8, collective_timeout_s=4, poll_s=0.5)
    config = small_job(
        tmp_path,
        elastic=elastic,
        checkpoint=CheckpointConfig(every_n_steps=10, num_to_keep=1),
        testing=TestingConfig(
            faults=(
                FaultSpec(kind=FaultKind.HANG_RANK, step=16, gang=0),
                FaultSpec(kind=FaultKind.HANG_RANK, step=16, gang=1),
            )
        ),
        num_steps=30,
        log_every=10,
    )
    result = fit(config, shutdown_ray=False)

    (hang,) = result.events.of(HangDetected)
    assert sorted(hang.job_ranks) == [0, 1]
    # Measured from the heartbeats: the ranks finished step 15 and nothing after it.
    assert hang.last_step == 15, hang
    bound = elastic.step_timeout_s + elastic.poll_s + 5
    assert elastic.step_timeout_s < hang.silent_s <= bound, hang
    (total,) = result.events.of(TotalLoss)
    (restored,) = result.events.of(CheckpointRestored)
    assert restored.saved_step == 10 and total.at >= hang.at
    assert result.steps == 30
    assert_replicas_agree(result)
    assert_every_batch_once(result)


def test_a_heal_that_does_not_match_its_peer_is_dropped_and_placed_again(
    cluster: Cluster, tmp_path: str
) -> None:
    config = small_job(
        tmp_path,
        # Training waits for the replacement, so both joins happen before the end (its
        # placement, after the failed heal's gang is ended, once took over 120 s under CI).
        elastic=ElasticConfig(
            min_gangs=2,
            step_timeout_s=30,
            collective_timeout_s=10,
            resource_wait_s=240,
            poll_s=0.2,
        ),
        testing=TestingConfig(
            faults=(
                FaultSpec(kind=FaultKind.KILL_RANK, step=5, rank=1),
                # Gang 2 is the first replacement: its copy of the peer's state is corrupted.
                FaultSpec(kind=FaultKind.CORRUPT_HEAL, step=0, gang=2),
            )
        ),
        num_steps=16,
        log_every=2,
    )
    result = fit(config, shutdown_ray=False)

    (failed,) = result.events.of(HealFailed)
    assert (failed.gang_id, failed.peer_gang_id, failed.job_ranks) == (2, 0, (2,))
    healed = [e.gang_id for e in result.events.of(GangHealed)]
    joined = [e.gang_id for e in result.events.of(GangJoined)]
    assert healed == joined == [3], result.events
    assert result.steps == 16 and result.history[-1].gangs == 2
    assert_replicas_agree(result)
    assert_every_batch_once(result)


# -- the rendezvous store, on the module's cluster (before the tests with clusters of their own)


def listeners() -> list[tuple[str, str]]:
    """(address, process name) of every listening TCP socket on this machine (``ss -ltnp``).
    The kernel keeps a process's first 15 characters: ``ray::Coordinato``, ``ray::RankWorker``."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        local = line.split()[3]
        for name in re.findall(r'\("([^"]+)",pid=', line):
            found.append((local, name))
    return found


def test_the_rendezvous_listens_on_loopback_and_hides_the_jobs_keys(
    cluster: Cluster, tmp_path: str
) -> None:
    seen: dict[str, Any] = {}

    def look(row: IntervalMetrics) -> None:
        if row.step < 4 or seen:
            return
        address = ray.get(running_coordinator().store_address.remote())
        seen["address"] = address
        seen["listeners"] = listeners()
        outsider = torch.distributed.TCPStore(
            address.host, address.port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
        # The job's heartbeat keys exist under its secret, and under no name an outsider knows.
        seen["inside"] = outsider.check([f"{address.secret}/progress/0"])
        seen["outside"] = outsider.check(["progress/0", "gang0/0", "/progress/0"])
        outsider.set("progress/0", "123456")  # lands where the job never reads

    config = small_job(
        tmp_path,
        elastic=ElasticConfig(step_timeout_s=30, collective_timeout_s=10, poll_s=0.2),
        testing=TestingConfig(
            faults=(FaultSpec(kind=FaultKind.SLOW_RANK, step=5, rank=0, stall_s=0.3, steps=4),)
        ),
        num_steps=12,
        log_every=2,
    )
    result = fit(config, on_progress=look, shutdown_ray=False)

    address = seen["address"]
    assert address.host == "127.0.0.1" and len(address.secret) == 32
    assert seen["inside"] and not seen["outside"]
    store = [
        (local, name) for local, name in seen["listeners"] if local.endswith(f":{address.port}")
    ]
    assert store == [(f"127.0.0.1:{address.port}", "ray::Coordinato")], seen["listeners"]
    # Every socket the coordinator and the ranks listen on is on the loopback address.
    mine = [
        local for local, name in seen["listeners"] if name in ("ray::Coordinato", "ray::RankWorker")
    ]
    assert mine and all(local.startswith(("127.", "[::ffff:127.")) for local in mine), mine
    assert result.steps == 12 and not result.events.of(RankDied)


# -- a drain on request, rows recorded by the ranks themselves ------------------------------

# The model factory below travels to the rank actors by value (they cannot import this file).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROW_SCALE = 1e-3  # dense_0 carries row_id * ROW_SCALE: small enough not to upset training


class RecordingModel(nn.Module):
    """The job's model, writing the row id of every row it trains on to a file per process."""

    def __init__(self, inner: nn.Module, out_dir: str) -> None:
        super().__init__()
        self.inner = inner
        self.out_dir = out_dir

    def forward(self, batch: Any) -> Any:
        rows = torch.round(batch.dense_features[:, 0].detach().float() / ROW_SCALE).long()
        with open(os.path.join(self.out_dir, f"rows-{os.getpid()}.txt"), "a") as f:
            f.write(" ".join(map(str, rows.tolist())) + "\n")
        return self.inner(batch)


def recording_factory(out_dir: str) -> Any:
    def factory(cfg: ModelConfig, num_dense: int, device: torch.device, seed: int) -> nn.Module:
        return RecordingModel(build_dlrm(cfg, num_dense, device, seed), out_dir)

    return factory


def test_a_gang_drained_mid_epoch_gives_back_its_rows_and_none_is_lost_or_doubled(
    local_ray: None, tmp_path: str
) -> None:
    # On the shared cluster (one node: 2 ranks at 1 CPU, the rest for Ray Data).
    rows = 2 * 12 * 32  # 2 ranks x 12 batches of 32 rows
    data_dir = f"{tmp_path}/data"
    paths = write_synthetic_parquet(
        data_dir, rows=rows, files=2, row_groups_per_file=2, num_embeddings=200
    ).paths
    for path in paths:  # dense_0 := the row's id, so the model can say which rows it trained
        table = pq.read_table(path)
        scaled = (table["row_id"].to_numpy() * ROW_SCALE).astype(np.float32)
        index = table.schema.get_field_index("dense_0")
        pq.write_table(table.set_column(index, "dense_0", pa.array(scaled)), path)
    seen_dir = f"{tmp_path}/seen"
    os.makedirs(seen_dir)
    config = small_job(
        tmp_path / "runs",
        data=DataConfig(batch_size=32, source="parquet", path=data_dir),
        elastic=ElasticConfig(step_timeout_s=30, collective_timeout_s=10, poll_s=0.2),
        # Slow steps, so the request (made by the driver once it sees step 4) lands mid-epoch.
        testing=TestingConfig(
            faults=(FaultSpec(kind=FaultKind.SLOW_RANK, step=5, rank=0, stall_s=0.5, steps=8),)
        ),
        num_steps=12,
        log_every=2,
    )
    requested: list[str] = []

    def drain_at_step_4(row: IntervalMetrics) -> None:
        if row.step >= 4 and not requested:
            (run_dir,) = glob.glob(f"{tmp_path}/runs/*")
            requested.append(raytrec.drain(run_dir, gangs=1))

    result = fit(
        config,
        on_progress=drain_at_step_4,
        model_factory=recording_factory(seen_dir),
        shutdown_ray=False,
    )

    (drained,) = result.events.of(GangDrained)
    assert drained.gang_id == 1 and 4 <= drained.step < 12, drained
    assert not [e for e in result.events if e.kind in ("rank_died", "gang_dropped")]
    assert result.history[-1].gangs == 1
    # No gang came back: the request lowered max_gangs to 1.
    assert not result.events.of(GangJoined)
    trained: list[int] = []
    for path in glob.glob(f"{seen_dir}/rows-*.txt"):
        with open(path) as f:
            trained += [int(x) for x in f.read().split()]
    assert sorted(trained) == list(range(rows))  # every row once, as the ranks saw it
    assert sorted(committed_row_ids(result, paths).tolist()) == list(range(rows))  # the ledger
    assert result.ledger()["rows"]["trained"] == rows  # its rows figure, after a loss too
    assert result.lost_batches == 0 and result.steps > 12  # the survivor took the rows left


@pytest.fixture
def two_nodes() -> Iterator[Cluster]:
    with simulated_cluster(2, cpus_per_node=1) as c:  # one gang of one rank per node
        yield c


def test_a_node_marked_for_removal_gives_its_gang_back(two_nodes: Cluster, tmp_path: str) -> None:
    config = small_job(
        tmp_path,
        elastic=ElasticConfig(step_timeout_s=30, collective_timeout_s=10, poll_s=0.2),
        checkpoint=CheckpointConfig(every_n_steps=4, num_to_keep=1),
        # Slow steps, so the drain (marked by the driver once it sees step 4) lands mid-run;
        # then the coordinator's process is SIGKILLed.
        testing=TestingConfig(
            faults=(
                FaultSpec(kind=FaultKind.SLOW_RANK, step=5, rank=0, stall_s=0.5, steps=8),
                FaultSpec(kind=FaultKind.KILL_COORDINATOR, step=12),
            )
        ),
        num_steps=16,
        log_every=2,
    )
    drainer = NodeDrainer(at_step=4, job_rank=1)
    result = fit(config, on_progress=drainer, shutdown_ray=False)

    assert drainer.drained is not None
    (drained,) = result.events.of(GangDrained)
    assert drained.gang_id == 1 and "nodes marked for removal" in drained.reason
    assert not [e for e in result.events if e.kind in ("rank_died", "gang_dropped")]
    assert result.steps == 16 and result.history[-1].gangs == 1
    # The new coordinator resumed on the one gang that fits, without waiting for placement.
    (restarted,) = result.events.of(CoordinatorRestarted)
    assert restarted.checkpoint_step == 8, restarted
    assert "placement_waiting" not in result.events.kinds()
    assert {m.gangs for m in result.history if m.at > restarted.at} == {1}
    assert_replicas_agree(result)
    assert_every_batch_once(result)
