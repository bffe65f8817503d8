"""A trained model as one unsharded TorchRec module: export it, load it, score batches.

:func:`export` reads any model a job writes (a committed checkpoint, or the final model) with
torch.distributed.checkpoint's offline path (no process group): for each tensor it reads every
saved shard that overlaps the whole tensor, so embedding tables come out full-size whatever the
gang size and sharding plan were. It writes, into one directory:

* ``model.pt``: the state dict of a plain ``DLRM`` / ``DLRM_DCN`` / raytrec's DeepFM (TorchRec's
  own names, ``sparse_arch.embedding_bag_collection.embedding_bags.<table>.weight``, ...), plain
  tensors (``torch.load(..., weights_only=True)`` reads it);
* ``model.pt2`` (unless ``program=False``): the same model in eval mode as a ``torch.export``
  program, ``(dense [B, num_dense], KeyedJaggedTensor) -> logits [B, 1]`` for any ``B >= 1``;
* ``model.json``, written last: the model spec (config, number of dense features, the row
  layout), where it came from, and every tensor's shape.

:func:`load_model` rebuilds the module in one process, with no Ray and no process group.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import pyarrow as pa
import ray.train
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from raytrec.checkpoint.errors import CheckpointError
from raytrec.checkpoint.layout import MANIFEST, MARKER, filesystem, read_manifest
from raytrec.checkpoint.storage import storage_reader
from raytrec.config import TrainConfig
from raytrec.data.arrow_kjt import to_batch
from raytrec.data.source import Batch
from raytrec.data.spec import FeatureSpec
from raytrec.models import build_model as build_arch
from raytrec.serving.deltas import apply_deltas
from raytrec.serving.model_spec import ModelSpec, read_model_spec
from raytrec.serving.raw_ids import attach_maps, read_maps, split_maps

__all__ = [
    "ExportedModel",
    "SourceKind",
    "export",
    "load_exported",
    "load_model",
    "make_batch",
    "quiet_notices",
    "read_unsharded_state",
    "score",
]

FORMAT = "raytrec-model"
FORMAT_VERSION = 1
MODEL_JSON = "model.json"
STATE_FILE = "model.pt"
PROGRAM_FILE = "model.pt2"

#: What a directory holds: a periodic checkpoint, the final model of a job, or an export.
SourceKind = Literal["checkpoint", "final_model", "export"]

# The model inside the state dicts a job saves: DLRMTrain's ``model.``; a checkpoint nests the
# model's state dict under ``model.`` once more.
_PREFIX: dict[str, str] = {"checkpoint": "model.model.", "final_model": "model."}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportedModel:
    """An export on disk: where, the model spec, and the step it was trained to (when known)."""

    path: str
    spec: ModelSpec
    step: int | None
    source: str
    source_kind: SourceKind
    program: str | None  # model.pt2's path, or None
    program_error: str | None = None  # why there is no program, when one was asked for

    def line(self) -> str:
        """What was exported where, in one line."""
        step = "" if self.step is None else f" (step {self.step})"
        program = ", model.pt2" if self.program is not None else ""
        if self.program_error is not None:
            program = f"; no model.pt2: {self.program_error}"
        return (
            f"[raytrec] exported {self.source_kind} {self.source}{step} to {self.path}: "
            f"model.pt, model.json{program}"
        )


class _DropRecords(logging.Filter):
    """Drops log records whose message starts with one of ``starts``."""

    def __init__(self, *starts: str) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


#: Notices of the pinned stack that an export or a load prints and that say nothing a user can
#: act on: TorchRec's KeyedJaggedTensor warns (on the root logger) whenever ``to_dict`` is traced
#: by a non-strict ``torch.export`` (the cost it means, once per export, is in docs/serving.md),
#: and torch.fx's ``is_fx_tracing`` deprecation notice (logged by its own module's logger).
_EXPORT_NOTICES = _DropRecords("Trying to non-strict torch.export KJT to_dict")
_FX_NOTICES = _DropRecords("is_fx_tracing will return true")


@contextmanager
def quiet_notices() -> Iterator[None]:
    """While it lasts, the pinned stack's notices above and its known warnings are not shown."""
    root, fx = logging.getLogger(), logging.getLogger("torch.fx._symbolic_trace")
    root.addFilter(_EXPORT_NOTICES)
    fx.addFilter(_FX_NOTICES)
    # torch.fx logs its notice once per process (lru_cache), from whichever call asks first,
    # a model's forward too: asked here, while it is filtered, it is spent.
    import torch.fx._symbolic_trace as symbolic_trace

    notice = getattr(symbolic_trace, "is_fx_tracing_warning", None)
    try:
        if notice is not None:
            notice()
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*Please use DTensor instead", category=Warning
            )
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled", category=Warning
            )
            yield
    finally:
        root.removeFilter(_EXPORT_NOTICES)
        fx.removeFilter(_FX_NOTICES)


