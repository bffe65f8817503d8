"""Saving and loading one gang's training state with torch.distributed.checkpoint (DCP).

**Save** is a collective over one gang's world (the default process group in
a rank process): every rank of that gang calls :func:`save_checkpoint`, the
other gangs do not. Each rank writes its own embedding shards and their fused
optimizer state once; the dense parameters and dense optimizer state, the
same on every rank, are written once by DCP's de-duplication; each rank adds
its random state. Rank 0 of the gang then lists the files, writes the
manifest and commits (:class:`~raytrec.checkpoint.layout.CheckpointStore`).

**Load** (:func:`load_checkpoint`) is a collective over a gang too, and every
gang of a job may load the same checkpoint. The gang may have another size
and another sharding plan than the one that saved: DCP reads, for each local
shard of the new plan, the overlapping pieces of the saved shards. Row-wise
optimizer state whose size depends on the number of column blocks is
converted (:mod:`raytrec.checkpoint.reshard`).

Nothing live is overwritten until everything that can be checked before the
read has been checked on every rank of the gang (they agree through an
all-gather, and through DCP's planning step): the manifest against this model,
the DCP metadata against every live tensor's shape, and the header of every
tensor record the rank will read (:class:`~raytrec.checkpoint.reader.DirectReader`).
DCP then reads the tables, their fused optimizer state and the dense parameters
straight into the live storage, with no second copy of the state; the dense
optimizer's state, the random state and row-wise state laid out for another
plan are read into fresh tensors first. A read that fails after the checks (an
I/O error, a file cut short after them) raises on every rank and leaves the
rank's state partly loaded.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from raytrec.checkpoint.collective import agree, describe, on_rank0
from raytrec.checkpoint.config import CheckpointConfig
from raytrec.checkpoint.errors import CheckpointError
from raytrec.checkpoint.layout import (
    CheckpointRef,
    CheckpointStore,
    PendingCheckpoint,
    data_files,
    read_manifest,
)
from raytrec.checkpoint.manifest import (
    Manifest,
    ModelSignature,
    TableShard,
    check_compatible,
    signature_for,
)
from raytrec.checkpoint.reader import DirectReader
from raytrec.checkpoint.reshard import convert_rowwise_state
from raytrec.checkpoint.storage import storage_reader, storage_writer
from raytrec.engine.dense_optimizer import initial_state
from raytrec.serving.model_spec import write_model_spec

if TYPE_CHECKING:
    from raytrec.engine.rank_engine import RankEngine

__all__ = [
    "LoadedCheckpoint",
    "load_checkpoint",
    "save_checkpoint",
]

WriterFactory = Callable[[str], StorageWriter]
ReaderFactory = Callable[[str], StorageReader]


@contextmanager
def _quiet_sharded_tensor() -> Iterator[None]:
    # TorchRec's state dicts are ShardedTensors; torch marks the type as deprecated on use.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Please use DTensor instead", category=Warning)
        yield


# -- what is saved --------------------------------------------------------------------


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random generators as tensors (no pickles in the checkpoint)."""

    def as_bytes(obj: Any) -> torch.Tensor:
        return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).clone()

    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out = {
        "torch": torch.get_rng_state(),
        "python": as_bytes([version, list(internal), gauss]),
        "numpy": as_bytes([name, np.asarray(keys).tolist(), pos, has_gauss, cached]),
    }
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def _set_rng_state(state: Mapping[str, torch.Tensor], device: torch.device) -> None:
    def from_bytes(t: torch.Tensor) -> Any:
        return json.loads(bytes(t.numpy().tobytes()).decode())

    torch.set_rng_state(state["torch"])
    version, internal, gauss = from_bytes(state["python"])
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = from_bytes(state["numpy"])
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _training_state(engine: RankEngine) -> dict[str, Any]:
    """The DCP state dict of one rank; every tensor in it is a view of live state (a UVM-cached
    table's rows written back first: TorchRec's state dict hook does it too, this does not rely
    on it)."""
    engine.write_back_caches()
    state = {
        "model": engine.model.state_dict(),
        "embedding_optimizer": engine.model.fused_optimizer.state_dict(),
        "dense_optimizer": engine.dense_optimizer.state_dict(),
        "rng": {f"rank{engine.spec.gang_rank}": _rng_state(engine.device)},
    }
    if engine.state.ids is not None:
        # The managed ids' maps: the same on every rank (DCP writes them once), and the same
        # for any shape of the job, so a resume on another shape reads them as they are.
        state["managed_ids"] = engine.state.ids.named_state()
    counters = engine.embedding_step_counters()
    if counters:
        # FBGEMM's step counters (fused Adam's bias correction): TorchRec's fused optimizer
        # state does not hold them. One int64 per table-batched kernel of this rank.
        state["embedding_steps"] = {
            f"rank{engine.spec.gang_rank}": torch.cat([c.detach().cpu().view(1) for c in counters])
        }
    return state


