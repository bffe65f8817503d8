"""The data source a :class:`~raytrec.config.TrainConfig` describes (``config.data.source``).

:func:`source_from_config` turns ``config.data`` into a :class:`~raytrec.data.source.BatchSource`
on the driver: the in-rank synthetic generator, Parquet streamed with Ray Data, or Parquet
generated once from the synthetic teacher (so the oracle AUC of the data is known and reported
next to the model's). Generated data is written into a temporary directory and renamed into
place when complete, so an interrupted generation is never mistaken for data, and a later job
with the same sizes reuses it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping

from raytrec.config import WEIGHTS_SUFFIX, ConfigError, TrainConfig
from raytrec.data.source import BatchShard, BatchSource
from raytrec.data.spec import (
    CategoricalFeature,
    FeatureSpec,
    SparseFeature,
    fit_vocabulary,
)
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.eval_plan import EvalPlan, eval_plan

__all__ = ["DataInfo", "generated_rows", "parquet_spec", "source_from_config", "synthetic_source"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataInfo:
    """What the driver knows about the data before training."""

    kind: str
    path: str | None = None
    rows_per_epoch: int | None = None
    oracle_auc: float | None = None  # AUC of the teacher's own click probabilities
    # Generated data's held-out split (data.generated_held_out_rows), and its oracle AUC.
    held_out_path: str | None = None
    held_out_oracle_auc: float | None = None


def _refuse_weighted(config: TrainConfig) -> None:
    weighted = [t.name for t in config.model.tables if t.weighted]
    if weighted:
        raise ConfigError(
            f"model.tables {weighted} are weighted, which needs data.source='parquet' with "
            f"weights columns (<feature>{WEIGHTS_SUFFIX}); data.source={config.data.source!r} "
            "makes ids without weights"
        )


def synthetic_source(config: TrainConfig) -> SyntheticCriteo:
    """The in-rank synthetic source that matches ``config.model.tables``."""
    _refuse_weighted(config)
    features = config.model.features
    sizes = {f: t.num_embeddings for t in config.model.tables for f in t.features}
    named = all(f"cat_{i}" in sizes for i in range(len(features)))
    return SyntheticCriteo(
        num_sparse=len(features),
        num_embeddings=tuple(sizes[f"cat_{i}"] for i in range(len(features)))
        if named
        else min(sizes.values()),
        seed=config.seed,
    )


def parquet_spec(
    config: TrainConfig, vocabularies: Mapping[str, tuple[str, ...]] | None = None
) -> FeatureSpec:
    """The row layout of a Parquet source for the model's features: ``config.data.columns``
    names the label, row-id, dense and feature columns (default: raytrec's own layout,
    ``dense_0..``, one id-list column per feature named like it, ``<feature>_weights`` for each
    feature of a weighted table, ``label`` and ``row_id``) and
    which features hold categories; ``vocabularies`` holds the fitted vocabulary of each feature
    encoded by ``"vocabulary"`` (:func:`fit_vocabularies`)."""
    data, columns = config.data, config.data.columns
    assert data.num_dense is not None  # DataConfig resolves it
    sizes = {f: t.num_embeddings for t in config.model.tables for f in t.features}
    # Features of tables with managed ids keep their raw ids (the model maps them to rows).
    managed = {f for t in config.model.tables if t.managed for f in t.features}
    weights = config.model.weights_columns  # feature -> its weights column, weighted tables
    unknown = sorted((set(columns.features) | set(columns.categorical)) - set(sizes))
    if unknown:
        raise ConfigError(
            f"data.columns names features {unknown} that no table of model.tables serves "
            f"(features: {sorted(sizes)})"
        )
    sparse: list[SparseFeature | CategoricalFeature] = []
    for feature, n in sizes.items():
        column = columns.features.get(feature, feature)
        encoding = columns.categorical.get(feature)
        if encoding is None:
            sparse.append(
                SparseFeature(
                    name=feature,
                    column=column,
                    num_embeddings=n,
                    id_policy="raw" if feature in managed else data.id_policy,
                    weights=weights.get(feature),
                )
            )
            continue
        if feature in weights:
            raise ConfigError(
                f"feature {feature!r} holds categories (data.columns.categorical) and its table "
                "is weighted: weights go with integer id lists only"
            )
        vocabulary = None
        if encoding == "vocabulary":
            vocabulary = (vocabularies or {}).get(feature)
            if vocabulary is None:
                raise ConfigError(
                    f"feature {feature!r} is encoded by a vocabulary, which is fitted on the "
                    "training data: data.source='parquet' with data.path"
                )
        sparse.append(
            CategoricalFeature(
                name=feature,
                column=column,
                num_embeddings=n,
                encoding="hash64" if encoding == "hash" and feature in managed else encoding,
                vocabulary=vocabulary,
            )
        )
    return FeatureSpec(
        dense=columns.dense
        if columns.dense is not None
        else tuple(f"dense_{j}" for j in range(data.num_dense)),
        sparse=tuple(sparse),
        labels=(columns.label,),
        row_id=columns.row_id,
    )


def fit_vocabularies(config: TrainConfig, path: str) -> dict[str, tuple[str, ...]]:
    """The vocabulary of every feature ``config.data.columns.categorical`` encodes by
    ``"vocabulary"``, counted over the Parquet files at ``path`` (:mod:`raytrec.data.vocabulary`).
    """
    from raytrec.data.parquet import ParquetSource
    from raytrec.data.vocabulary import count_categories

    columns = config.data.columns
    wanted = {
        f: columns.features.get(f, f)
        for f, encoding in columns.categorical.items()
        if encoding == "vocabulary"
    }
    if not wanted:
        return {}
    sizes = {f: t.num_embeddings for t in config.model.tables for f in t.features}
    # Listing the files takes a layout; the one without categories will do.
    plain = columns.replace(categorical={})
    listing = ParquetSource(
        paths=path,
        spec=parquet_spec(config.replace(data=config.data.replace(columns=plain))),
    )
    counts = count_categories(*listing.list_files(), wanted)
    return {
        f: fit_vocabulary(counts[f], size=sizes[f] - 1, min_count=config.data.vocabulary_min_count)
        for f in wanted
    }


def generated_rows(config: TrainConfig) -> int:
    """Rows per epoch: ``data.generated_rows``, else so many that ``epochs`` passes take
    ``num_steps`` steps (at least)."""
    if config.data.generated_rows is not None:
        return config.data.generated_rows
    assert config.num_steps is not None  # TrainConfig refuses neither
    steps_per_epoch = math.ceil(config.num_steps / config.data.epochs)
    return steps_per_epoch * config.scaling.world_size * config.data.batch_size


def source_from_config(
    config: TrainConfig, vocabularies: Mapping[str, tuple[str, ...]] | None = None
) -> tuple[BatchSource, DataInfo]:
    """The source ``config.data`` names; writes generated data first when needed.
    ``vocabularies``: those of categorical features (a resumed job's, from its checkpoint);
    None: fitted on the training files."""
    from raytrec.data.parquet import ParquetSource  # Ray Data: only when it is used

    data = config.data
    if data.source == "synthetic":
        return synthetic_source(config), DataInfo(kind="synthetic")
    if data.source == "parquet":
        assert data.path is not None  # DataConfig checks it
        path, oracle = data.path, _oracle_auc(data.path)
    else:
        path, oracle = generate(config)
        # Generated ids span the largest table; a smaller table folds them into its rows.
        config = config.replace(data=data.replace(id_policy="modulo"))
        if data.generated_held_out_rows:
            held_path, held_oracle = generate_held_out(config, path)
    source = ParquetSource(
        paths=path,
        spec=parquet_spec(
            config, fit_vocabularies(config, path) if vocabularies is None else vocabularies
        ),
        epochs=data.epochs,
        shuffle_seed=data.shuffle_seed,
        shuffle_window_rows=data.shuffle_window_rows,
        on_bad_rows=data.on_bad_rows,
        prefetch_batches=data.prefetch_batches,
        read_mode=data.parquet_read,
    )
    info = DataInfo(kind=data.source, path=path, oracle_auc=oracle)
    if data.source == "generated":
        info = dataclasses.replace(info, rows_per_epoch=generated_rows(config))
        if data.generated_held_out_rows:
            info = dataclasses.replace(
                info, held_out_path=held_path, held_out_oracle_auc=held_oracle
            )
    return source, info


def generate(config: TrainConfig) -> tuple[str, float | None]:
    """Writes (or finds) the generated Parquet for ``config``; returns its path and oracle AUC."""
    _refuse_weighted(config)
    data, features = config.data, config.model.features
    if data.num_dense != 13 or any(f != f"cat_{i}" for i, f in enumerate(features)):
        raise ConfigError(
            "data.source='generated' writes Criteo's layout (13 dense columns, sparse features "
            f"cat_0 .. cat_25); the model asks for data.num_dense={data.num_dense} and features "
            f"{list(features)[:4]}...; use data.source='synthetic' or 'parquet'"
        )
    if len(features) > 26:
        raise ConfigError(f"data.source='generated' has 26 sparse features, the model {features}")
    rows = generated_rows(config)
    num_embeddings = max(t.num_embeddings for t in config.model.tables)
    name = f"synthetic-{rows}rows-{min(data.generated_files, rows)}files-{num_embeddings}ids"
    path = data.path or os.path.join(config.storage_path, "data", f"{name}-seed{config.seed}")
    return _generated(config, path, rows=rows, files=data.generated_files, shard=0)


def generate_held_out(config: TrainConfig, train_path: str) -> tuple[str, float | None]:
    """Writes (or finds) the held-out split of generated data (``data.generated_held_out_rows``
    rows of the same teacher, from another row stream) beside ``train_path``."""
    path = f"{train_path.rstrip('/')}-held_out-{config.data.generated_held_out_rows}rows"
    return _generated(config, path, rows=config.data.generated_held_out_rows, files=2, shard=1)


def _generated(
    config: TrainConfig, path: str, *, rows: int, files: int, shard: int
) -> tuple[str, float | None]:
    """Generated rows of ``config``'s teacher at ``path``: found there, or written into a
    temporary directory and renamed into place when complete."""
    from raytrec.data.generate import META_FILE, write_synthetic_parquet

    num_embeddings = max(t.num_embeddings for t in config.model.tables)
    files = min(files, rows)
    meta_path = os.path.join(path, META_FILE)
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        want = {"rows": rows, "seed": config.seed, "num_embeddings": num_embeddings}
        have = {k: meta.get(k) for k in want}
        if have != want or meta.get("shard", 0) != shard:
            raise ConfigError(
                f"data.path={path!r} holds generated data for {have}, this job needs {want}; "
                "choose another data.path or remove it"
            )
        return path, meta.get("oracle_auc")
    if os.path.exists(path) and os.listdir(path):
        raise ConfigError(
            f"data.path={path!r} exists and is not generated data (no {META_FILE}); "
            "choose an empty or new directory"
        )
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".generating-", dir=parent)
    try:
        written = write_synthetic_parquet(
            tmp,
            rows=rows,
            files=files,
            row_groups_per_file=max(1, min(8, rows // files // 8192)),
            seed=config.seed,
            num_embeddings=num_embeddings,
            shard=shard,
        )
        if os.path.isdir(path):
            os.rmdir(path)  # empty, checked above
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    oracle = written.oracle_auc
    return path, None if math.isnan(oracle) else oracle


def _oracle_auc(path: str) -> float | None:
    """The oracle AUC recorded next to generated Parquet, if ``path`` is such a local directory."""
    from raytrec.data.generate import META_FILE

    meta = os.path.join(path, META_FILE)
    if not os.path.isfile(meta):
        return None
    with open(meta) as f:
        value = json.load(f).get("oracle_auc")
    return float(value) if value is not None else None


def held_out(config: TrainConfig, spec: FeatureSpec) -> tuple[BatchShard, EvalPlan]:
    """The held-out shard ``config.eval.path`` names, read by index in the training data's
    layout ``spec`` (its vocabularies included) as one stream (one epoch, file order), and the
    plan of one evaluation."""
    from raytrec.data.parquet import ParquetSource  # Ray Data: only when it is used
    from raytrec.data.parquet_indexed import IndexedParquetShard

    assert config.eval.path is not None
    source = ParquetSource(
        paths=config.eval.path,
        spec=spec,
        epochs=1,
        shuffle_seed=None,
        on_bad_rows=config.data.on_bad_rows,
        read_mode="indexed",
    )
    (shard,) = source.split(1)
    assert isinstance(shard, IndexedParquetShard)
    batch_size = config.eval.batch_size or config.data.batch_size
    plan = shard.plan(batch_size)
    return shard, eval_plan(
        total_rows=plan.rows_per_epoch, batch_size=batch_size, max_rows=config.eval.max_rows
    )