def _location(checkpoint: Any) -> tuple[str, TrainConfig | None]:
    """A path or URI from a path, a ``ray.train.Checkpoint`` or a :class:`Result` (its final
    model, with its config)."""
    config = getattr(checkpoint, "config", None)
    if isinstance(config, TrainConfig) and hasattr(checkpoint, "final_state_path"):
        if checkpoint.final_state_path is None:
            raise CheckpointError("the result has no final model (final_state_path is None)")
        return str(checkpoint.final_state_path), config
    if isinstance(checkpoint, ray.train.Checkpoint):  # refuses os.fspath()
        return str(checkpoint.path), None
    return os.fspath(checkpoint), None


def source_kind(uri: str) -> SourceKind:
    """Which of the formats raytrec writes lives at ``uri``; a :class:`CheckpointError` when
    none does."""
    fs, path = filesystem(uri)
    if not fs.isdir(path):
        raise CheckpointError(f"no model at {uri}: the directory does not exist")
    if fs.exists(posixpath.join(path, MODEL_JSON)):
        return "export"
    # A checkpoint's directory name says what it is even when its save never finished.
    named = re.match(r"^\.?checkpoint_\d+", posixpath.basename(path.rstrip("/"))) is not None
    if named or any(fs.exists(posixpath.join(path, f)) for f in (MANIFEST, MARKER)):
        return "checkpoint"
    if fs.exists(posixpath.join(path, ".metadata")):
        return "final_model"
    raise CheckpointError(
        f"{uri} holds no model raytrec wrote: no {MODEL_JSON} (an export), no {MANIFEST} (a "
        "checkpoint) and no .metadata (a final model)"
    )


def read_unsharded_state(uri: str) -> tuple[dict[str, torch.Tensor], int | None, SourceKind]:
    """The model's full state dict from a checkpoint or a final model, under TorchRec's names,
    read in this process with no process group; with the checkpoint's step (None for a final
    model) and the kind of source. A checkpoint is verified first (commit marker, manifest,
    file sizes)."""
    kind = source_kind(uri)
    if kind == "export":
        raise CheckpointError(f"{uri} is an export already; load it with load_model()")
    step = read_manifest(uri).step if kind == "checkpoint" else None
    prefix = _PREFIX[kind]
    try:
        md = storage_reader(uri).read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"{uri} is corrupt: its DCP metadata (.metadata) cannot be read ({e})"
        ) from None
    state: dict[str, Any] = {}
    for key, entry in md.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata):
            state[key] = torch.empty(list(entry.size), dtype=entry.properties.dtype)
    if not state:
        raise CheckpointError(f"{uri} holds no tensors under {prefix!r}: not a DLRMTrain model")
    with quiet_notices():
        try:
            # Each full-size target gathers every saved shard that overlaps it.
            dcp.load(state, storage_reader=storage_reader(uri), no_dist=True)
        except Exception as e:
            raise CheckpointError(f"{uri} is corrupt: reading its tensors failed ({e})") from None
    return {k[len(prefix) :]: v for k, v in state.items()}, step, kind


def _infer_num_dense(state: Mapping[str, torch.Tensor], where: str, arch: str) -> int:
    key = "dense_arch.model._mlp.0._linear.weight"
    if key in state:
        return int(state[key].shape[1])
    if arch == "deepfm":  # a DeepFM without dense features has no dense arch
        return 0
    raise CheckpointError(f"{where} has no {key!r}: not a {arch} model")


def _resolve_spec(
    uri: str,
    state: Mapping[str, torch.Tensor],
    config: TrainConfig | None,
    *,
    fallback: TrainConfig | None = None,
) -> ModelSpec:
    """The caller's ``config``; else the saved spec, which holds the row layout trained on
    (column names, vocabularies) that a config alone does not; else ``fallback`` (a
    Result's config)."""
    if config is None:
        spec = read_model_spec(uri)
        if spec is not None:
            return spec
        config = fallback
    if config is not None:
        return ModelSpec.for_config(config, _infer_num_dense(state, uri, config.model.arch))
    raise CheckpointError(
        f"{uri} holds no model spec (model_spec.json; written by jobs since raytrec "
        "recorded it): pass config=, the TrainConfig it was trained with"
    )