def _table_of(key: str) -> str:
    """``...embedding_bags.<table>.weight`` -> ``<table>``."""
    return key.split(".")[-2]


def _table_shards(model_state: Mapping[str, Any]) -> dict[str, list[TableShard]]:
    """Every table's global shard layout, read from its ShardedTensor's metadata."""
    out = {}
    for key, value in model_state.items():
        if isinstance(value, ShardedTensor):
            out[_table_of(key)] = [
                TableShard(
                    row_offset=m.shard_offsets[0],
                    col_offset=m.shard_offsets[1],
                    rows=m.shard_sizes[0],
                    cols=m.shard_sizes[1],
                )
                for m in sorted(
                    value.metadata().shards_metadata,
                    key=lambda m: (m.shard_offsets[1], m.shard_offsets[0]),
                )
            ]
    return out


def _signature(engine: RankEngine, model_state: Mapping[str, Any] | None = None) -> ModelSignature:
    shapes = {name: tuple(p.shape) for name, p in engine.dense_params.items()}
    shards = _table_shards(model_state) if model_state is not None else None
    return signature_for(engine.cfg, shapes, shards)


# -- save --------------------------------------------------------------------------------


def save_checkpoint(
    engine: RankEngine,
    store: CheckpointStore | str,
    *,
    generation: int,
    extra: Mapping[str, Any] | None = None,
    num_to_keep: CheckpointConfig | int | None = None,
    num_gangs: int | None = None,
    writer_factory: WriterFactory = storage_writer,
) -> CheckpointRef:
    """Writes ``engine``'s training state as the checkpoint of step ``engine.step``.

    A collective over the gang: every rank of ONE gang calls it (the other
    gangs do not). ``extra`` is any JSON-able dict (data position,
    accounting), returned as is by :func:`load_checkpoint`. After the commit,
    the checkpoints retention does not keep are removed (``num_to_keep``: a
    :class:`CheckpointConfig`, or an int keeping the newest that many; None
    keeps all). Returns the committed checkpoint on every rank of the gang; raises
    :class:`CheckpointError` on every rank if any part failed, in which case
    nothing new is visible.
    """
    store = store if isinstance(store, CheckpointStore) else CheckpointStore(store)
    extra = dict(extra or {})
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra must be JSON-serialisable: {e}") from None
    step = engine.step
    pending: PendingCheckpoint = on_rank0(lambda: store.begin(step))
    with _quiet_sharded_tensor():
        state = _training_state(engine)
        try:
            dcp.save(state, storage_writer=writer_factory(pending.write_uri))
        except (Exception, CheckpointException) as e:
            raise CheckpointError(
                f"writing checkpoint {pending.final_uri} failed: {describe(e)}"
            ) from None
        signature = _signature(engine, state["model"])

    def commit() -> CheckpointRef:
        # Before the manifest, which lists it with its size: what rebuilds the model elsewhere.
        write_model_spec(pending.write_uri, engine.spec.model_spec())
        manifest = Manifest(
            step=step,
            generation=generation,
            gang_size=engine.spec.gang_size,
            num_gangs=num_gangs if num_gangs is not None else engine.cfg.scaling.num_gangs,
            sharding_type=engine.cfg.sharding.sharding_type,
            signature=signature,
            files=data_files(pending.write_uri),
            extra=extra,
            created_unix=time.time(),
        )
        ref = store.commit(pending, manifest)
        store.prune(num_to_keep)
        return ref

    return on_rank0(commit)


# -- load ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadedCheckpoint:
    """What a load restored, and the caller's data from the save."""

    uri: str
    step: int
    generation: int
    extra: Mapping[str, Any]
    manifest: Manifest


