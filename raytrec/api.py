"""The Python API: build a :class:`~raytrec.config.TrainConfig`, call :func:`fit`.

``fit`` validates everything it can on the driver (config, features against
tables, the sharding plan, cluster capacity) before any rank actor starts,
then hands the job to a coordinator actor and passes on its progress as it comes.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import ray
import ray.train
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrec._quiet import quiet_known_warnings
from raytrec.cluster import (
    COORDINATOR_PREFIX,
    autoscaler_hides_node_types,
    cluster_shapes,
    connect,
    pin_ray_data_helpers,
    resolve_storage_path,
)
from raytrec.config import ConfigError, TrainConfig, validate_features
from raytrec.data.fingerprint import data_fingerprint
from raytrec.data.from_config import (
    DataInfo,
    held_out,
    source_from_config,
    synthetic_source,
)
from raytrec.data.length import data_steps, resolve_num_steps
from raytrec.data.parquet import ParquetSource
from raytrec.data.source import BatchSource
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.driver import (
    CoordinatorDied,
    Seen,
    StopOnSignal,
    close_failed,
    interrupted,
    job_failure,
    release_placement_groups,
    summary_after,
)
from raytrec.engine.plan import job_plan
from raytrec.errors import EarlyStopped, StopRequested
from raytrec.models import ModelFactory, build_train_model
from raytrec.observability.metrics import IntervalMetrics
from raytrec.observability.progress import ProgressReporter
from raytrec.observability.run_logs import RunLogs
from raytrec.observability.summary import ledger_lines, write_ledger
from raytrec.preflight import (
    CapacityUnknownWarning,
    check_capacity,
    check_checkpoint,
    check_eval_is_there,
    check_gpus_here,
    check_length_known,
    check_same_data,
    device_memory,
    growing_config,
    indexed_resume_shards,
    vocabularies_of,
)
from raytrec.restarts import CoordinatorSeat
from raytrec.result import KeptCheckpoint, Result, TrainingStopped, result_of

__all__ = [
    "CapacityUnknownWarning",
    "CoordinatorDied",
    "KeptCheckpoint",
    "Result",
    "TrainingStopped",
    "default_source",
    "fit",
]


default_source = synthetic_source  # the source of data.source="synthetic"


def fit(
    config: TrainConfig,
    *,
    source: BatchSource | None = None,
    model_factory: ModelFactory = build_train_model,
    ray_address: str | None = None,
    on_progress: Callable[[IntervalMetrics], None] | None = None,
    shutdown_ray: bool | None = None,
    resume_from_checkpoint: str | ray.train.Checkpoint | None = None,
    eval_source: str | None = None,
    verbose: bool = False,
    init_from: str | ray.train.Checkpoint | None = None,
) -> Result:
    """Trains ``config`` on Ray and returns the metrics history and the final state.

    ``source`` overrides ``config.data.source``. ``resume_from_checkpoint`` (a checkpoint
    directory or URI, or a ``ray.train.Checkpoint`` such as ``Result.checkpoint``) starts from a
    saved job, which may have had another number of gangs, gang size or sharding plan, and
    continues its data position (refused when the data's files changed). ``init_from`` (the
    same kinds of checkpoint) starts a new run from a saved job's model only (weights and
    optimizer state, on any shape) on this config's data, at step 0 with a ledger of its own.
    ``eval_source`` (held-out Parquet in the training data's schema) sets ``config.eval.path``:
    the model is evaluated on it every ``config.eval.every_n_steps`` and at the end. Raises
    :class:`TrainingStopped` when bad input or the end of the data stops training early (what
    was trained is saved first). ``config.num_steps=None`` trains every batch of
    ``config.data.epochs`` passes over Parquet data; ``Result.config.num_steps`` holds the steps
    that came to.

    The console shows raytrec's progress, events, summary and errors; Ray's own log records and
    what the ranks and Ray Data's tasks print go to ``logs/`` in the run directory
    (:mod:`raytrec.observability.run_logs`), and also to the console with ``verbose=True``. Like
    ``on_progress``, this is about where the run is watched from, not what it trains, so it is
    an argument here rather than a key of ``config``.
    """
    with RunLogs(verbose=verbose) as logs, StopOnSignal() as stop:
        return _fit(
            config,
            source=source,
            model_factory=model_factory,
            ray_address=ray_address,
            on_progress=on_progress,
            shutdown_ray=shutdown_ray,
            resume_from_checkpoint=resume_from_checkpoint,
            init_from=init_from,
            eval_source=eval_source,
            logs=logs,
            stop=stop,
        )


def _fit(
    config: TrainConfig,
    *,
    source: BatchSource | None,
    model_factory: ModelFactory,
    ray_address: str | None,
    on_progress: Callable[[IntervalMetrics], None] | None,
    shutdown_ray: bool | None,
    resume_from_checkpoint: str | ray.train.Checkpoint | None,
    init_from: str | ray.train.Checkpoint | None,
    eval_source: str | None,
    logs: RunLogs,
    stop: StopOnSignal,
) -> Result:
    quiet_known_warnings()
    resume, init = _path_of(resume_from_checkpoint), _path_of(init_from)
    if resume is not None and init is not None:
        raise ConfigError("resume_from_checkpoint and init_from exclude each other: pass one")
    for checkpoint in (resume, init):
        if checkpoint is not None:
            check_checkpoint(checkpoint, config)
    config = config.replace(storage_path=resolve_storage_path(config.storage_path))
    if config.data.growing is not None:
        config = growing_config(config)
    if eval_source is not None:
        config = config.replace(eval=config.eval.replace(path=eval_source))
    check_eval_is_there(config)
    if source is not None:  # a source of the caller's: checked before Ray is touched
        validate_features(config.model, source.sparse_features)
    check_length_known(config, source)
    check_gpus_here(config, ray_address)
    # Ranks hold their CPUs for the whole job; Ray Data's read and preprocessing
    # tasks need CPUs of their own, or the embedded cluster deadlocks.
    data_cpus = os.cpu_count() or 2
    need_cpus = config.scaling.world_size * config.scaling.cpus_per_rank + data_cpus
    connected_before = ray.is_initialized()
    try:
        started = connect(ray_address, num_cpus=need_cpus)
    except BaseException as e:
        if not connected_before:
            with contextlib.suppress(Exception):
                ray.shutdown()  # stopped while Ray started: what it started is shut down whole
        if isinstance(e, SystemExit):
            # ray.init puts in a SIGTERM handler of its own, which exits (sys.exit) at once.
            raise StopRequested("stopped on request (signal 15) before training started") from None
        raise
    finally:
        stop.restore()  # our handler again, in place of Ray's
    logs.connected()
    try:
        # Before any data is generated or any actor started: a job the cluster can never hold.
        ray_data = (
            isinstance(source, ParquetSource)
            if source is not None
            else config.data.source in ("parquet", "generated")
        )
        check_capacity(
            config,
            cluster_shapes(),
            ray_data=ray_data,
            unpublished_node_types=autoscaler_hides_node_types(),
        )
        if ray_data or config.eval.path is not None:  # the ranks will run Ray Data pipelines
            pin_ray_data_helpers()
        info = DataInfo(kind="custom")
        if source is None:
            source, info = source_from_config(config, vocabularies_of(resume or init))
            validate_features(config.model, source.sparse_features)
            if config.eval.path is None and info.held_out_path is not None:
                # Generated data's held-out split is what the job evaluates on.
                config = config.replace(eval=config.eval.replace(path=info.held_out_path))
        shards_of_plan = config.scaling.world_size
        fingerprint = data_fingerprint(source)
        if resume is not None:
            check_same_data(resume, fingerprint, growing=config.data.growing is not None)
            shards_of_plan = indexed_resume_shards(resume, config, source) or shards_of_plan
        shards = source.split(shards_of_plan)
        # Resolved once, here: the coordinator, the progress bar and the ledger read this.
        num_steps = resolve_num_steps(
            config.num_steps,
            data_steps(shards, config.data.batch_size),
            source=type(source).__name__,
        )
        config = config.replace(num_steps=num_steps)
        plan = _plan(config, source.dense_features, model_factory)
        # The row layout the model is trained on (vocabularies included): the held-out rows
        # are read in it, and every checkpoint and final model records it.
        features = source.spec if isinstance(source, ParquetSource) else None
        evaluation = None
        if config.eval.path is not None:
            from raytrec.serving.model_spec import ModelSpec

            layout = features or ModelSpec.for_config(config, source.dense_features).features
            evaluation = held_out(config, layout)

        run_dir = os.path.abspath(
            os.path.join(config.storage_path, f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        )
        os.makedirs(run_dir, exist_ok=True)
        logs.open(run_dir)
        reporter = on_progress or ProgressReporter(num_steps, title=config.name)
        if isinstance(reporter, ProgressReporter) and reporter.total_steps is None:
            reporter.total_steps = num_steps  # a reporter made before the length was known
        if isinstance(reporter, ProgressReporter) and reporter.run_dir is None:
            reporter.start(run_dir)
        from actors.coordinator import Coordinator

        # On the driver's node: a lost worker node must not take the coordinator with it.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        coordinator_cls = ray.remote(num_cpus=0, max_concurrency=4)(Coordinator)
        name = f"{COORDINATOR_PREFIX}{os.path.basename(run_dir)}-{os.getpid()}"
        # Every coordinator counts its times from here, on this node's monotonic clock (it runs
        # here): the driver books a coordinator's loss on the same clock (raytrec.restarts).
        origin = time.monotonic()

        def start_coordinator(resume_from: str | None, attempt: int) -> Any:
            """Coordinator ``attempt`` of the run (0: the first; later ones take over from a
            lost one, resuming from ``resume_from``)."""
            splits = shards
            if resume_from is not None and resume_from != resume:
                splits = source.split(
                    indexed_resume_shards(resume_from, config, source) or shards_of_plan
                )
            actor_name = name if attempt == 0 else f"{name}-{attempt}"
            return coordinator_cls.options(scheduling_strategy=here, name=actor_name).remote(
                config,
                plan,
                splits,
                source.dense_features,
                run_dir,
                model_factory,
                new_shard=source.shard if isinstance(source, SyntheticCriteo) else None,
                resume_from=resume_from,
                evaluation=evaluation,
                features=features,
                # A restart that resumes from this run's own checkpoint has its model already.
                init_from=init if resume_from is None else None,
                data_fingerprint=fingerprint,
                clock_origin=origin,
            )

        seen = Seen(reporter, reporter.event if isinstance(reporter, ProgressReporter) else None)
        # A coordinator that died could not release the job's placement groups, and Ray keeps
        # them for as long as this driver lives: they are released by their names.
        seat = CoordinatorSeat(
            start_coordinator,
            run_dir=run_dir,
            max_restarts=config.elastic.max_coordinator_restarts,
            resume_from=resume,
            on_row=seen.row,
            on_event=seen.event,
            release=lambda: release_placement_groups(os.path.basename(run_dir)),
            origin=origin,
        )
        failure: BaseException | None = None
        try:
            summary = seat.merged(seat.drive(stop), seen.rows, seen.events)
        except BaseException as e:
            # Whatever ended the job, its ledger is written: what it committed, why it ended,
            # and the checkpoint to resume from (asked of the coordinator while it lives, else
            # read from the run's journal).
            failure = job_failure(e)
            wait_s = 5 if interrupted(e) else 60
            summary = summary_after(seat.current, seen, wait_s=wait_s, run_dir=run_dir)
            summary = seat.merged(summary, seen.rows, seen.events)
        finally:
            # The coordinator may already be gone; it is killed below regardless.
            with contextlib.suppress(Exception):
                ray.get(seat.current.shutdown.remote(), timeout=60)
            seat.retire()
    finally:
        if shutdown_ray if shutdown_ray is not None else started:
            ray.shutdown()
    if failure is not None:
        result = result_of(config, summary, run_dir, info)
        close_failed(result, failure, reporter, own_reporter=on_progress is None)
        raise failure
    result = result_of(config, summary, run_dir, info)
    with open(os.path.join(run_dir, "metrics.json"), "w") as f:
        json.dump([m.to_dict() for m in result.history], f, indent=1)
    if on_progress is None and isinstance(reporter, ProgressReporter):
        reporter.close(events=result.events)  # metrics file, TensorBoard and the plot
    stopped = None if isinstance(summary.stopped_by, EarlyStopped) else summary.stopped_by
    # The run's ledger: summary.json, and its closing lines on the default console.
    ledger = result.ledger(
        stopped=None if stopped is None else f"{type(stopped).__name__}: {stopped}"
    )
    write_ledger(ledger)
    if isinstance(reporter, ProgressReporter):
        for line in ledger_lines(ledger):
            print(line, flush=True)
    if stopped is not None:
        raise TrainingStopped(stopped, result) from stopped
    return result


def _path_of(checkpoint: str | ray.train.Checkpoint | None) -> str | None:
    return checkpoint.path if isinstance(checkpoint, ray.train.Checkpoint) else checkpoint


def _plan(config: TrainConfig, num_dense: int, model_factory: ModelFactory) -> Any:
    return job_plan(config, num_dense, model_factory, device_memory=device_memory(config))
