"""The Python API: build a :class:`~raytrec.config.TrainConfig`, call :func:`fit`.

``fit`` validates everything it can on the driver (config, features against
tables, the sharding plan, cluster capacity) before any rank actor starts,
then hands the job to a coordinator actor and passes on its progress as it comes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ray
import ray.exceptions
import ray.train
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrec._quiet import quiet_known_warnings
from raytrec.checkpoint.config import CheckpointConfig
from raytrec.cluster import (
    COORDINATOR_PREFIX,
    autoscaler_hides_node_types,
    cluster_shapes,
    connect,
    pin_ray_data_helpers,
    resolve_storage_path,
)
from raytrec.cluster.capacity import NodeShape, capacity_refusal
from raytrec.config import ConfigError, TrainConfig, validate_features
from raytrec.data.from_config import (
    DataInfo,
    held_out,
    source_from_config,
    synthetic_source,
)
from raytrec.data.length import data_steps, endless_refusal, resolve_num_steps
from raytrec.data.parquet import ParquetSource
from raytrec.data.source import BatchSource
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.engine.plan import job_plan
from raytrec.errors import EarlyStopped, JobFailedError, StopRequested
from raytrec.models import ModelFactory, build_train_model
from raytrec.observability.metrics import IntervalMetrics
from raytrec.observability.progress import ProgressReporter
from raytrec.observability.run_logs import RunLogs
from raytrec.observability.summary import ledger_lines, write_ledger

__all__ = [
    "CapacityUnknownWarning",
    "CoordinatorDied",
    "KeptCheckpoint",
    "Result",
    "TrainingStopped",
    "default_source",
    "fit",
]


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
    # Failures, generations, heals and resizes, in order, each with its time and step.
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    generation: int = 0  # the last generation
    # Exactly-once accounting (replayable sources): batch ids trained into the final model as
    # merged [start, stop) ranges, their count with multiplicity, and those replayed.
    committed_batches: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    committed_count: int = 0
    replayed_batches: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    lost_batches: int = 0
    # Rows the committed batches hold, with multiplicity (None: the source names no batches).
    committed_rows: int | None = None
    checkpoint: ray.train.Checkpoint | None = None  # the last checkpoint saved (Ray Train's type)
    # The checkpoints kept, each with the metrics of its step: best first by
    # checkpoint.checkpoint_score_attribute when one is set, else newest first (Ray Train's
    # Result.best_checkpoints).
    best_checkpoints: list[KeptCheckpoint] = dataclasses.field(default_factory=list)
    stopped_early: str | None = None  # why early stopping ended the job (eval.early_stopping_*)
    # Parquet read by index: the streams made when the rows left were shared again among the
    # ranks after a membership change (the ids of committed batches name them), as JSON; None
    # for other sources. IndexedParquetShard.with_table(...) reads or locates any of them.
    reshared_streams: dict[str, Any] | None = None

    @property
    def final_loss(self) -> float:
        return self.history[-1].loss

    @property
    def final_auc(self) -> float | None:
        """The last interval's AUC (progressive validation: on rows before training on them)."""
        return self.history[-1].auc if self.history else None

    @property
    def held_out_oracle_auc(self) -> float | None:
        """The oracle AUC of generated data's held-out split (data.generated_held_out_rows)."""
        return self.data.held_out_oracle_auc

    @property
    def oracle_auc(self) -> float | None:
        """The AUC of the data's own click probabilities (generated data only): the ceiling."""
        return self.data.oracle_auc

    def ledger(self, *, stopped: str | None = None, failed: str | None = None) -> dict[str, Any]:
        """The run's ledger (also in the run directory as ``summary.json``): steps, rows,
        committed, replayed and lost batches, failures by kind, generations, the replica
        check, final and best metrics, and where every artifact is
        (raytrec.observability.summary)."""
        from raytrec.observability.summary import ledger

        return ledger(self, stopped=stopped, failed=failed)

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
        said = str(cause).rstrip()
        if said and not said.endswith((".", "!", "?")):
            said += "."
        saved = (
            f"the model trained so far is saved at {result.final_state_path}"
            if result.final_state_path is not None
            else "nothing was trained, so no model was saved"
        )
        super().__init__(
            f"{said}\nTraining stopped after step {result.steps} of "
            f"{result.config.num_steps}; {saved}."
        )
        self.cause = cause
        self.result = result


