"""What it takes to rebuild a trained model outside training: its :class:`ModelSpec`.

A model spec is the model config (architecture, tables with their features, layer sizes),
the number of dense features and the row layout (:class:`~raytrec.data.spec.FeatureSpec`) that
turns a Parquet row into the model's inputs. Jobs write it as ``model_spec.json`` into every
checkpoint and into the final model, and an export carries it in ``model.json``, so a model
can be rebuilt from its files alone.

Pure code: JSON in and out, no torch.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
from collections.abc import Mapping
from typing import Any

from raytrec.checkpoint.layout import filesystem
from raytrec.config import ModelConfig, TrainConfig
from raytrec.config.base import validate
from raytrec.config.file import to_dict
from raytrec.data.spec import (
    BucketizedFeature,
    CategoricalFeature,
    Feature,
    FeatureSpec,
    SparseFeature,
)

__all__ = ["MODEL_SPEC", "ModelSpec", "SpecFileError", "read_model_spec", "write_model_spec"]

#: The file holding a checkpoint's or a final model's spec.
MODEL_SPEC = "model_spec.json"
_FORMAT = "raytrec-model-spec"
_FORMAT_VERSION = 1


class SpecFileError(ValueError):
    """A model spec document that cannot be read; the message names where and why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model (DLRM, DLRM-DCN or DeepFM) and the row layout it scores."""

    model: ModelConfig
    num_dense: int
    features: FeatureSpec

    def __post_init__(self) -> None:
        if self.features.num_dense != self.num_dense:
            raise SpecFileError(
                f"ModelSpec.features has {self.features.num_dense} dense columns, "
                f"num_dense is {self.num_dense}"
            )
        missing = sorted(set(self.model.features) - set(self.features.sparse_names))
        if missing:
            raise SpecFileError(f"ModelSpec.features lacks the model's sparse features {missing}")
        by_name = {f.name: f for f in self.features.sparse}
        unweighted = [
            name
            for name in self.model.weights_columns
            if getattr(by_name[name], "weights", None) is None
        ]
        if unweighted:
            raise SpecFileError(
                f"ModelSpec.features has no weights column for the weighted features {unweighted}"
            )

    @staticmethod
    def for_config(config: TrainConfig, num_dense: int) -> ModelSpec:
        """The spec of the model ``config`` trains, with the Parquet layout its ``data.columns``
        name (:func:`~raytrec.data.from_config.parquet_spec`; no vocabularies)."""
        from raytrec.data.from_config import parquet_spec

        if config.data.columns.dense is None and config.data.num_dense != num_dense:
            config = config.replace(data=config.data.replace(num_dense=num_dense))
        features = parquet_spec(config)
        return ModelSpec(model=config.model, num_dense=num_dense, features=features)

    @property
    def kind(self) -> str:
        """The model's class: TorchRec's ``"DLRM"`` or ``"DLRM_DCN"``, or ``"DeepFM"``
        (:class:`raytrec.models.DeepFM`), or ``"TwoTower"``
        (:class:`raytrec.models.two_tower.TwoTower`)."""
        kinds = {
            "dlrm": "DLRM",
            "dlrm_dcn": "DLRM_DCN",
            "deepfm": "DeepFM",
            "two_tower": "TwoTower",
        }
        return kinds[self.model.arch]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "format_version": _FORMAT_VERSION,
            "model_kind": self.kind,
            "model": to_dict(self.model),
            "num_dense": self.num_dense,
            "features": _features_to_dict(self.features),
        }

    @staticmethod
    def from_dict(doc: Any, *, where: str) -> ModelSpec:
        if not isinstance(doc, Mapping) or doc.get("format") != _FORMAT:
            raise SpecFileError(f"{where} is not a {_FORMAT} document")
        if doc.get("format_version") != _FORMAT_VERSION:
            raise SpecFileError(
                f"{where} has format_version {doc.get('format_version')!r}; this raytrec reads "
                f"{_FORMAT_VERSION}"
            )
        try:
            return ModelSpec(
                model=validate(ModelConfig, doc["model"]),
                num_dense=int(doc["num_dense"]),
                features=_features_from_dict(doc["features"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SpecFileError(
                f"{where} lacks or mistypes a field ({type(e).__name__}: {e})"
            ) from None


def _features_to_dict(spec: FeatureSpec) -> dict[str, Any]:
    kinds = {
        SparseFeature: "ids",
        BucketizedFeature: "bucketized",
        CategoricalFeature: "categorical",
    }
    sparse = [
        {
            "kind": kinds[type(f)],
            **{k: v for k, v in dataclasses.asdict(f).items() if k != "vocabulary_sha256"},
        }
        for f in spec.sparse
    ]
    return {
        "dense": list(spec.dense),
        "sparse": sparse,
        "labels": list(spec.labels),
        "row_id": spec.row_id,
    }


def _features_from_dict(doc: Mapping[str, Any]) -> FeatureSpec:
    sparse: list[Feature] = []
    for item in doc["sparse"]:
        fields = {k: v for k, v in item.items() if k != "kind"}
        if item["kind"] == "ids":
            sparse.append(SparseFeature(**fields))
        elif item["kind"] == "bucketized":
            sparse.append(BucketizedFeature(**fields))
        elif item["kind"] == "categorical":
            sparse.append(CategoricalFeature(**fields))
        else:
            raise ValueError(
                f"sparse feature kind {item['kind']!r} is not 'ids', 'bucketized' or 'categorical'"
            )
    return FeatureSpec(
        dense=tuple(doc["dense"]),
        sparse=tuple(sparse),
        labels=tuple(doc["labels"]),
        row_id=doc["row_id"],
    )


def write_model_spec(directory: str, spec: ModelSpec) -> None:
    """Writes ``spec`` as ``<directory>/model_spec.json`` (a local path or an fsspec URI)."""
    fs, path = filesystem(directory)
    fs.pipe_file(posixpath.join(path, MODEL_SPEC), json.dumps(spec.to_dict(), indent=1).encode())


def read_model_spec(directory: str) -> ModelSpec | None:
    """The spec in ``<directory>/model_spec.json``; None when there is none (a checkpoint or a
    final model written before jobs recorded it)."""
    fs, path = filesystem(directory)
    file = posixpath.join(path, MODEL_SPEC)
    if not fs.exists(file):
        return None
    where = f"{directory.rstrip('/')}/{MODEL_SPEC}"
    try:
        doc = json.loads(fs.cat_file(file))
    except ValueError as e:
        raise SpecFileError(f"{where} is not valid JSON ({e})") from None
    return ModelSpec.from_dict(doc, where=where)
