"""The coordinator: places gangs, hosts the rendezvous store and drives training.

A plain class, made a Ray actor only at the launch site
(:func:`raytrec.api.fit`). It hosts the job's ``TCPStore`` (every gang world
and replica plane rendezvous under their own prefix in it), creates one
placement group per gang (:mod:`raytrec.placement`), starts one
:class:`~actors.rank.RankWorker` per rank and runs training in intervals of
``log_every`` steps, recording one metrics row per interval.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from datetime import timedelta
from typing import Any

import ray
import ray.exceptions
import torch.distributed as dist
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torchrec.distributed.types import ShardingPlan

from actors.rank import RankWorker
from raytrec.config import TrainConfig
from raytrec.data.source import BatchShard
from raytrec.engine.rank import RankSpec, StoreAddress
from raytrec.metrics import IntervalMetrics, aggregate_interval
from raytrec.model import ModelFactory, build_dlrm
from raytrec.placement import placement_specs, rank_resources
from raytrec.rec_metrics import merge_metric_states
from raytrec.sync.schedule import SyncPlan, gang_locality, plan_sync

__all__ = ["Coordinator", "RunSummary"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSummary:
    history: list[IntervalMetrics]
    final_state_path: str | None
    steps: int
    wall_s: float
    ranks: list[dict[str, Any]]
    digests: dict[int, dict[str, str]]  # job rank -> content hashes of its final state
    # Why training stopped before num_steps (bad input, data ran out), else None. The state
    # trained up to ``steps`` is still synced, checked and saved.
    stopped_by: BaseException | None = None
    first_batch_s: float = 0.0  # until every rank held its first interval's batches


def intervals(num_steps: int, every: int) -> list[int]:
    """Splits ``num_steps`` into reporting intervals of ``every`` steps (the last may be short)."""
    full, rest = divmod(num_steps, every)
    return [every] * full + ([rest] if rest else [])


class Coordinator:
    """Owns the job's membership, store and training loop."""

    def __init__(
        self,
        config: TrainConfig,
        plan: ShardingPlan,
        shards: list[BatchShard],
        num_dense: int,
        run_dir: str,
        model_factory: ModelFactory = build_dlrm,
        placement_timeout_s: float = 300.0,
        step_timeout_s: float = 600.0,
    ) -> None:
        self.cfg = config
        self.plan = plan
        self.shards = shards
        self.num_dense = num_dense
        self.run_dir = run_dir
        self.model_factory = model_factory
        self.placement_timeout_s = placement_timeout_s
        self.step_timeout_s = step_timeout_s
        self.topology = config.scaling.topology()
        self.generation = 0
        self._history: list[IntervalMetrics] = []
        self._lock = threading.Lock()
        self._pgs: list[PlacementGroup] = []
        self._workers: dict[int, Any] = {}  # job rank -> actor handle
        self._store: dist.TCPStore | None = None
        self.first_batch_s = 0.0

    # -- queries (answered while run() is in progress) ----------------------

    def progress(self, since: int = 0) -> list[IntervalMetrics]:
        with self._lock:
            return list(self._history[since:])

    def workers(self) -> dict[int, Any]:
        return dict(self._workers)

    # -- the job --------------------------------------------------------------

    def start(self) -> list[dict[str, Any]]:
        """Hosts the store, places every gang, starts and builds the rank actors."""
        host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
        )
        store = StoreAddress(host=host, port=self._store.port)
        scaling = self.cfg.scaling
        per_rank = rank_resources(cpus_per_rank=scaling.cpus_per_rank, use_gpu=scaling.use_gpu)
        specs = placement_specs(self.topology, per_rank=per_rank)
        self._pgs = [
            placement_group(list(s.bundles), strategy=s.strategy, name=f"{self.cfg.name}-{s.name}")
            for s in specs
        ]
        ready = [pg.ready() for pg in self._pgs]
        done, _ = ray.wait(ready, num_returns=len(ready), timeout=self.placement_timeout_s)
        if len(done) < len(ready):
            raise TimeoutError(
                f"placed {len(done)} of {len(ready)} gang placement groups within "
                f"{self.placement_timeout_s:.0f}s; the cluster lacks {per_rank} x "
                f"{self.topology.world_size} ranks"
            )
        worker_cls = ray.remote(RankWorker)
        for spec, pg in zip(specs, self._pgs, strict=True):
            for bundle, ranks in enumerate(spec.ranks):
                for r in ranks:
                    pos = self.topology.position(r)
                    rank_spec = RankSpec(
                        rank=r,
                        gang=pos.gang,
                        gang_rank=pos.gang_rank,
                        gang_size=self.topology.gang_size,
                        config=self.cfg,
                        plan=self.plan,
                        num_dense=self.num_dense,
                        store=store,
                        model_factory=self.model_factory,
                        timeout_s=self.step_timeout_s,
                    )
                    self._workers[r] = worker_cls.options(
                        name=None,
                        num_cpus=scaling.cpus_per_rank,
                        num_gpus=1 if scaling.use_gpu else 0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=pg, placement_group_bundle_index=bundle
                        ),
                    ).remote(rank_spec, self.shards[r])
        ranks_info = self._call_all("build")
        # Generation 0: every gang is live; replica member index = gang index.
        self._call_all_by_rank(
            "join_replica_plane",
            lambda r: (self.generation, self.topology.position(r).gang, self.topology.num_gangs),
        )
        self._call_all("join_sync_plan", self._sync_plan())
        # Start every replica from gang 0's initial state.
        self._call_all("broadcast_state", 0)
        return sorted(ranks_info, key=lambda x: x["rank"])

    def run(self) -> RunSummary:
        """Trains ``num_steps`` steps and writes the final model; returns the summary.

        A rank trains an interval only with all of its batches in memory, and it prepares the
        next interval's batches before it reports the current one; so bad input or the end of
        a rank's data surfaces between steps, before any rank enters the next interval's
        collectives. Training stops there, and the model trained so far is synced, checked and
        saved like a finished one (``RunSummary.stopped_by`` says why).
        """
        started = time.perf_counter()
        ranks = self.start()
        step = 0
        stopped_by: BaseException | None = None
        plan = intervals(self.cfg.num_steps, self.cfg.log_every)
        t0 = time.perf_counter()
        try:
            self._call_all("prepare", plan[0], first=True)
        except ray.exceptions.RayTaskError as e:
            stopped_by, plan = _cause(e), []
        self.first_batch_s = time.perf_counter() - t0
        train_start = time.perf_counter()
        for i, n in enumerate(plan):
            t0 = time.perf_counter()
            following = plan[i + 1] if i + 1 < len(plan) else 0
            reports = self._call_all("train", n, following)
            step += n
            metrics = merge_metric_states([r["metrics"] for r in reports])
            row = aggregate_interval(
                reports,
                wall_s=time.perf_counter() - t0,
                generation=self.generation,
                gangs=self.topology.num_gangs,
                elapsed_s=time.perf_counter() - train_start,
                auc=metrics.auc,
                ne=metrics.ne,
            )
            with self._lock:
                self._history.append(row)
            stops = [r["stop"] for r in reports if r["stop"] is not None]
            if stops:
                stopped_by = stops[0]
                break
        if step % self.cfg.sync.sync_every:
            self._call_all("sync")  # end on a sync so every replica holds the same model
        digests = self._final_digests()
        final = os.path.join(self.run_dir, "final_model")
        self._call_gang(0, "save", final)
        return RunSummary(
            history=self.progress(),
            final_state_path=final,
            steps=step,
            wall_s=time.perf_counter() - started,
            ranks=ranks,
            digests=digests,
            stopped_by=stopped_by,
            first_batch_s=self.first_batch_s,
        )

    def _sync_plan(self) -> SyncPlan:
        """The generation's sync schedule over the live gangs, lower levels host-local first."""
        return plan_sync(
            self.cfg.sync,
            generation=self.generation,
            live_gangs=range(self.topology.num_gangs),
            locality=gang_locality(self.topology),
        )

    def _final_digests(self) -> dict[int, dict[str, str]]:
        """Checks that the final sync left every replica of every shard identical."""
        ranks = sorted(self._workers)
        digests = dict(zip(ranks, self._call_all("state_digest"), strict=True))
        for group, members in enumerate(self.topology.replica_groups):
            shard_digests = {digests[r]["shards"] for r in members}
            if len(shard_digests) != 1:
                raise RuntimeError(
                    f"replica group {group} (ranks {list(members)}) disagrees after the final sync"
                )
        if len({d["dense"] for d in digests.values()}) != 1:
            raise RuntimeError("dense parameters differ between ranks after the final step")
        return digests

    def state_arrays(self) -> dict[int, dict[str, Any]]:
        """Every rank's shard, optimizer and dense state (for tests and diagnostics)."""
        ranks = sorted(self._workers)
        got = ray.get([self._workers[r].state_arrays.remote() for r in ranks])
        return dict(zip(ranks, got, strict=True))

    def shutdown(self) -> None:
        for w in self._workers.values():
            ray.kill(w)
        self._workers.clear()
        for pg in self._pgs:
            remove_placement_group(pg)
        self._pgs.clear()

    # -- helpers ----------------------------------------------------------------

    def _call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._call_all_by_rank(method, lambda _r: args, **kwargs)

    def _call_all_by_rank(self, method: str, args_of: Any, **kwargs: Any) -> list[Any]:
        workers = sorted(self._workers.items())
        refs = [getattr(w, method).remote(*args_of(r), **kwargs) for r, w in workers]
        return ray.get(refs, timeout=self.step_timeout_s)

    def _call_gang(self, gang: int, method: str, *args: Any) -> list[Any]:
        refs = [getattr(self._workers[r], method).remote(*args) for r in self.topology.gangs[gang]]
        return ray.get(refs, timeout=self.step_timeout_s)


def _cause(e: ray.exceptions.RayTaskError) -> BaseException:
    """The rank's own exception inside Ray's wrapper (a BadInputError keeps its fields)."""
    from raytrec.data.parquet import _find_bad_input

    bad = _find_bad_input(e)
    if bad is not None:
        return bad
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e