def build_model(spec: ModelSpec, state: Mapping[str, torch.Tensor], *, where: str) -> nn.Module:
    """The unsharded model of ``spec`` holding ``state``, in eval mode on the CPU; with managed
    tables, holding their maps too (``managed_ids.*`` in ``state``), so it takes raw ids."""
    state, maps = split_maps(state)
    model = build_arch(spec.model, spec.num_dense, torch.device("cpu"), seed=0)
    expected = model.state_dict()
    problems = [f"{k!r} missing" for k in expected if k not in state]
    problems += [f"{k!r} not in the model" for k in state if k not in expected]
    problems += [
        f"{k!r} has shape {list(state[k].shape)}, the model {list(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if problems:
        raise CheckpointError(f"{where} does not fit its model spec: {'; '.join(problems)}")
    model.load_state_dict(dict(state), strict=True, assign=True)  # embeddings were on meta
    return attach_maps(model, spec.model, maps, where=where).eval()


def export(
    checkpoint: Any,
    path: str | os.PathLike[str],
    *,
    config: TrainConfig | None = None,
    program: bool = True,
    quiet: bool = False,
) -> ExportedModel:
    """Writes the model in ``checkpoint`` unsharded into the new directory ``path``, and
    prints one line saying what it wrote where (not with ``quiet``).

    ``checkpoint``: a checkpoint directory or URI (``Result.checkpoint``, a
    ``ray.train.Checkpoint``, or ``checkpoint_<step>`` under a run's ``checkpoints/``), a final
    model (``Result.final_state_path``), or a :class:`~raytrec.api.Result` (its final model).
    ``config``: the job's :class:`TrainConfig`, needed only for a model saved without
    ``model_spec.json`` (given, it is used instead of the saved spec). ``program``: also write
    ``model.pt2`` (a ``torch.export`` program).
    """
    uri, result_config = _location(checkpoint)
    out = os.fspath(path)
    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"export path {out} exists and is not empty")
    state, step, kind = read_unsharded_state(uri)
    spec = _resolve_spec(uri, state, config, fallback=result_config)
    model = build_model(spec, {**state, **read_maps(uri)}, where=uri)
    os.makedirs(out, exist_ok=True)
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, _in(out, STATE_FILE))
    program_path, program_error = None, None
    if program:
        try:
            _write_program(model, spec, _in(out, PROGRAM_FILE))
            program_path = _in(out, PROGRAM_FILE)
        except Exception as e:  # the state dict serves; say why there is no program
            program_error = f"{type(e).__name__}: {e}"
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "base_id": uuid.uuid4().hex,  # what deltas published beside this export name
        "spec": spec.to_dict(),
        "source": {"uri": uri, "kind": kind, "step": step},
        "state_dict": {k: list(v.shape) for k, v in model.state_dict().items()},
        "program": None if program_path is None else PROGRAM_FILE,
        "program_error": program_error,
    }
    with open(_in(out, MODEL_JSON), "w") as f:  # last: a directory without it is no export
        json.dump(doc, f, indent=1)
    done = ExportedModel(
        path=out,
        spec=spec,
        step=step,
        source=uri,
        source_kind=kind,
        program=program_path,
        program_error=program_error,
    )
    if not quiet:
        print(done.line(), flush=True)
    return done


def _in(directory: str, name: str) -> str:
    return os.path.join(directory, name)


def example_batch(spec: ModelSpec, batch_size: int = 4) -> Batch:
    """A small batch laid out like ``spec``'s rows (every id 0, one per feature and row)."""
    keys = list(spec.features.sparse_names)
    lengths = torch.ones(len(keys) * batch_size, dtype=torch.int32)
    num_ids = int(lengths.sum())
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.zeros(num_ids, dtype=torch.int64),
        weights=torch.ones(num_ids) if spec.model.is_weighted else None,
        lengths=lengths,
    )
    return Batch(torch.zeros(batch_size, spec.num_dense), kjt, torch.zeros(batch_size))


def _write_program(model: nn.Module, spec: ModelSpec, file: str) -> None:
    """``torch.export`` of the eval model with a dynamic batch size and number of ids."""
    from torch.export import Dim

    batch = example_batch(spec)
    # The KeyedJaggedTensor flattens to (values, weights, lengths, offsets, stride per key per
    # rank, inverse indices); values, weights (when there are any) and lengths vary with the
    # batch.
    auto = {0: Dim.AUTO}
    weights = auto if spec.model.is_weighted else None
    dynamic = (auto, [auto, weights, auto, None, None, None])
    # Size-oblivious: a batch of one row takes the same graph (else sizes 0 and 1 are
    # specialized away and the program refuses B = 1).
    from torch.fx.experimental import _config as fx_config

    oblivious = fx_config.patch(backed_size_oblivious=True)  # type: ignore[attr-defined]
    with quiet_notices(), torch.no_grad(), oblivious:
        program = torch.export.export(
            model,
            (batch.dense_features, batch.sparse_features),
            dynamic_shapes=dynamic,
            strict=False,
        )
    torch.export.save(program, file)