default_source = synthetic_source  # the source of data.source="synthetic"


class CapacityUnknownWarning(UserWarning):
    """The cluster may add nodes of types it does not publish, so whether it can hold the job
    is known only once the job asks for them."""


def check_capacity(
    config: TrainConfig,
    shapes: Sequence[NodeShape],
    *,
    ray_data: bool = False,
    unpublished_node_types: bool = False,
) -> None:
    """Fails (a :class:`ConfigError`, exit code 2 from ``jobs.train``) when the cluster of
    ``shapes`` can never hold the job: see :mod:`raytrec.cluster.capacity`. With
    ``unpublished_node_types`` (an autoscaler that did not publish what it may add) a job the
    live nodes cannot hold is only warned about (:class:`CapacityUnknownWarning`): the
    autoscaler may add the nodes, and placement waits for them at most
    ``elastic.resource_wait_s``."""
    refusal = capacity_refusal(config, shapes, ray_data=ray_data)
    if refusal is None:
        return
    if unpublished_node_types:
        warnings.warn(
            f"{refusal}. The cluster's autoscaler has not published its node types, so the job "
            "asks for the nodes and waits for them at most elastic.resource_wait_s="
            f"{config.elastic.resource_wait_s:g}s",
            CapacityUnknownWarning,
            stacklevel=2,
        )
        return
    raise ConfigError(refusal)


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
) -> Result:
    """Trains ``config`` on Ray and returns the metrics history and the final state.

    ``source`` overrides ``config.data.source``. ``resume_from_checkpoint`` (a checkpoint
    directory or URI, or a ``ray.train.Checkpoint`` such as ``Result.checkpoint``) starts from a
    saved job, which may have had another number of gangs, gang size or sharding plan.
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
    with RunLogs(verbose=verbose) as logs, _StopOnSignal() as stop:
        return _fit(
            config,
            source=source,
            model_factory=model_factory,
            ray_address=ray_address,
            on_progress=on_progress,
            shutdown_ray=shutdown_ray,
            resume_from_checkpoint=resume_from_checkpoint,
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
    eval_source: str | None,
    logs: RunLogs,
    stop: _StopOnSignal,
) -> Result:
    quiet_known_warnings()
    resume = (
        resume_from_checkpoint.path
        if isinstance(resume_from_checkpoint, ray.train.Checkpoint)
        else resume_from_checkpoint
    )
    if resume is not None:
        _check_checkpoint(resume, config)
    config = config.replace(storage_path=resolve_storage_path(config.storage_path))
    if eval_source is not None:
        config = config.replace(eval=config.eval.replace(path=eval_source))
    _check_eval_is_there(config)
    if source is not None:  # a source of the caller's: checked before Ray is touched
        validate_features(config.model, source.sparse_features)
    _check_length_known(config, source)
    _check_gpus_here(config, ray_address)
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
            source, info = source_from_config(config, _vocabularies_of(resume))
            validate_features(config.model, source.sparse_features)
            if config.eval.path is None and info.held_out_path is not None:
                # Generated data's held-out split is what the job evaluates on.
                config = config.replace(eval=config.eval.replace(path=info.held_out_path))
        shards_of_plan = config.scaling.world_size
        if resume is not None:
            shards_of_plan = _indexed_resume_shards(resume, config, source) or shards_of_plan
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
        coordinator = coordinator_cls.options(scheduling_strategy=here, name=name).remote(
            config,
            plan,
            shards,
            source.dense_features,
            run_dir,
            model_factory,
            new_shard=source.shard if isinstance(source, SyntheticCriteo) else None,
            resume_from=resume,
            evaluation=evaluation,
            features=features,
        )
        seen = _Seen(reporter, reporter.event if isinstance(reporter, ProgressReporter) else None)
        failure: BaseException | None = None
        try:
            summary = _drive(coordinator, seen.row, seen.event, stop)
        except BaseException as e:
            # Whatever ended the job, its ledger is written: what it committed, why it ended,
            # and the checkpoint to resume from (asked of the coordinator while it lives).
            failure = _job_failure(e)
            summary = _summary_after(coordinator, seen, wait_s=5 if _interrupted(e) else 60)
        finally:
            # The coordinator may already be gone; it is killed below regardless.
            with contextlib.suppress(Exception):
                ray.get(coordinator.shutdown.remote(), timeout=60)
            ray.kill(coordinator)
            # A coordinator that died could not release the job's placement groups, and Ray
            # keeps them for as long as this driver lives: release them by their names.
            _release_placement_groups(os.path.basename(run_dir))
    finally:
        if shutdown_ray if shutdown_ray is not None else started:
            ray.shutdown()
    if failure is not None:
        result = _result(config, summary, run_dir, info)
        _close_failed(result, failure, reporter, own_reporter=on_progress is None)
        raise failure
    result = _result(config, summary, run_dir, info)
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


def _result(config: TrainConfig, summary: Any, run_dir: str, info: DataInfo) -> Result:
    """The :class:`Result` of the coordinator's :class:`RunSummary`."""
    return Result(
        config=config,
        history=summary.history,
        final_state_path=summary.final_state_path,
        run_dir=run_dir,
        steps=summary.steps,
        wall_s=summary.wall_s,
        state_digests=summary.digests,
        data=info,
        first_batch_s=summary.first_batch_s,
        events=summary.events,
        generation=summary.generation,
        committed_batches=summary.committed_batches,
        committed_count=summary.committed_count,
        committed_rows=summary.committed_rows,
        replayed_batches=summary.replayed_batches,
        lost_batches=summary.lost_batches,
        reshared_streams=summary.reshared_streams,
        checkpoint=None if summary.checkpoint is None else ray.train.Checkpoint(summary.checkpoint),
        best_checkpoints=best_checkpoints(run_dir, config.checkpoint),
        stopped_early=str(summary.stopped_by)
        if isinstance(summary.stopped_by, EarlyStopped)
        else None,
    )