@dataclasses.dataclass(kw_only=True)
class _RowwiseFix:
    live: ShardedTensor
    saved_full: torch.Tensor  # read from the checkpoint in its saved layout
    table: str
    live_blocks: list[tuple[int, int]]  # this model's (column offset, width) blocks
    converted: torch.Tensor | None = None


@dataclasses.dataclass(kw_only=True)
class _Targets:
    """What DCP reads into (live tensors, and fresh ones for what needs a step after the read),
    and where the fresh ones go once all reads succeeded."""

    state: dict[str, Any]
    rowwise: list[_RowwiseFix]
    dense_optimizer: dict[str, dict[str, torch.Tensor]]
    rng: dict[str, torch.Tensor]
    # The saved rank's fused-optimizer step counters; None: the checkpoint holds none.
    embedding_steps: torch.Tensor | None = None


def _saved_tensor(md: Metadata, key: str, where: str) -> TensorStorageMetadata:
    entry = md.state_dict_metadata.get(key)
    if entry is None:
        raise CheckpointError(f"checkpoint {where} does not hold {key!r}, which this model has")
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointError(f"checkpoint {where}: {key!r} is not a tensor")
    return entry


def _global_size(value: torch.Tensor) -> list[int]:
    return list(value.size())


def _build_targets(engine: RankEngine, md: Metadata, manifest: Manifest, uri: str) -> _Targets:
    targets = _Targets(state={}, rowwise=[], dense_optimizer={}, rng={})

    def size_mismatch(key: str, saved: list[int], expected: list[int]) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {uri}: {key!r} has shape {saved} saved, {expected} expected"
        )

    # Model: sharded embedding tables and dense parameters.
    model_state: dict[str, Any] = {}
    live_model = engine.model.state_dict()
    for key, value in live_model.items():
        entry = _saved_tensor(md, f"model.{key}", uri)
        if list(entry.size) != _global_size(value):
            raise size_mismatch(f"model.{key}", list(entry.size), _global_size(value))
        model_state[key] = value  # read in place
    unknown = sorted(
        k[len("model.") :]
        for k in md.state_dict_metadata
        if k.startswith("model.") and k[len("model.") :] not in live_model
    )
    if unknown:
        raise CheckpointError(f"checkpoint {uri} holds {unknown}, which this model does not have")
    targets.state["model"] = model_state

    # Fused embedding optimizer state (only this rank's tables appear in its state dict).
    saved_tables = {t.name: t for t in manifest.signature.tables}
    fused_state: dict[str, dict[str, Any]] = {}
    for param_key, states in engine.model.fused_optimizer.state_dict()["state"].items():
        fused_state[param_key] = {}
        for state_key, value in states.items():
            key = f"embedding_optimizer.state.{param_key}.{state_key}"
            entry = _saved_tensor(md, key, uri)
            saved_size, live_size = list(entry.size), _global_size(value)
            if saved_size == live_size:
                fused_state[param_key][state_key] = value  # read in place
            elif isinstance(value, ShardedTensor) and len(live_size) == 1:
                # Row-wise state laid out for another number of column blocks.
                full = torch.empty(saved_size, dtype=entry.properties.dtype)
                fused_state[param_key][state_key] = full
                table = _table_of(param_key)
                if table not in saved_tables or not saved_tables[table].shards:
                    raise CheckpointError(
                        f"checkpoint {uri}: no saved layout for table {table!r} to convert "
                        f"its row-wise state {state_key!r}"
                    )
                weight = live_model[param_key]  # the fused state's key is the weight's key
                blocks = {
                    (m.shard_offsets[1], m.shard_sizes[1])
                    for m in weight.metadata().shards_metadata
                }
                targets.rowwise.append(
                    _RowwiseFix(
                        live=value, saved_full=full, table=table, live_blocks=sorted(blocks)
                    )
                )
            else:
                raise size_mismatch(key, saved_size, live_size)
    fused_state = {k: v for k, v in fused_state.items() if v}
    if fused_state:  # as for the dense optimizer below: fused SGD has no state
        targets.state["embedding_optimizer"] = {"state": fused_state}

    # Dense optimizer state: allocated from what was saved (a checkpoint written before the
    # engine created Adam's state at build time holds none for a model that had not stepped).
    live_dense = engine.dense_optimizer.state_dict()["state"]
    dense_state: dict[str, dict[str, torch.Tensor]] = {}
    for param_key in engine.dense_optimizer.params:
        prefix = f"dense_optimizer.state.{param_key}."
        saved_names = {
            k[len(prefix) :]: entry
            for k, entry in md.state_dict_metadata.items()
            if k.startswith(prefix) and "." not in k[len(prefix) :]
        }
        live_names = set(live_dense.get(param_key, {}))
        if live_names and saved_names and live_names != set(saved_names):
            raise CheckpointError(
                f"checkpoint {uri}: dense optimizer state of {param_key!r} holds "
                f"{sorted(saved_names)} saved, {sorted(live_names)} expected"
            )
        if not saved_names:
            continue
        dense_state[param_key] = {}
        for name, saved in saved_names.items():
            if not isinstance(saved, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint {uri}: {prefix + name!r} is not a tensor")
            entry = saved
            live_value = live_dense.get(param_key, {}).get(name)
            if isinstance(live_value, torch.Tensor) and list(live_value.shape) != list(entry.size):
                raise size_mismatch(prefix + name, list(entry.size), list(live_value.shape))
            # Where the optimizer keeps it: beside the live value, or (when the optimizer has
            # not created it yet) on the parameter's device, scalars such as Adam's step on CPU.
            device = (
                live_value.device
                if isinstance(live_value, torch.Tensor)
                else engine.dense_optimizer.params[param_key].device
                if entry.size
                else torch.device("cpu")
            )
            dense_state[param_key][name] = torch.empty(
                list(entry.size), dtype=entry.properties.dtype, device=device
            )
    if dense_state:
        # No empty entry: DCP would look for a key of that name, and an optimizer without
        # state (SGD) saved none.
        targets.state["dense_optimizer"] = {"state": dense_state}
    targets.dense_optimizer = dense_state

    # The managed ids' maps, read in place.
    if engine.state.ids is not None:
        maps = engine.state.ids.named_state()
        for key, value in maps.items():
            entry = _saved_tensor(md, f"managed_ids.{key}", uri)
            if list(entry.size) != list(value.shape):
                raise size_mismatch(f"managed_ids.{key}", list(entry.size), list(value.shape))
        targets.state["managed_ids"] = maps

    # Random state of the saved rank this rank takes the place of.
    source = f"rank{engine.spec.gang_rank % manifest.gang_size}"
    prefix = f"rng.{source}."
    for key, item in md.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata):
            targets.rng[key[len(prefix) :]] = torch.empty(
                list(item.size), dtype=item.properties.dtype
            )
    if "torch" not in targets.rng:
        raise CheckpointError(
            f"checkpoint {uri} holds no random state of the saved gang's {source}"
        )
    targets.state["rng"] = {source: targets.rng}

    # Fused-optimizer step counters, where this model has any (fused Adam on GPU).
    steps_key = f"embedding_steps.{source}"
    saved_steps = md.state_dict_metadata.get(steps_key)
    if engine.embedding_step_counters() and isinstance(saved_steps, TensorStorageMetadata):
        targets.embedding_steps = torch.empty(
            list(saved_steps.size), dtype=saved_steps.properties.dtype
        )
        targets.state["embedding_steps"] = {source: targets.embedding_steps}
    return targets


