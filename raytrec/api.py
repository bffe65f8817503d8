"""The Python API: build a :class:`~raytrec.config.TrainConfig`, call :func:`fit`.

``fit`` validates everything it can on the driver (config, features against
tables, the sharding plan, cluster capacity) before any rank actor starts,
then hands the job to a coordinator actor and streams its progress.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

from raytrec._quiet import quiet_known_warnings
from raytrec.cluster import connect, total_resources
from raytrec.config import ConfigError, TrainConfig, validate_features
from raytrec.data.from_config import DataInfo, source_from_config, synthetic_source
from raytrec.data.source import BatchSource
from raytrec.engine.plan import apply_embedding_optimizer, make_plan
from raytrec.metrics import IntervalMetrics
from raytrec.model import ModelFactory, build_dlrm
from raytrec.placement import rank_resources

__all__ = ["Result", "TrainingStopped", "default_source", "fit"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result:
    """What a finished job returns."""

    config: TrainConfig
    history: list[IntervalMetrics]  # one row per log_every steps
    final_state_path: str | None  # the final model, a torch.distributed.checkpoint directory
    run_dir: str
    steps: int
    wall_s: float
    # job rank -> content hashes of its final shard and dense state (equal within a replica group)
    state_digests: dict[int, dict[str, str]]
    data: DataInfo = dataclasses.field(default_factory=lambda: DataInfo(kind="custom"))
    first_batch_s: float = 0.0  # from the start of training until every rank held its batches

    @property
    def final_loss(self) -> float:
        return self.history[-1].loss

    @property
    def final_auc(self) -> float | None:
        """The last interval's AUC (progressive validation: on rows before training on them)."""
        return self.history[-1].auc if self.history else None

    @property
    def oracle_auc(self) -> float | None:
        """The AUC of the data's own click probabilities (generated data only): the ceiling."""
        return self.data.oracle_auc

    def metrics_dataframe(self) -> Any:
        import pandas as pd

        return pd.DataFrame([m.to_dict() for m in self.history])


class TrainingStopped(RuntimeError):
    """Training stopped before ``num_steps`` (bad input, or a rank's data ran out).

    The job stopped between two steps: the model trained up to :attr:`result`'s ``steps`` was
    synced, checked and saved (``result.final_state_path``), and its metrics were written.
    ``cause`` is the rank's own exception (a :class:`~raytrec.data.arrow_kjt.BadInputError`
    names the file, column and row).
    """

    def __init__(self, cause: BaseException, result: Result) -> None:
        super().__init__(
            f"{cause}\ntraining stopped after step {result.steps} of "
            f"{result.config.num_steps}; the model trained so far is saved at "
            f"{result.final_state_path}"
        )
        self.cause = cause
        self.result = result


default_source = synthetic_source  # the source of data.source="synthetic"


def check_capacity(config: TrainConfig, resources: dict[str, float]) -> None:
    """Fails when the cluster can never hold every rank at once."""
    per_rank = rank_resources(
        cpus_per_rank=config.scaling.cpus_per_rank, use_gpu=config.scaling.use_gpu
    )
    world = config.scaling.world_size
    for name, amount in per_rank.items():
        need, have = amount * world, resources.get(name, 0.0)
        if need > have:
            raise ConfigError(
                f"scaling: {world} workers ({config.scaling.num_gangs} gangs x "
                f"{config.scaling.gang_size} ranks) need {need:g} {name} in all but the cluster "
                f"has {have:g}; allowed: scaling.num_workers x per-rank {name} <= {have:g}"
            )


def fit(
    config: TrainConfig,
    *,
    source: BatchSource | None = None,
    model_factory: ModelFactory = build_dlrm,
    ray_address: str | None = None,
    on_progress: Callable[[IntervalMetrics], None] | None = None,
    shutdown_ray: bool | None = None,
) -> Result:
    """Trains ``config`` on Ray and returns the metrics history and the final state.

    ``source`` overrides ``config.data.source``. Raises :class:`TrainingStopped` when bad input
    or the end of the data stops training early (what was trained is saved first).
    """
    info = DataInfo(kind="custom")
    if source is None:
        source, info = source_from_config(config)
    validate_features(config.model, source.sparse_features)
    plan = _plan(config, source.dense_features, model_factory)

    run_dir = os.path.abspath(
        os.path.join(config.storage_path, f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    )
    os.makedirs(run_dir, exist_ok=True)
    # Ranks hold their CPUs for the whole job; Ray Data's read and preprocessing
    # tasks need CPUs of their own, or the embedded cluster deadlocks.
    data_cpus = os.cpu_count() or 2
    need_cpus = config.scaling.world_size * config.scaling.cpus_per_rank + data_cpus
    started = connect(ray_address, num_cpus=need_cpus)
    try:
        check_capacity(config, total_resources())
        from actors.coordinator import Coordinator

        coordinator_cls = ray.remote(num_cpus=0, max_concurrency=4)(Coordinator)
        coordinator = coordinator_cls.remote(
            config,
            plan,
            source.split(config.scaling.world_size),
            source.dense_features,
            run_dir,
            model_factory,
        )
        try:
            summary = _drive(coordinator, on_progress or _print_progress(config))
        finally:
            # The coordinator may already be gone; it is killed below regardless.
            with contextlib.suppress(Exception):
                ray.get(coordinator.shutdown.remote(), timeout=60)
            ray.kill(coordinator)
    finally:
        if shutdown_ray if shutdown_ray is not None else started:
            ray.shutdown()
    result = Result(
        config=config,
        history=summary.history,
        final_state_path=summary.final_state_path,
        run_dir=run_dir,
        steps=summary.steps,
        wall_s=summary.wall_s,
        state_digests=summary.digests,
        data=info,
        first_batch_s=summary.first_batch_s,
    )
    with open(os.path.join(run_dir, "metrics.json"), "w") as f:
        json.dump([m.to_dict() for m in result.history], f, indent=1)
    if summary.stopped_by is not None:
        raise TrainingStopped(summary.stopped_by, result) from summary.stopped_by
    return result


def _plan(config: TrainConfig, num_dense: int, model_factory: ModelFactory) -> Any:
    quiet_known_warnings()
    model = model_factory(config.model, num_dense, torch.device("cpu"), config.seed)
    apply_embedding_optimizer(model, config.optimizer)
    return make_plan(
        model,
        gang_size=config.scaling.gang_size,
        device_type="cuda" if config.scaling.use_gpu else "cpu",
        sharding=config.sharding,
        table_names=[t.name for t in config.model.tables],
        batch_size=config.data.batch_size,
    )


def _drive(coordinator: Any, on_progress: Callable[[IntervalMetrics], None]) -> Any:
    run_ref = coordinator.run.remote()
    seen = 0
    while True:
        done, _ = ray.wait([run_ref], timeout=1.0)
        rows = ray.get(coordinator.progress.remote(seen))
        for row in rows:
            on_progress(row)
        seen += len(rows)
        if done:
            return ray.get(run_ref)


def _print_progress(config: TrainConfig) -> Callable[[IntervalMetrics], None]:
    def show(m: IntervalMetrics) -> None:
        auc = "  n/a " if m.auc is None else f"{m.auc:.4f}"
        print(
            f"[raytrec] step {m.step:>6}/{config.num_steps} | loss {m.loss:.4f} | auc {auc} | "
            f"{m.samples_per_s:>9,.0f} samples/s | gen {m.generation} | gangs {m.gangs} | "
            f"data wait {100 * m.data_wait_fraction:.1f}% | {m.elapsed_s:.1f}s",
            file=sys.stdout,
            flush=True,
        )

    return show
