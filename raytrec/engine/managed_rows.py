"""Managed ids in a rank: when the job merges its observations, and what the rows of the
embedding shards go through when the map changes (docs/managed_ids.md).

The merge (:func:`merge_ids`) runs after every job-wide sync of the schedule, on every rank of
the job at the same step: observations are gathered over the gang world, then over the replica
plane, so every rank applies one decision (:meth:`ManagedIds.merge`). A row given to a new id
starts fresh (:func:`renew_rows`): its weights are drawn again and its fused optimizer state
is zeroed. The fresh weights are a pure function of (job seed, table, row, map version), drawn
with a counter-based hash rather than a generator, so every rank holding a piece of the row
(column-wise shards, replicas in other gangs) writes the same values without drawing the
others' rows.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from raytrec.engine.managed_ids import Gather, ManagedIds
from raytrec.engine.rank_model import RankModel
from raytrec.engine.replica_plane import ReplicaPlane
from raytrec.sync.schedule import SyncDecision

__all__ = ["fresh_rows", "merge_ids", "merges_after", "on_device", "realigned", "renew_rows"]

_U64 = np.uint64


def merges_after(decision: SyncDecision, lower_levels: int) -> bool:
    """Whether the job merges its managed ids at ``decision``: at each job-wide sync of the
    schedule (its top level, above ``sync.levels``' ``lower_levels``), whether or not there are
    other gangs to average with."""
    return decision.due and decision.level == lower_levels


def _gang_gather(device: torch.device) -> tuple[Gather, torch.device]:
    def gather(t: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t)
        return torch.stack(out)

    return gather, device


def merge_ids(model: RankModel, plane: ReplicaPlane | None, step: int) -> None:
    """The job's merge after ``step``: collective over this rank's gang world and its replica
    plane (every rank of the job calls it at the same step); renews the rows given to new
    ids."""
    ids = model.ids
    assert ids is not None
    gathers: list[tuple[Gather, torch.device]] = []
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathers.append(_gang_gather(model.device))
    if plane is not None and plane.size > 1:
        gathers.append((plane.all_gather, plane.device))
    outcome = ids.merge(step, gathers)
    renew_rows(model, ids, outcome.renewed)
    # Every rank must now hold the same maps: their lineages are compared (one int64 per
    # rank), and a difference stops the step, as a failed collective does.
    for gather, device in gathers:
        seen = gather(ids.lineage.to(device)).cpu().view(-1)
        if not bool((seen == ids.lineage).all()):
            raise RuntimeError(
                f"managed ids: the maps differ between ranks after the merge at step {step} "
                f"(lineages {seen.tolist()})"
            )


@contextlib.contextmanager
def on_device(tensors: list[torch.Tensor], device: torch.device) -> Iterator[list[torch.Tensor]]:
    """Copies of ``tensors`` (the maps, kept on the host) on ``device``, for a collective there
    (NCCL takes CUDA tensors); written back to ``tensors`` when the block ends without error."""
    moved = [t.to(device) for t in tensors]
    yield moved
    for dst, src in zip(tensors, moved, strict=True):
        if dst is not src:
            dst.copy_(src)


def realigned(
    model: RankModel, copy: Callable[[list[torch.Tensor]], None], device: torch.device
) -> None:
    """Runs ``copy`` on the map's state tensors (a broadcast from another rank, on ``device``),
    then renews the rows whose id changed: after a failure inside a merge the survivors may hold
    maps one decision apart, and the copied map's rows must not keep another id's weights."""
    ids = model.ids
    if ids is None:
        copy([])
        return
    before = ids.row_ids()
    with on_device(ids.state(), device) as moved:
        copy(moved)
    after = ids.row_ids()
    changed = {
        name: torch.nonzero(before[name] != after[name]).view(-1)
        for name in ids.tables
        if not torch.equal(before[name], after[name])
    }
    renew_rows(model, ids, changed)


def fresh_rows(
    seed: int, table: str, version: int, rows: torch.Tensor, shape: tuple[int, int]
) -> torch.Tensor:
    """Fresh weights of ``rows`` of ``table`` (global ``shape`` rows x dim): ``[len(rows),
    dim]`` float32, uniform in ±sqrt(1/rows) as TorchRec initialises a table, each cell drawn
    from a hash of (seed, table, version, row, column), so any rank draws the same value for
    the same cell."""
    num_rows, dim = shape
    key = np.array(
        [seed & 0xFFFFFFFF, zlib.crc32(table.encode()), version & 0xFFFFFFFFFFFF], dtype=_U64
    )
    r = rows.cpu().numpy().astype(_U64)[:, None]
    c = np.arange(dim, dtype=_U64)[None, :]
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as the hash wants
        base = _U64(key[0] * _U64(0x100000001B3) ^ key[1] * _U64(0xC2B2AE3D27D4EB4F) ^ key[2])
        z = (r * _U64(dim) + c) ^ base
        z = z + _U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        z = z ^ (z >> _U64(31))
    unit = (z >> _U64(40)).astype(np.float64) / float(1 << 24)  # [0, 1)
    bound = 1.0 / np.sqrt(num_rows)
    return torch.from_numpy(((2.0 * unit - 1.0) * bound).astype(np.float32))


@torch.no_grad()
def renew_rows(model: RankModel, ids: ManagedIds, renewed: Mapping[str, torch.Tensor]) -> None:
    """Gives the rows ``renewed`` (table -> global rows) fresh weights and zero fused optimizer
    state, in this rank's shards of those tables."""
    renewed = {name: rows for name, rows in renewed.items() if rows.numel()}
    if not renewed:
        return
    shards = model.table_shards(optimizer_state=True)
    index = {(s[0].data_ptr(), tuple(s[0].shape)): k for k, s in enumerate(shards)}
    for key, value in model.model.state_dict().items():
        if not isinstance(value, ShardedTensor):
            continue
        name = key.split(".")[-2]
        rows = renewed.get(name)
        if rows is None:
            continue
        shape = (int(value.size(0)), int(value.size(1)))
        version = int(ids.tables[name].version.item())
        for shard in value.local_shards():
            k = index.get((shard.tensor.data_ptr(), tuple(shard.tensor.shape)))
            if k is None:
                raise RuntimeError(f"table {name}: a local shard is none of this rank's kernels")
            weight, *states = shards[k]
            row0, col0 = (int(v) for v in shard.metadata.shard_offsets)
            n, width = (int(v) for v in shard.metadata.shard_sizes)
            local = rows[(rows >= row0) & (rows < row0 + n)] - row0
            if not local.numel():
                continue
            values = fresh_rows(model.seed, name, version, local + row0, shape)
            local = local.to(weight.device)
            weight[local] = values[:, col0 : col0 + width].to(weight.device, weight.dtype)
            for state in states:
                state[local] = 0
            if model.unpublished is not None:
                model.unpublished.mark(k, local)
    model.embeddings_written(synced=True)
