"""What :func:`~raytrec.api.fit` checks on the driver before any rank actor starts.

A checkpoint to resume from, held-out data where the config needs it, a job length that is
known, GPUs on this machine, the cluster's capacity, and the device memory the sharding plan
may fill: each refusal is a :class:`~raytrec.errors.ConfigError` naming the config key.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import ray
import ray.exceptions
import torch

from raytrec.cluster.capacity import NodeShape, capacity_refusal
from raytrec.config import ConfigError, TrainConfig
from raytrec.data.length import endless_refusal
from raytrec.data.parquet import ParquetSource
from raytrec.data.source import BatchSource

__all__ = [
    "CapacityUnknownWarning",
    "check_capacity",
    "check_checkpoint",
    "check_eval_is_there",
    "check_gpus_here",
    "check_length_known",
    "check_same_data",
    "device_memory",
    "indexed_resume_shards",
    "vocabularies_of",
]


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


def check_checkpoint(uri: str, config: TrainConfig) -> None:
    """A missing, partial or incompatible checkpoint fails here, before any actor starts."""
    import posixpath

    from raytrec.checkpoint.errors import CheckpointError
    from raytrec.checkpoint.layout import MARKER, filesystem, read_manifest
    from raytrec.checkpoint.manifest import check_compatible, signature_for
    from raytrec.serving.export import STATE_FILE

    fs, path = filesystem(uri)
    if fs.exists(posixpath.join(path, STATE_FILE)) and not fs.exists(posixpath.join(path, MARKER)):
        raise CheckpointError(
            f"{uri} is a raytrec.export directory (the model unsharded, without optimizer "
            "state), not a checkpoint: a job starts from a checkpoint directory; pass the "
            "checkpoint the export was made from"
        )
    manifest = read_manifest(uri)
    # Tables and optimizers here; each rank checks its dense shapes too before loading.
    expected = signature_for(config, manifest.signature.dense_params)
    check_compatible(manifest.signature, expected, where=uri)


def growing_config(config: TrainConfig) -> TrainConfig:
    """A growing source's job (``data.growing``) trains every row of every file it finds, so
    its length is the data's: ``num_steps`` must be null (it resolves to the steps of the files
    there at the start). ``data.path`` becomes absolute: the coordinator lists it in a process
    of its own, perhaps in another working directory."""
    if config.num_steps is not None:
        raise ConfigError(
            f"num_steps={config.num_steps} with data.growing: the job trains every row of every "
            "file it finds, so set num_steps: null (jobs.train: --set num_steps=null) and end "
            "it with data.growing.max_files, data.growing.idle_stop_s or a stop request"
        )
    path = config.data.path
    if path and "://" not in path:
        config = config.replace(data=config.data.replace(path=os.path.abspath(path)))
    return config


def check_same_data(uri: str, fingerprint: dict[str, Any] | None, *, growing: bool = False) -> None:
    """A resume continues the saved job's data position, so its data must be the data the
    saved job read: refused, naming each file added, removed or changed, when the checkpoint's
    fingerprint (:mod:`raytrec.data.fingerprint`) differs from ``fingerprint``, this job's.
    A checkpoint saved without one is not checked. ``growing`` (``data.growing``): files may
    have been added, and every file the saved job had found must still be there."""
    from raytrec.checkpoint.layout import read_manifest
    from raytrec.data.fingerprint import changes_line, data_changes

    extra = read_manifest(uri).extra
    saved = extra.get("data")
    if not saved:
        return
    changes = data_changes(saved, fingerprint, growing=growing)
    table = (extra.get("accounting") or {}).get("streams_table") or {}
    if growing and fingerprint is not None and "files" in table:
        there = {f["path"] for f in fingerprint.get("files", ())}
        changes += [f"file removed: {p}" for p in table["files"]["paths"] if p not in there]
    if changes:
        raise ConfigError(
            f"{uri} cannot be resumed on this data: it continues the saved job's position in "
            f"its data, and the data changed ({changes_line(changes)}); restore those files, or "
            "start a new run from its model with fit(..., init_from=...) (jobs.train --init-from)"
        )


def check_eval_is_there(config: TrainConfig) -> None:
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


def check_length_known(config: TrainConfig, source: BatchSource | None) -> None:
    """``num_steps=None`` needs a source with an end, known before Ray is touched."""
    if config.num_steps is not None:
        return
    if source is not None and not isinstance(source, ParquetSource):
        raise ConfigError(endless_refusal(f"the source {type(source).__name__}"))
    if source is None and config.data.source == "synthetic":
        raise ConfigError(endless_refusal("data.source='synthetic' (rows made in each rank)"))


def check_gpus_here(config: TrainConfig, ray_address: str | None) -> None:
    """A GPU job with no cluster to join runs on an embedded cluster of this machine: refused
    before Ray starts when this machine has no GPU."""
    embedded = not ray.is_initialized() and not (ray_address or os.environ.get("RAY_ADDRESS"))
    if config.scaling.use_gpu and embedded and torch.cuda.device_count() == 0:
        raise ConfigError(
            "scaling.use_gpu=True (--gpu) needs GPUs, and this machine has none: without "
            "RAY_ADDRESS the job runs on an embedded cluster of this machine; drop --gpu, or "
            "set RAY_ADDRESS to a cluster with GPU nodes"
        )


def indexed_resume_shards(uri: str, config: TrainConfig, source: BatchSource) -> int | None:
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
            f"{ranks}) to continue on the same rows, or start a new run from its model with "
            "fit(..., init_from=...) (jobs.train --init-from)"
        )
    return saved


def vocabularies_of(checkpoint: str | None) -> dict[str, tuple[str, ...]] | None:
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


#: How long the driver waits for a GPU of the cluster to say how much memory it has.
_DEVICE_MEMORY_WAIT_S = 120.0


def device_memory(config: TrainConfig) -> int | None:
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