def _step_counter_values(saved: torch.Tensor | None, live: int, step: int, uri: str) -> list[int]:
    """The value each of this rank's ``live`` step counters takes from a checkpoint: the saved
    rank's own (same number of kernels), or their common value (another plan). A checkpoint
    without counters gives the saved step: a kernel's counter advances once per training step
    (:meth:`~raytrec.engine.rank_engine.RankEngine.score` puts it back)."""
    if saved is None:
        return [step] * live
    values = [int(v) for v in saved.tolist()]
    if len(values) == live:
        return values
    if len(set(values)) == 1:
        return [values[0]] * live
    raise CheckpointError(
        f"checkpoint {uri}: the saved rank's {len(values)} fused-optimizer step counters "
        f"{values} differ, and this rank has {live} kernels to give them to"
    )


def _convert_rowwise(fix: _RowwiseFix, manifest: Manifest) -> torch.Tensor:
    saved = manifest.signature.table(fix.table)
    return convert_rowwise_state(
        fix.saved_full,
        rows=saved.num_embeddings,
        dim=saved.embedding_dim,
        saved_blocks=saved.column_shards(),
        target_blocks=fix.live_blocks,
    )


def load_checkpoint(
    engine: RankEngine,
    checkpoint: CheckpointRef | str,
    *,
    reader_factory: ReaderFactory = storage_reader,
) -> LoadedCheckpoint:
    """Loads a checkpoint into ``engine`` (its gang may differ in size, plan and count).

    A collective over the gang: every rank of the gang calls it. Sets
    ``engine.step`` to the saved step and returns the saved generation and
    ``extra``. Raises :class:`CheckpointError` on every rank of the gang, with
    nothing in the engine changed, if the checkpoint is missing, uncommitted,
    corrupt, or made for another model; an error while reading, after every
    check passed, leaves the engine partly loaded and says so.

    ``reader_factory`` makes DCP's storage reader for the URI. DCP reads into the
    live state, so "nothing changed" for a corrupt data file holds with a reader
    that checks every record before reading any (the default,
    :class:`~raytrec.checkpoint.reader.DirectReader`); DCP's plain
    ``FileSystemReader`` would stop at the bad record with the ones before it read.
    """
    uri = checkpoint.uri if isinstance(checkpoint, CheckpointRef) else checkpoint

    def verify() -> Manifest:
        manifest = read_manifest(uri)
        with _quiet_sharded_tensor():
            check_compatible(manifest.signature, _signature(engine), where=uri)
        return manifest

    manifest = agree(verify)

    def plan() -> _Targets:
        try:
            md = reader_factory(uri).read_metadata()
        except (Exception, CheckpointException) as e:
            raise CheckpointError(
                f"checkpoint {uri} is corrupt: its DCP metadata (.metadata) cannot be read "
                f"({describe(e)})"
            ) from None
        with _quiet_sharded_tensor():
            return _build_targets(engine, md, manifest, uri)

    targets = agree(plan)

    def read() -> None:
        reader = reader_factory(uri)
        with _quiet_sharded_tensor():
            try:
                dcp.load(targets.state, storage_reader=reader)
            except (Exception, CheckpointException) as e:
                # After every rank's checks passed, reads go straight into the live state.
                partly = isinstance(reader, DirectReader) and reader.started_reading
                raise CheckpointError(
                    f"checkpoint {uri} is corrupt: reading its tensors failed ({describe(e)})"
                    + ("; this model is partly loaded: load again" if partly else "")
                ) from None
            for fix in targets.rowwise:
                fix.converted = _convert_rowwise(fix, manifest)

    agree(read)

    # Everything is read on every rank of the gang: now the state read into fresh tensors.
    with torch.no_grad(), _quiet_sharded_tensor():
        for fix in targets.rowwise:
            assert fix.converted is not None
            for shard in fix.live.local_shards():
                start, length = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
                shard.tensor.copy_(fix.converted[start : start + length])
        params = engine.dense_optimizer.params
        optimizer = engine.dense_optimizer._optimizer
        for param_key, param in params.items():
            states = targets.dense_optimizer.get(param_key)
            if not states:
                # Nothing saved (SGD; or Adam saved before any step by a version that created
                # its state lazily): a fresh optimizer's state.
                group = next(
                    g for g in optimizer.param_groups if any(p is param for p in g["params"])
                )
                fresh_state = initial_state(optimizer, group, param)
                if fresh_state:
                    optimizer.state[param] = fresh_state
                continue
            live_state = engine.dense_optimizer.state[param]
            for name, fresh in states.items():
                current = live_state.get(name)
                if isinstance(current, torch.Tensor) and current.shape == fresh.shape:
                    current.copy_(fresh)
                else:
                    live_state[name] = fresh
        counters = engine.embedding_step_counters()
        values = _step_counter_values(targets.embedding_steps, len(counters), manifest.step, uri)
        for counter, value in zip(counters, values, strict=True):
            counter.fill_(value)
        _set_rng_state(targets.rng, engine.device)
    engine.embeddings_written()
    engine.step_counters_written()
    engine.step = manifest.step
    return LoadedCheckpoint(
        uri=uri,
        step=manifest.step,
        generation=manifest.generation,
        extra=manifest.extra,
        manifest=manifest,
    )
