"""The job's configuration: :class:`TrainConfig` and its sections (:mod:`raytrec.config.train`),
the validation they share (:mod:`~raytrec.config.base`), the model's
(:mod:`~raytrec.config.model`), YAML files and ``--set`` overrides (:mod:`~raytrec.config.file`)
and the reference they are documented by (:mod:`~raytrec.config.file_docs`). The sections of
components live with them (``raytrec.checkpoint.config``, ``raytrec.data.config``,
``raytrec.elastic.config``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raytrec.config.train import (
        RESERVED_TABLE_NAMES,
        WEIGHTS_SUFFIX,
        ColumnsConfig,
        ConfigError,
        DataConfig,
        EvalConfig,
        IdsConfig,
        ModelConfig,
        OptimizerConfig,
        PublishConfig,
        ScalingConfig,
        ShardingConfig,
        SyncConfig,
        TableConfig,
        TestingConfig,
        TrainConfig,
        criteo_tables,
        validate_features,
    )

__all__ = [
    "RESERVED_TABLE_NAMES",
    "WEIGHTS_SUFFIX",
    "ColumnsConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "IdsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PublishConfig",
    "ScalingConfig",
    "ShardingConfig",
    "SyncConfig",
    "TableConfig",
    "TestingConfig",
    "TrainConfig",
    "criteo_tables",
    "validate_features",
]


def __getattr__(name: str) -> Any:
    """``raytrec.config.X`` is ``raytrec.config.train.X``, imported when first asked for: the
    package's other modules are imported by what ``train`` imports, so it cannot import
    ``train`` as it starts."""
    if name in __all__:
        return getattr(importlib.import_module("raytrec.config.train"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
