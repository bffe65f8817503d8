"""A clock model of a data-parallel job with stragglers under a sync schedule.

Each gang keeps a clock. A step advances it by the compute time plus the
longest stall among the gang's ranks (the gang averages dense gradients
every step, so it moves at the pace of its slowest rank). A sync among a
group of gangs is a barrier: every member waits for the member that is
furthest behind since the group's last sync, then all pay the all-reduce
time of the group. The job's time is the latest clock at the end.

Two kinds of sync cost differ, as in seed 002's experiment:

- a synchronous step (a job-wide sync every step, including warmup) is DDP's
  gradient all-reduce, overlapped with backward and already inside the
  measured step time, so it adds ``CostModel.gradient_sync_s`` (0 by default);
- a model average (local or hierarchical SGD) runs after the optimizer step
  and is not overlapped: ring all-reduce time of the model over the group.

Pure numpy; the schedule's decisions come from :class:`~raytrec.sync.SyncPlan`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import numpy.typing as npt

from raytrec.errors import ConfigError
from raytrec.sync.schedule import SyncPlan
from raytrec.sync.stragglers import StragglerSpec

__all__ = ["CostModel", "SimResult", "gang_stalls", "simulate"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """Step time and all-reduce time; defaults describe seed 002's cluster.

    ResNet18 (45 MB of fp32 parameters) on T4 GPUs, 4 per host on PCIe 3.0,
    hosts on 32 Gbit/s Ethernet; about 55 ms per step with DDP. A ring
    all-reduce moves ``2 (n-1)/n`` of the model through the slowest link
    (the host's NIC once a group spans hosts, PCIe inside one host), plus a
    per-hop latency that grows with ``log2`` of the group (NCCL's trees).
    """

    step_s: float = 0.055
    model_bytes: float = 45e6
    network_bytes_per_s: float = 4e9  # 32 Gbit/s Ethernet
    host_bytes_per_s: float = 12e9  # PCIe 3.0 x16, achievable
    workers_per_host: int = 4
    hop_latency_s: float = 50e-6
    gradient_sync_s: float = 0.0  # exposed part of a synchronous step's gradient all-reduce

    def __post_init__(self) -> None:
        for field in ("step_s", "model_bytes", "network_bytes_per_s", "host_bytes_per_s"):
            value = getattr(self, field)
            if not value > 0:
                raise ConfigError(f"cost.{field} must be a positive number, got {value!r}")
        for field in ("hop_latency_s", "gradient_sync_s"):
            value = getattr(self, field)
            if not value >= 0:
                raise ConfigError(f"cost.{field} must be >= 0, got {value!r}")
        if self.workers_per_host < 1:
            raise ConfigError(f"cost.workers_per_host must be >= 1, got {self.workers_per_host}")

    def average_s(self, workers: int) -> float:
        """Seconds to all-reduce the model among ``workers`` consecutive workers."""
        if workers <= 1:
            return 0.0
        hosts = -(-workers // self.workers_per_host)
        if hosts == 1:
            n, bandwidth = workers, self.host_bytes_per_s
        else:
            n, bandwidth = hosts, self.network_bytes_per_s
        moved = 2.0 * (n - 1) / n * self.model_bytes
        return moved / bandwidth + 2.0 * math.ceil(math.log2(workers)) * self.hop_latency_s


def gang_stalls(
    spec: StragglerSpec, *, steps: int, num_gangs: int, gang_size: int
) -> npt.NDArray[np.float64]:
    """``[steps, num_gangs]``: each gang's longest rank stall at steps 1..steps.

    Gang ``g`` holds ranks ``g * gang_size ... (g + 1) * gang_size - 1`` (the
    ``replicas_across_hosts`` layout).
    """
    ranks = np.arange(num_gangs * gang_size)
    out = np.empty((steps, num_gangs))
    for i in range(steps):
        out[i] = spec.stalls(i + 1, ranks).reshape(num_gangs, gang_size).max(axis=1)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimResult:
    seconds: float  # wall time of the job: the latest gang clock after the last step
    syncs_per_level: tuple[int, ...]  # how many steps each level synced at
    sync_seconds: float  # all-reduce time paid, summed over steps (not over groups)


@dataclasses.dataclass(frozen=True)
class _LevelGroups:
    """A level's groups as a permutation of gangs and segment starts, for reduceat."""

    order: npt.NDArray[np.int64]
    starts: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]
    cost: npt.NDArray[np.float64]


def simulate(
    plan: SyncPlan,
    stalls: npt.NDArray[np.float64],
    cost: CostModel,
    *,
    gang_size: int,
) -> SimResult:
    """Runs ``len(stalls)`` steps of ``plan`` over gangs ``0..n-1``.

    ``stalls`` is :func:`gang_stalls`'s ``[steps, gangs]`` array; ``gang_size``
    turns group sizes in gangs into workers for the cost model.
    """
    steps, num_gangs = stalls.shape
    if sorted(plan.live_gangs) != list(range(num_gangs)):
        raise ConfigError(
            f"the plan's live gangs must be 0..{num_gangs - 1} to match the stalls' columns"
        )
    level_groups = []
    for level in plan.levels:
        sizes = np.array([len(g) for g in level.groups], dtype=np.int64)
        level_groups.append(
            _LevelGroups(
                order=np.array([g for group in level.groups for g in group], dtype=np.int64),
                starts=np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64),
                sizes=sizes,
                cost=np.array([cost.average_s(int(n) * gang_size) for n in sizes]),
            )
        )
    clock = np.zeros(num_gangs)
    syncs = [0] * len(plan.levels)
    sync_s = 0.0
    for i in range(steps):
        clock += cost.step_s + stalls[i]
        decision = plan.decide(i + 1)
        if decision.level is None:
            continue
        syncs[decision.level] += 1
        groups = level_groups[decision.level]
        latest = np.maximum.reduceat(clock[groups.order], groups.starts)
        if decision.period == 1 and decision.level == plan.top:
            paid = np.full_like(latest, cost.gradient_sync_s)
        else:
            paid = groups.cost
        clock[groups.order] = np.repeat(latest + paid, groups.sizes)
        sync_s += float(paid.max())
    return SimResult(seconds=float(clock.max()), syncs_per_level=tuple(syncs), sync_seconds=sync_s)