def _vocabularies_of(checkpoint: str | None) -> dict[str, tuple[str, ...]] | None:
    """The vocabularies a checkpoint's model was trained with: a resumed job encodes categories
    as it did (None: no checkpoint, or one without them, and they are fitted on the data)."""
    if checkpoint is None:
        return None
    from raytrec.data.spec import CategoricalFeature
    from raytrec.serving.model_spec import read_model_spec

    spec = read_model_spec(checkpoint)
    if spec is None:
        return None
    found = {
        f.name: f.vocabulary
        for f in spec.features.sparse
        if isinstance(f, CategoricalFeature) and f.vocabulary is not None
    }
    return found or None


def _check_length_known(config: TrainConfig, source: BatchSource | None) -> None:
    """``num_steps=None`` needs a source with an end, known before Ray is touched."""
    if config.num_steps is not None:
        return
    if source is not None and not isinstance(source, ParquetSource):
        raise ConfigError(endless_refusal(f"the source {type(source).__name__}"))
    if source is None and config.data.source == "synthetic":
        raise ConfigError(endless_refusal("data.source='synthetic' (rows made in each rank)"))


def _check_gpus_here(config: TrainConfig, ray_address: str | None) -> None:
    """A GPU job with no cluster to join runs on an embedded cluster of this machine: refused
    before Ray starts when this machine has no GPU."""
    embedded = not ray.is_initialized() and not (ray_address or os.environ.get("RAY_ADDRESS"))
    if config.scaling.use_gpu and embedded and torch.cuda.device_count() == 0:
        raise ConfigError(
            "scaling.use_gpu=True (--gpu) needs GPUs, and this machine has none: without "
            "RAY_ADDRESS the job runs on an embedded cluster of this machine; drop --gpu, or "
            "set RAY_ADDRESS to a cluster with GPU nodes"
        )


def _check_eval_is_there(config: TrainConfig) -> None:
    """Ranking checkpoints by, or stopping early on, a held-out metric needs held-out data."""
    if config.eval.path is not None or (
        config.data.source == "generated" and config.data.generated_held_out_rows
    ):
        return
    wants = []
    if config.checkpoint.scored_by_eval:
        wants.append(
            f"checkpoint.checkpoint_score_attribute={config.checkpoint.checkpoint_score_attribute}"
        )
    if config.eval.early_stopping_patience is not None:
        wants.append(f"eval.early_stopping_patience={config.eval.early_stopping_patience}")
    if wants:
        raise ConfigError(
            f"{' and '.join(wants)} need held-out data: set eval.path or pass "
            "fit(..., eval_source=PATH)"
        )


