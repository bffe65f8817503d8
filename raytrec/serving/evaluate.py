"""Scoring a trained model over Parquet after training: :func:`evaluate` and :func:`predict`.

Both take any model raytrec writes (a checkpoint, a final model, a :class:`~raytrec.api.Result`
or an export; others than an export are exported to a temporary directory first) and rows in
raytrec's Parquet schema. The model runs unsharded, in eval mode, under ``torch.no_grad()``:
nothing is trained.

- :func:`evaluate` reads the rows in this process and returns AUC, normalized entropy and log
  loss over all of them, computed with the training loop's own metric code
  (:mod:`raytrec.observability.rec_metrics`, TorchRec's ``compute_auc`` and ``compute_ne``);
  for a two-tower model also recall@k (:func:`recall_at_k`).
- :func:`predict` scores the rows with Ray Data (``map_batches`` over an actor pool; each
  actor builds the model once from a copy in Ray's object store, so workers need no shared
  filesystem) and returns a dataset of ``row_id``, ``label`` and ``score`` per row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch

from raytrec.cluster import connect
from raytrec.config import DataConfig, TrainConfig
from raytrec.data.arrow_kjt import BadInputError, to_batch
from raytrec.data.parquet import ParquetFileInfo, ParquetSource
from raytrec.data.spec import FeatureSpec
from raytrec.models.two_tower import TwoTower
from raytrec.observability.quiet_data import progress_bars, quiet_dataset
from raytrec.observability.rec_metrics import RankMetrics, merge_metric_states
from raytrec.observability.run_logs import NATIVE_LOG, RunLogs, native_stderr_to
from raytrec.serving.export import (
    build_model,
    exported,
    load_exported,
    make_batch,
    quiet_notices,
    score,
)
from raytrec.serving.model_spec import ModelSpec

__all__ = ["EvalMetrics", "Predictions", "evaluate", "predict", "recall_at_k"]

Source = str | os.PathLike[str] | Sequence[str] | DataConfig | ParquetSource


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalMetrics:
    """Metrics of a model over every row of a source."""

    auc: float | None  # None when the rows hold one class only
    ne: float | None  # normalized entropy; None when the rows hold one class only
    log_loss: float  # mean binary cross-entropy
    rows: int
    step: int | None  # the step the model was trained to, when its checkpoint says
    # Two-tower models: k -> the share of positive rows whose own item is among the k items
    # scored highest for their user, out of every distinct item of the rows (recall_at_k).
    recall_at_k: dict[int, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def line(self, source: Any) -> str:
        """The metrics in one line, naming what was scored."""
        step = "" if self.step is None else f" (step {self.step})"
        numbers = ", ".join(
            f"{name} {value:.4f}"
            for name, value in (("AUC", self.auc), ("NE", self.ne), ("log loss", self.log_loss))
            if value is not None
        )
        recall = (
            ""
            if not self.recall_at_k
            else "; " + ", ".join(f"recall@{k} {v:.4f}" for k, v in self.recall_at_k.items())
        )
        where = source if isinstance(source, str | os.PathLike) else type(source).__name__
        scored = f"{self.rows:,} rows of {where}"
        return f"[raytrec] evaluated the model{step} on {scored}: {numbers}{recall}"


def _parquet(source: Source, features: FeatureSpec) -> tuple[ParquetSource, list[ParquetFileInfo]]:
    """The source as a :class:`ParquetSource` and its files, checked (readable, with rows, the
    layout's columns with the right types). Files without the layout's row-id column are read
    without row ids; any other missing column is an error."""
    if isinstance(source, ParquetSource):
        parquet = source
    elif isinstance(source, DataConfig):
        if source.path is None:
            raise ValueError("evaluate/predict: the DataConfig names no path (data.path)")
        parquet = ParquetSource(paths=source.path, spec=features)
    else:
        paths = os.fspath(source) if isinstance(source, str | os.PathLike) else list(source)
        parquet = ParquetSource(paths=paths, spec=features)
    try:
        return parquet, parquet.inspect()
    except BadInputError as e:
        row_id = parquet.spec.row_id
        if e.reason != "missing_column" or row_id is None or e.column != row_id:
            raise
    parquet = dataclasses.replace(parquet, spec=dataclasses.replace(parquet.spec, row_id=None))
    return parquet, parquet.inspect()


def evaluate(
    checkpoint: Any,
    source: Source,
    *,
    config: TrainConfig | None = None,
    features: FeatureSpec | None = None,
    batch_size: int = 8192,
    recall_at: Sequence[int] = (1, 10, 100),
    quiet: bool = False,
) -> EvalMetrics:
    """AUC, NE and log loss of the model in ``checkpoint`` over every row of ``source``
    (Parquet paths, a :class:`DataConfig` with a path, or a
    :class:`~raytrec.data.parquet.ParquetSource`), in this process.

    ``features``: the row layout, if not the one the model was trained with (its spec's);
    ``config``: for a model saved without its spec (see :func:`~raytrec.serving.export.export`).
    ``recall_at``: the k of recall@k, for a two-tower model. Prints one line with the metrics
    (not with ``quiet``).
    """
    with exported(checkpoint, config=config) as path:
        model, info = load_exported(path)
    parquet, files = _parquet(source, features or info.spec.features)
    spec = parquet.spec
    fs, _ = parquet.list_files()
    metrics = RankMetrics(auc_window=max(1, sum(f.rows for f in files)), exact_preds=True)
    towers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for f in files:
        with fs.open_input_file(f.path) as handle:
            reader = pq.ParquetFile(handle)
            offset = 0
            for record_batch in reader.iter_batches(
                batch_size=batch_size, columns=list(spec.required_columns())
            ):
                batch, _ = to_batch(record_batch, spec, file=f.path, row_offset=offset)
                offset += record_batch.num_rows
                with torch.no_grad():
                    logits = model(batch.dense_features, batch.sparse_features)
                    if isinstance(model, TwoTower):
                        user, item = model.towers(batch.dense_features, batch.sparse_features)
                        towers.append((user, item, batch.labels.reshape(-1)))
                metrics.update(logits, batch.labels)
    merged = merge_metric_states([metrics.state()])
    assert merged.log_loss is not None  # inspect() refuses files without rows
    recall = None
    if towers:
        users, items, labels = (torch.cat(t) for t in zip(*towers, strict=True))
        recall = recall_at_k(users, items, labels, ks=recall_at)
    done = EvalMetrics(
        auc=merged.auc,
        ne=merged.ne,
        log_loss=merged.log_loss,
        rows=merged.rows,
        step=info.step,
        recall_at_k=recall,
    )
    if not quiet:
        print(done.line(source), flush=True)
    return done


def recall_at_k(
    users: torch.Tensor, items: torch.Tensor, labels: torch.Tensor, *, ks: Sequence[int]
) -> dict[int, float]:
    """Retrieval recall: for each positive row, whether its own item is among the ``k``
    highest-scored (``user · item``) of every distinct item vector of the rows (ties count
    against it). Rows of one item give one candidate; NaN when no row is positive."""
    candidates, which = torch.unique(items, dim=0, return_inverse=True)
    queries = torch.nonzero(labels > 0.5).reshape(-1)
    if len(queries) == 0:
        return {k: float("nan") for k in ks}
    hits = dict.fromkeys(ks, 0)
    for chunk in queries.split(1024):
        scores = users[chunk] @ candidates.T
        own = scores.gather(1, which[chunk].reshape(-1, 1))  # the same product, bit for bit
        better = (scores >= own).sum(dim=1) - 1  # less the item itself
        for k in ks:
            hits[k] += int((better < k).sum())
    return {k: hits[k] / len(queries) for k in ks}


class _ModelCopy:
    """The model to score with, held for the scoring actors (a Ray actor of no CPU). Handed
    to them as constructor arguments in Ray's object store, the model could not be fetched
    again by an actor that Ray Data restarts once the driver's copy is gone (Ray says so for
    every such actor); an actor handle is a small argument, and the copy lives as long as the
    dataset that refers to it."""

    def __init__(self, model: tuple[dict[str, Any], dict[str, torch.Tensor], str]) -> None:
        self.model = model

    def get(self) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
        return self.model


class _Scorer:
    """A Ray Data callable class: builds the model once per actor, then scores Arrow batches."""

    def __init__(self, model: Any, features: FeatureSpec) -> None:
        # ``model``: the handle of a _ModelCopy holding (spec, state dict, where); fetched
        # here, once (again by an actor Ray Data restarts, while the copy lives).
        torch.set_num_threads(1)  # one CPU per actor
        spec_doc, state, where = ray.get(model.get.remote())
        spec = ModelSpec.from_dict(spec_doc, where=where)
        with quiet_notices():
            self.model = build_model(spec, state, where=where)
        self.features = features

    def __call__(self, table: pa.Table) -> pa.Table:
        batch, row_ids = make_batch(table, self.features)
        columns: dict[str, Any] = {}
        if row_ids is not None:
            columns["row_id"] = pa.array(row_ids, pa.int64())
        columns["label"] = pa.array(batch.labels.numpy().reshape(len(table), -1)[:, 0])
        columns["score"] = pa.array(score(self.model, batch).numpy())
        return pa.table(columns)


def predict(
    checkpoint: Any,
    source: Source,
    *,
    output: str | os.PathLike[str] | None = None,
    config: TrainConfig | None = None,
    features: FeatureSpec | None = None,
    batch_size: int = 4096,
    num_workers: int | None = None,
    ray_address: str | None = None,
    verbose: bool = False,
) -> Any:
    """Scores every row of ``source``: one output row per input row, ``row_id`` (when the
    layout has one), ``label`` and ``score`` (the model's click probability), in no particular
    order.

    With ``output`` (a new directory), the predictions are written there as Parquet and a
    :class:`Predictions` is returned; Ray's and Ray Data's own output goes to
    ``<output>/_logs/`` (unless ``verbose``), progress bars show on a terminal only, and one
    line says what was scored and where. Without it, the return is a lazy Ray Dataset, scored
    when consumed; unless ``verbose``, it runs without Ray Data's progress bars and log lines on
    the console (they stay in Ray's session logs: :mod:`raytrec.observability.quiet_data`).

    Scored by ``num_workers`` actors of 1 CPU each (default: the cluster's CPUs less one, at
    least 1) with Ray Data; connects to Ray (``ray_address``, ``RAY_ADDRESS`` or an embedded
    local cluster) when not connected.
    """
    if output is None:
        # Connecting and reading are quiet; the dataset runs later, in the caller's hands.
        with (
            RunLogs(verbose=verbose),
            contextlib.nullcontext() if verbose else progress_bars(False),
        ):
            data = _scored(
                checkpoint, source, config, features, batch_size, num_workers, ray_address
            )[0]
        return data if verbose else quiet_dataset(data)
    out = os.fspath(output)
    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"predict: the output directory {out} is not empty")
    started = time.perf_counter()
    logs_dir = os.path.join(out, LOGS)
    os.makedirs(logs_dir, exist_ok=True)
    native = (
        contextlib.nullcontext()
        if verbose
        else native_stderr_to(os.path.join(logs_dir, NATIVE_LOG))
    )
    connected = ray.is_initialized()
    # Progress bars on a terminal only (Ray Data draws them whatever stderr is).
    bars = progress_bars(verbose or sys.stderr.isatty())
    try:
        with RunLogs(verbose=verbose) as logs, native, bars:
            logs.open_dir(logs_dir)
            data, info = _scored(
                checkpoint, source, config, features, batch_size, num_workers, ray_address
            )
            logs.connected()  # Ray is connected now: its forwarded worker lines go to the file
            data.write_parquet(out)
    finally:
        if not connected and ray.is_initialized():
            ray.shutdown()  # an embedded cluster this call started goes with it, however it ends
    files = sorted(f for f in os.listdir(out) if f.endswith(".parquet"))
    rows = sum(pq.ParquetFile(os.path.join(out, f)).metadata.num_rows for f in files)
    done = Predictions(
        path=out,
        rows=rows,
        files=len(files),
        step=info.step,
        seconds=time.perf_counter() - started,
        logs=logs_dir,
    )
    print(done.line(), flush=True)
    return done


#: Where :func:`predict` puts Ray's output beside the predictions (a name Parquet readers skip).
LOGS = "_logs"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Predictions:
    """What :func:`predict` wrote with ``output``: Parquet files of ``row_id``, ``label`` and
    ``score``."""

    path: str
    rows: int
    files: int
    step: int | None  # the step of the model scored, when its checkpoint says
    seconds: float
    logs: str

    def line(self) -> str:
        step = "" if self.step is None else f" (step {self.step})"
        return (
            f"[raytrec] predicted {self.rows:,} rows with the model{step} in "
            f"{self.seconds:.1f}s: {self.path} ({self.files} Parquet file(s): row_id, label, "
            f"score); Ray's output: {self.logs}"
        )


def _scored(
    checkpoint: Any,
    source: Source,
    config: TrainConfig | None,
    features: FeatureSpec | None,
    batch_size: int,
    num_workers: int | None,
    ray_address: str | None,
) -> tuple[Any, Any]:
    """The lazy dataset of scores, and the export's description."""
    with exported(checkpoint, config=config) as path:
        model, info = load_exported(path)
    # Checked on the driver, so a bad file fails here, named, before any worker starts.
    parquet, _ = _parquet(source, features or info.spec.features)
    connect(ray_address)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    copy = ray.remote(num_cpus=0)(_ModelCopy).remote((info.spec.to_dict(), state, info.path))
    if num_workers is None:
        num_workers = max(1, int(ray.cluster_resources().get("CPU", 2)) - 1)
    dataset = parquet.dataset().map_batches(
        _Scorer,
        fn_constructor_kwargs={"model": copy, "features": parquet.spec},
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=num_workers),
        num_cpus=1,
    )
    return dataset, info
