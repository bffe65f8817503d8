"""The planner's device-memory budget when the driver has no GPU (``ray job submit`` from a CPU
head node): ``fit()`` plans within what a one-GPU Ray task reports from a GPU node of the
cluster, and a cluster where no GPU answers is refused, naming the setting that needs no probe.

This machine has no GPU, so the node's GPU is declared to Ray and the probe's reading of
``torch.cuda`` is replaced by a fixed answer; what is checked is the probe's way to a GPU node
and back, and the refusal.
"""

from __future__ import annotations

import pytest
import torch

from raytrec import preflight
from raytrec.config import ConfigError, DataConfig, ScalingConfig, TrainConfig
from raytrec.testing import simulated_cluster

pytestmark = pytest.mark.cluster


def test_a_gpu_node_reports_the_budget_and_a_cluster_without_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gib = 2**30

    def h100_memory() -> int:  # what torch.cuda says on the GPU node
        return 80 * gib

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the driver has no GPU
    monkeypatch.setattr(preflight, "_gpu_memory", h100_memory)
    monkeypatch.setattr(preflight, "_DEVICE_MEMORY_WAIT_S", 3.0)
    config = TrainConfig(
        data=DataConfig(source="parquet", path="/nowhere", num_dense=3, batch_size=8),
        scaling=ScalingConfig(use_gpu=True),
    )
    with simulated_cluster(1, cpus_per_node=1) as cluster:
        with pytest.raises(
            ConfigError,
            match=r"no GPU of the cluster said how much memory it has within 3 s; set "
            r"sharding.device_memory_gib",
        ):
            preflight.device_memory(config)
        cluster.add_node(num_cpus=0, num_gpus=1, node_ip_address="127.0.0.1")
        assert preflight.device_memory(config) == 80 * gib