@dataclasses.dataclass(frozen=True)
class KeptCheckpoint:
    """A checkpoint the run kept: where it is, the step it was saved at and that step's
    metrics (the training interval's, and the held-out evaluation's when one ran). Unpacks as
    Ray Train's ``(checkpoint, metrics)`` pair: ``best, metrics = result.best_checkpoints[0]``."""

    checkpoint: ray.train.Checkpoint
    step: int
    metrics: dict[str, float]

    @property
    def path(self) -> str:
        return str(self.checkpoint.path)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.checkpoint, self.metrics))

    def __getitem__(self, index: int) -> Any:
        return (self.checkpoint, self.metrics)[index]

    def __len__(self) -> int:
        return 2


def best_checkpoints(run_dir: str, config: CheckpointConfig) -> list[KeptCheckpoint]:
    """The run's committed checkpoints with the metrics of their step: best first by
    ``config.checkpoint_score_attribute``, else newest first."""
    from raytrec.checkpoint.config import checkpoint_root, ranked
    from raytrec.checkpoint.layout import CheckpointStore, read_manifest

    store = CheckpointStore(checkpoint_root(run_dir))
    refs = {ref.name: ref for ref in store.committed()}
    saved = [store.scored(ref, config.checkpoint_score_attribute) for ref in refs.values()]
    if config.checkpoint_score_attribute is None:
        order = sorted(saved, key=lambda c: -c.step)
    else:
        order = ranked(saved, config.checkpoint_score_order)
    return [
        KeptCheckpoint(
            checkpoint=ray.train.Checkpoint(refs[c.name].uri),
            step=refs[c.name].step,
            metrics=dict(read_manifest(refs[c.name].uri).extra.get("metrics", {})),
        )
        for c in order
    ]


def _check_checkpoint(uri: str, config: TrainConfig) -> None:
    """A missing, partial or incompatible checkpoint fails here, before any actor starts."""
    from raytrec.checkpoint.layout import read_manifest
    from raytrec.checkpoint.manifest import check_compatible, signature_for

    manifest = read_manifest(uri)
    # Tables and optimizers here; each rank checks its dense shapes too before loading.
    expected = signature_for(config, manifest.signature.dense_params)
    check_compatible(manifest.signature, expected, where=uri)


def _indexed_resume_shards(uri: str, config: TrainConfig, source: BatchSource) -> int | None:
    """For Parquet read by index: the number of ranks the checkpoint's job split the data for,
    whose plan its saved stream positions name (the resumed job shares the rows left among its
    own ranks, any number of them); None for other sources. A checkpoint saved without the
    table of re-shared streams resumes only on that number of ranks."""
    if not isinstance(source, ParquetSource) or source.read_mode != "indexed":
        return None
    from raytrec.checkpoint.layout import read_manifest

    accounting = read_manifest(uri).extra.get("accounting") or {}
    streams = accounting.get("streams")
    if not streams:
        return None
    table = accounting.get("streams_table")
    if table is not None:
        return int(table["num_shards"])
    saved = 1 + max(int(s[0]) for s in [*streams["live"], *streams["retired"]])
    ranks = config.scaling.world_size
    if ranks != saved:
        raise ConfigError(
            f"{uri} was trained on Parquet read by index in {saved} shards and saved without "
            f"the table of re-shared streams; resume it with scaling.num_workers={saved} (not "
            f"{ranks}) to continue on the same rows, or read with "
            "data.parquet_read='streaming', which restarts the data at the checkpoint's step"
        )
    return saved


def _plan(config: TrainConfig, num_dense: int, model_factory: ModelFactory) -> Any:
    return job_plan(config, num_dense, model_factory, device_memory=_device_memory(config))


#: How long the driver waits for a GPU of the cluster to say how much memory it has.
_DEVICE_MEMORY_WAIT_S = 120.0