def _read_doc(path: str) -> dict[str, Any]:
    file = _in(path, MODEL_JSON)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} is not an export: it has no {MODEL_JSON}")
    with open(file) as f:
        doc = json.load(f)
    if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{file} is not a {FORMAT} document of format_version {FORMAT_VERSION}"
        )
    return dict(doc)


def base_id(path: str | os.PathLike[str]) -> str:
    """The id deltas of the export at ``path`` name it by: ``model.json``'s ``base_id``, or
    (an export written before there were deltas) the sha256 of ``model.json``."""
    out = os.fspath(path)
    recorded = _read_doc(out).get("base_id")
    if recorded is not None:
        return str(recorded)
    with open(_in(out, MODEL_JSON), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_exported(path: str | os.PathLike[str]) -> tuple[nn.Module, ExportedModel]:
    """:func:`load_model`, with what ``model.json`` says about the export (its ``step`` the
    last applied delta's, when there are deltas)."""
    out = os.fspath(path)
    doc = _read_doc(out)
    spec = ModelSpec.from_dict(doc["spec"], where=_in(out, MODEL_JSON))
    state = torch.load(_in(out, STATE_FILE), map_location="cpu", weights_only=True)
    last = apply_deltas(out, state, base_id(out))
    with quiet_notices():
        model = build_model(spec, state, where=out)
    source = doc["source"]
    info = ExportedModel(
        path=out,
        spec=spec,
        step=source["step"] if last is None else last.step,
        source=source["uri"],
        source_kind=source["kind"],
        # The program holds the base's weights, not the deltas'.
        program=None if doc["program"] is None or last is not None else _in(out, doc["program"]),
        program_error=doc["program_error"],
    )
    return model, info


def load_model(path: str | os.PathLike[str]) -> nn.Module:
    """The exported model, with its published deltas (``deltas/``) applied in order, as a
    plain TorchRec ``DLRM`` / ``DLRM_DCN`` (or raytrec's
    :class:`~raytrec.models.DeepFM` of TorchRec's parts) in eval mode on the CPU:
    ``model(dense, kjt)`` gives logits ``[B, 1]`` (:func:`score` gives probabilities). One
    process, no Ray, no process group."""
    return load_exported(path)[0]


def load_program(path: str | os.PathLike[str]) -> nn.Module:
    """``model.pt2`` of an export as a callable module: ``(dense, kjt) -> logits``."""
    with quiet_notices(), torch.serialization.safe_globals([KeyedJaggedTensor]):
        return torch.export.load(_in(os.fspath(path), PROGRAM_FILE)).module()


def make_batch(
    rows: pa.Table | pa.RecordBatch | Any,
    spec: ModelSpec | FeatureSpec,
) -> tuple[Batch, Any]:
    """A batch for the model from rows in raytrec's Parquet schema (a pyarrow Table or record
    batch, a pandas DataFrame, or a list of dicts), converted by the training path's own
    Arrow-to-KeyedJaggedTensor conversion; with the rows' ids (numpy, or None without a
    row-id column). Rows without a label column get label 0."""
    features = spec.features if isinstance(spec, ModelSpec) else spec
    table = _as_table(rows)
    for label in features.labels:
        if label not in table.column_names:
            table = table.append_column(label, pa.array([0.0] * table.num_rows, pa.float32()))
    if features.row_id is not None and features.row_id not in table.column_names:
        features = dataclasses.replace(features, row_id=None)
    batch, report = to_batch(table, features)
    return batch, report.row_ids


def _as_table(rows: Any) -> pa.Table | pa.RecordBatch:
    if isinstance(rows, pa.Table | pa.RecordBatch):
        return rows
    if isinstance(rows, Sequence):
        return pa.Table.from_pylist(list(rows))
    return pa.Table.from_pandas(rows, preserve_index=False)  # a pandas DataFrame


def score(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Click probabilities ``[B]`` of ``model`` on ``batch``, without gradients: the sigmoid
    of the logits in float64, as the metrics take it (float32 would tie scores that differ)."""
    with torch.no_grad():
        logits = model(batch.dense_features, batch.sparse_features)
    return torch.sigmoid(logits.reshape(-1).double())


@contextmanager
def exported(checkpoint: Any, *, config: TrainConfig | None = None) -> Iterator[str]:
    """An export of ``checkpoint``: the directory itself when it is one, else a temporary
    export (without a program) removed on exit."""
    uri, _ = _location(checkpoint)
    if source_kind(uri) == "export":
        yield uri
        return
    tmp = tempfile.mkdtemp(prefix="raytrec-export-")
    try:
        export(checkpoint, os.path.join(tmp, "model"), config=config, program=False, quiet=True)
        yield os.path.join(tmp, "model")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
