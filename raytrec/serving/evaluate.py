"""Scoring a trained model over Parquet after training: :func:`evaluate` and :func:`predict`.

Both take any model raytrec writes (a checkpoint, a final model, a :class:`~raytrec.api.Result`
or an export; others than an export are exported to a temporary directory first) and rows in
raytrec's Parquet schema. The model runs unsharded, in eval mode, under ``torch.no_grad()``:
nothing is trained.

- :func:`evaluate` reads the rows in this process and returns AUC, normalized entropy and log
  loss over all of them, computed with the training loop's own metric code
  (:mod:`raytrec.rec_metrics`, TorchRec's ``compute_auc`` and ``compute_ne``); for a two-tower
  model also recall@k (:func:`recall_at_k`).
- :func:`predict` scores the rows with Ray Data (``map_batches`` over an actor pool; each
  actor builds the model once from a copy in Ray's object store, so workers need no shared
  filesystem) and returns a dataset of ``row_id``, ``label`` and ``score`` per row.
"""

from __future__ import annotations

import dataclasses
import os
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
from raytrec.rec_metrics import RankMetrics, merge_metric_states
from raytrec.serving.export import build_model, exported, load_exported, make_batch, score
from raytrec.serving.spec import ModelSpec
from raytrec.two_tower import TwoTower

__all__ = ["EvalMetrics", "evaluate", "predict", "recall_at_k"]

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
) -> EvalMetrics:
    """AUC, NE and log loss of the model in ``checkpoint`` over every row of ``source``
    (Parquet paths, a :class:`DataConfig` with a path, or a
    :class:`~raytrec.data.parquet.ParquetSource`), in this process.

    ``features``: the row layout, if not the one the model was trained with (its spec's);
    ``config``: for a model saved without its spec (see :func:`~raytrec.serving.export.export`).
    ``recall_at``: the k of recall@k, for a two-tower model.
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
    return EvalMetrics(
        auc=merged.auc,
        ne=merged.ne,
        log_loss=merged.log_loss,
        rows=merged.rows,
        step=info.step,
        recall_at_k=recall,
    )


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


class _Scorer:
    """A Ray Data callable class: builds the model once per actor, then scores Arrow batches."""

    def __init__(self, model: list[Any], features: FeatureSpec) -> None:
        # ``model`` holds the object-store ref of (spec, state dict, where): fetched here, once.
        torch.set_num_threads(1)  # one CPU per actor
        spec_doc, state, where = ray.get(model[0])
        spec = ModelSpec.from_dict(spec_doc, where=where)
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
    config: TrainConfig | None = None,
    features: FeatureSpec | None = None,
    batch_size: int = 4096,
    num_workers: int | None = None,
    ray_address: str | None = None,
) -> Any:
    """A Ray Dataset with one row per input row: ``row_id`` (when the layout has one),
    ``label`` and ``score`` (the model's click probability), in no particular order.

    Scored by ``num_workers`` actors of 1 CPU each (default: the cluster's CPUs less one, at
    least 1) with Ray Data; connects to Ray (``ray_address``, ``RAY_ADDRESS`` or an embedded
    local cluster) when not connected. The dataset is lazy: it is scored when consumed.
    """
    with exported(checkpoint, config=config) as path:
        model, info = load_exported(path)
    # Checked on the driver, so a bad file fails here, named, before any worker starts.
    parquet, _ = _parquet(source, features or info.spec.features)
    connect(ray_address)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    ref = ray.put((info.spec.to_dict(), state, info.path))
    if num_workers is None:
        num_workers = max(1, int(ray.cluster_resources().get("CPU", 2)) - 1)
    return parquet.dataset().map_batches(
        _Scorer,
        fn_constructor_kwargs={"model": [ref], "features": parquet.spec},
        batch_size=batch_size,
        batch_format="pyarrow",
        concurrency=num_workers,
        num_cpus=1,
    )