def _device_memory(config: TrainConfig) -> int | None:
    """The device memory per GPU rank the plan may fill: ``sharding.device_memory_gib``, else
    what a GPU says (the driver's own, or one a one-GPU Ray task sees); None on CPU ranks."""
    if not config.scaling.use_gpu:
        return None
    if config.sharding.device_memory_gib is not None:
        return int(config.sharding.device_memory_gib * 2**30)
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    probe = ray.remote(num_gpus=1, num_cpus=0)(_gpu_memory).remote()
    try:
        return int(ray.get(probe, timeout=_DEVICE_MEMORY_WAIT_S))
    except ray.exceptions.GetTimeoutError:
        ray.cancel(probe, force=True)
        raise ConfigError(
            f"no GPU of the cluster said how much memory it has within "
            f"{_DEVICE_MEMORY_WAIT_S:.0f} s; set sharding.device_memory_gib"
        ) from None


def _gpu_memory() -> int:
    return int(torch.cuda.get_device_properties(0).total_memory)


class _Seen:
    """Passes the job's metrics rows and events on, keeping them: the driver's own record of a
    job whose coordinator died."""

    def __init__(
        self,
        on_row: Callable[[IntervalMetrics], None],
        on_event: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.rows: list[IntervalMetrics] = []
        self.events: list[dict[str, Any]] = []
        self._on_row, self._on_event = on_row, on_event
        self.started = time.perf_counter()

    def row(self, row: IntervalMetrics) -> None:
        self.rows.append(row)
        self._on_row(row)

    def event(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)


def _interrupted(e: BaseException) -> bool:
    return isinstance(e, KeyboardInterrupt)


def _job_failure(e: BaseException) -> BaseException:
    """The exception ``fit`` raises for what ended the job: raytrec's own errors and an
    interrupt as they are; anything else (a defect) as a :class:`JobFailedError` naming it."""
    if isinstance(e, JobFailedError | ConfigError | KeyboardInterrupt | StopRequested):
        return e
    cause = getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else e
    what = f"{type(cause).__name__}: {cause}" if cause is not None else str(e)
    failure = JobFailedError(
        f"the job's coordinator failed with {' '.join(what.split())[:500]} (a defect: its "
        "traceback is in error.txt in the run directory)"
    )
    failure.__cause__ = e
    return failure


def _summary_after(coordinator: Any, seen: _Seen, *, wait_s: float) -> Any:
    """The coordinator's :meth:`~actors.coordinator.Coordinator.summary_so_far`, or, when it
    cannot answer (it died), what the driver saw: the metrics rows and events, no committed
    batches."""
    from raytrec.elastic.report import RunSummary

    with contextlib.suppress(Exception):
        return ray.get(coordinator.summary_so_far.remote(), timeout=wait_s)
    return RunSummary(
        history=list(seen.rows),
        final_state_path=None,
        steps=seen.rows[-1].step if seen.rows else 0,
        wall_s=time.perf_counter() - seen.started,
        ranks=[],
        digests={},
        events=list(seen.events),
        committed_rows=None,
    )


def _close_failed(
    result: Result, failure: BaseException, reporter: Any, *, own_reporter: bool
) -> None:
    """Writes a failed job's ledger (``summary.json``, with why it ended and the checkpoint to
    resume from), its metrics and the traceback of a defect, and prints the ledger's lines;
    ``failure`` gets the result (``failure.result``)."""
    import traceback

    from raytrec.checkpoint.config import checkpoint_root
    from raytrec.checkpoint.layout import CheckpointStore

    if result.checkpoint is None:
        # The coordinator could not say: the newest checkpoint committed on disk.
        with contextlib.suppress(Exception):
            ref = CheckpointStore(checkpoint_root(result.run_dir)).latest()
            if ref is not None:
                result = dataclasses.replace(result, checkpoint=ray.train.Checkpoint(ref.uri))
    with open(os.path.join(result.run_dir, "metrics.json"), "w") as f:
        json.dump([m.to_dict() for m in result.history], f, indent=1)
    if failure.__cause__ is not None and not isinstance(failure, KeyboardInterrupt):
        with open(os.path.join(result.run_dir, "error.txt"), "w") as f:
            f.write("".join(traceback.format_exception(failure.__cause__)))
    reason = "interrupted" if _interrupted(failure) else f"{type(failure).__name__}: {failure}"
    reason = " ".join(reason.split())
    if isinstance(failure, StopRequested):
        ledger = result.ledger(stopped=reason)
    else:
        ledger = result.ledger(failed=reason)
    write_ledger(ledger)
    if isinstance(reporter, ProgressReporter):
        if own_reporter:
            reporter.close(events=result.events)  # metrics file, TensorBoard and the plot
        for line in ledger_lines(ledger):
            print(line, flush=True)
    # The run's result travels with the exception (JobFailedError.result, ConfigError.result).
    failure.result = result  # type: ignore[attr-defined]


def _drive(
    coordinator: Any,
    on_progress: Callable[[IntervalMetrics], None],
    on_event: Callable[[dict[str, Any]], None] | None,
    stop: _StopOnSignal,
) -> Any:
    """Runs the job, passing on its metrics rows (and, with ``on_event``, its events) as they
    come; returns the coordinator's summary. The first SIGTERM or SIGINT (``ray job stop``,
    Ctrl-C) asks the job to stop at its next interval boundary; a second one stops at once."""
    run_ref = coordinator.run.remote()
    stop.training = True  # from here on, a signal stops at a boundary (and stays so)
    return _follow(coordinator, run_ref, on_progress, on_event, stop)


class _StopOnSignal:
    """SIGTERM and SIGINT while ``fit`` runs in the main thread (elsewhere it does nothing).

    Before training (Ray starting, data being written, ranks being placed) a signal raises
    :class:`StopRequested` there, and ``fit`` unwinds: an embedded cluster it started is shut
    down whole. While training, the first signal sets ``asked`` (the job stops at its next
    interval boundary) and the second raises KeyboardInterrupt (the job is killed)."""

    def __init__(self) -> None:
        self.asked = False
        self.training = False
        self._saved: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        if not self.training:
            raise StopRequested(f"stopped on request (signal {signum}) before training started")
        if self.asked:
            raise KeyboardInterrupt(f"signal {signum} again: stopping at once")
        self.asked = True
        print(
            f"[raytrec] signal {signum}: stopping at the next interval boundary "
            "(send it again to stop at once)",
            flush=True,
        )

    def restore(self) -> None:
        """Takes the signals back (after a library, Ray's driver, installed its own)."""
        for sig in self._saved:
            signal.signal(sig, self._handle)

    def __enter__(self) -> _StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_: Any) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)


def _follow(
    coordinator: Any,
    run_ref: Any,
    on_progress: Callable[[IntervalMetrics], None],
    on_event: Callable[[dict[str, Any]], None] | None,
    stop: _StopOnSignal,
) -> Any:
    seen = seen_events = 0
    stop_sent = False
    try:
        while True:
            if stop.asked and not stop_sent:
                coordinator.request_stop.remote()
                stop_sent = True
            done, _ = ray.wait([run_ref], timeout=1.0)
            rows = ray.get(coordinator.progress.remote(seen))
            for row in rows:
                on_progress(row)
            seen += len(rows)
            if on_event is not None:
                events = ray.get(coordinator.event_dicts.remote(seen_events))
                for event in events:
                    on_event(event)
                seen_events += len(events)
            if done:
                return ray.get(run_ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, JobFailedError | ConfigError):
            raise cause from None  # the coordinator's own words, not Ray's wrapper
        raise
    except ray.exceptions.RayActorError as e:
        raise CoordinatorDied(
            "the coordinator actor died, and the job with it: raytrec does not survive the "
            f"loss of its coordinator (its node, or the driver's Ray session, went away): {e}"
        ) from e


def _release_placement_groups(prefix: str) -> None:
    """Removes the placement groups still held whose name starts with ``prefix`` (a run's)."""
    from ray.util.placement_group import get_placement_group, placement_group_table

    for info in placement_group_table().values():
        name = info.get("name") or ""
        if name.startswith(prefix) and info.get("state") != "REMOVED":
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(get_placement_group(name))


class CoordinatorDied(JobFailedError):
    """The coordinator actor is gone; the job cannot continue (see docs/fault_tolerance.md)."""
