"""Touched-row replica sync (``sync.rows: touched``): which rows of this rank's shards its
lookups touched, and averaging only those over a replica group.

FBGEMM's fused optimizers change only the rows a batch looked up, so a row that no member of a
replica group touched since the group's last sync holds the same weights and optimizer state in
every member; averaging the union of the members' touched rows then gives what averaging every
row gives (bit for bit with two members: ``(x + x) / 2 == x``).

The ids come from a forward pre-hook on each FBGEMM kernel that holds this rank's shards: the
indices the kernel is handed, after TorchRec's input distribution. They are local to the shard
already (a row-wise shard's row offset is subtracted by TorchRec's bucketizer; a column-wise or
table-wise shard holds every row of its table), so they are exactly the rows the kernel's fused
optimizer updates in the backward, on CPU and GPU alike. TorchRec's ``ModelDeltaTracker``
records the same lookups, but as a list of id tensors per batch in unsharded ids for one
publishing consumer; one byte per local row, a bit per schedule level, stays bounded whatever
the sync period and needs no id translation.

Each row has a mask: bit ``2l`` is set while its weights may differ in its level-``l`` group
(touched since that level's last sync), bit ``2l + 1`` while its optimizer state may (touched
since that level's last sync that carried optimizer state). Levels nest, so a sync at level
``l`` makes every lower level's groups agree too and clears the bits of levels ``0..l``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen,
)

from raytrec.engine.replica_plane import ReplicaPlane
from raytrec.sync.traffic import agreement, allgather_bytes, allreduce_bytes

__all__ = [
    "WHOLE_SYNC_BELOW_BYTES",
    "SyncTraffic",
    "TouchedRows",
    "average_rows",
    "full_traffic",
    "record_lookups",
    "shard_bytes",
    "syncs_whole",
]

#: A rank whose shards (with the optimizer state the sync carries) all-reduce fewer bytes than
#: this syncs them whole even with ``sync.rows: touched``: in the one all-reduce of
#: ``sync.rows: all``, without agreeing on the touched rows first. The agreement costs two or
#: three collectives more, whose latency outweighs the bytes a touched sync saves on small
#: shards. Every member of a replica group holds shards of the same shapes, so all decide
#: alike with no exchange. Set where a touched sync at 5% of the rows per rank stops being
#: slower than the full average on two gangs of one rank over gloo (docs/benchmarks.md):
#:
#:     .venv/bin/python -m benchmarks.sync_bytes --crossover
#:
#: Read at each sync, so a test may lower it.
WHOLE_SYNC_BELOW_BYTES = 2_000_000

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncTraffic:
    """What one sync moved, as seen by one rank."""

    bytes_sent: int  # bytes this rank sent, ring collectives assumed (sync.traffic)
    rows: int  # table rows averaged (every row of a shard averaged whole counts)
    whole_shards: int  # shards averaged whole (rows: all, a fallback, or a first sync)
    shards: int


def record_lookups(
    mark: Callable[[int, torch.Tensor], None],
    first: int,
    feature_tables: tuple[int, ...],
    _: Any,
    args: Any,
    kwargs: Any,
) -> None:
    """A forward pre-hook of an FBGEMM kernel (bound with ``functools.partial``): calls
    ``mark(first + table, ids)`` for the local rows each table of the kernel is looked up at.
    Nothing in a forward without gradients (scoring changes no row)."""
    if not torch.is_grad_enabled():
        return  # scoring: no backward, so no row changes
    named = ("indices", "offsets", "per_sample_weights", "feature_requires_grad", "vbe")
    given = dict(zip(named, args, strict=False)) | kwargs
    indices, offsets = given["indices"], given["offsets"]
    per_rank = given.get("batch_size_per_feature_per_rank") or given.get("vbe")
    if per_rank:  # variable batch sizes: feature f spans sum(per_rank[f]) bags
        sizes = [sum(b) for b in per_rank]
    else:
        bags = (offsets.numel() - 1) // len(feature_tables)
        sizes = [bags] * len(feature_tables)
    ends = [0]
    for n in sizes:
        ends.append(ends[-1] + n)
    bounds = offsets[ends].tolist()
    for f, t in enumerate(feature_tables):
        if bounds[f + 1] > bounds[f]:
            mark(first + t, indices[bounds[f] : bounds[f + 1]])


class TouchedRows:
    """Per local table shard (the order of :meth:`RankModel.table_shards`), the rows its
    lookups touched since each schedule level's last sync, and which levels' sets are valid."""

    def __init__(
        self, kernels: Sequence[SplitTableBatchedEmbeddingBagsCodegen], *, levels: int
    ) -> None:
        if not 1 <= levels <= 15:
            raise ValueError(f"touched-row tracking covers 1 to 15 schedule levels, not {levels}")
        self.levels = levels
        dtype = torch.uint8 if levels <= 4 else torch.int32
        self._all = (1 << (2 * levels)) - 1
        self.masks: list[torch.Tensor] = []
        self._hooks = []
        for tbe in kernels:
            first = len(self.masks)
            for w in tbe.split_embedding_weights():
                self.masks.append(torch.zeros(w.shape[0], dtype=dtype, device=w.device))
            record = functools.partial(
                record_lookups, self.mark, first, tuple(tbe.feature_table_map)
            )
            self._hooks.append(tbe.register_forward_pre_hook(record, with_kwargs=True))
        # Level -> the generation in which its weights (or optimizer state) were last synced:
        # its set counts from then. A level missing here syncs every row next.
        self._since: dict[int, int] = {}
        self._state_since: dict[int, int] = {}

    @property
    def shards(self) -> range:
        return range(len(self.masks))

    def mark(self, shard: int, ids: torch.Tensor) -> None:
        """Records a lookup of local rows ``ids`` of shard ``shard``."""
        self.masks[shard][ids] = self._all

    def _bit(self, level: int, optimizer_state: bool) -> int:
        return 1 << (2 * level + int(optimizer_state))

    def valid(self, level: int, *, optimizer_state: bool, generation: int) -> bool:
        """Whether level ``level``'s sets count every row changed since its last sync in this
        generation. Not after a new generation's forming (a member may have replayed batches,
        or finished a sync that failed elsewhere), a heal or a checkpoint load."""
        since = self._state_since if optimizer_state else self._since
        return level < self.levels and since.get(level) == generation

    def rows(self, shard: int, level: int, *, optimizer_state: bool) -> torch.Tensor:
        """The local rows of ``shard`` touched since level ``level``'s last sync (carrying
        optimizer state, with ``optimizer_state``), sorted."""
        bit = self._bit(level, optimizer_state)
        return torch.nonzero(self.masks[shard] & bit).flatten()

    def synced(self, level: int, *, optimizer_state: bool, generation: int) -> None:
        """After a sync at ``level`` succeeded here: its group agrees on every row, so every
        lower level's groups (parts of it) do too."""
        clear = 0
        for low in range(min(level, self.levels - 1) + 1):
            clear |= self._bit(low, False)
            self._since[low] = generation
            if optimizer_state:
                clear |= self._bit(low, True)
                self._state_since[low] = generation
        for mask in self.masks:
            mask &= self._all & ~clear

    def forget(self) -> None:
        """The shards were overwritten from outside a sync (a heal, a checkpoint load): every
        level syncs every row next."""
        self._since.clear()
        self._state_since.clear()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _pack(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bits, eight to a byte."""
    padded = torch.zeros(-(-mask.numel() // 8) * 8, dtype=torch.uint8)
    padded[: mask.numel()] = mask.to(torch.uint8).cpu()
    return (padded.view(-1, 8) * _BITS).sum(1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, rows: int) -> torch.Tensor:
    return ((packed.unsqueeze(1) & _BITS) != 0).flatten()[:rows]


def average_rows(
    plane: ReplicaPlane,
    shards: Sequence[tuple[torch.Tensor, ...]],
    touched: Sequence[torch.Tensor],
    *,
    max_share: float,
    extra: Sequence[torch.Tensor] = (),
    apart: Sequence[torch.Tensor] = (),
    written: Sequence[torch.Tensor] | None = None,
) -> SyncTraffic:
    """Averages over ``plane`` the rows of each shard that some member touched.

    ``shards[k]``: a table shard's weights and its optimizer state tensors (each indexed by
    row first); ``touched[k]``: this member's touched local rows of it. ``extra`` (step
    counters) and ``apart`` (dense state, :func:`in_place_flat`) are averaged whole.

    The members first all-gather their counts. A shard that some member touched more than
    ``max_share`` of is averaged whole (no cheaper, and no union to agree on); otherwise the
    union is agreed by an all-gather of the ids or, when cheaper (many ids, or many members),
    an OR-all-reduce of a bitmap of the shard's rows (:func:`raytrec.sync.traffic.agreement`).
    Then those rows of every tensor are gathered, averaged in one all-reduce per dtype and
    written back. A failed collective can leave some shards averaged and others not, as a
    failure can between replica groups: the next generation's first sync averages every row.

    ``written[k]``: a mask of shard ``k``'s rows, set for every row this sync writes
    (:mod:`raytrec.engine.publish_rows`)."""
    n = plane.size
    sent = 0
    on = plane.device  # NCCL takes CUDA tensors; the bookkeeping stays on the CPU
    counts = torch.tensor([t.numel() for t in touched], dtype=torch.int64)
    every = plane.all_gather(counts.to(on)).cpu()
    sent += allgather_bytes(counts.numel() * 8, n)
    most = every.max(0).values.tolist()
    whole: list[int] = []
    by_ids: list[int] = []
    by_bitmap: list[int] = []
    for k, (shard, top) in enumerate(zip(shards, most, strict=True)):
        how = agreement(shard[0].shape[0], top, n, max_share, bitmap=plane.backend != "nccl")
        {"whole": whole, "ids": by_ids, "bitmap": by_bitmap, "none": []}[how].append(k)
    union: dict[int, torch.Tensor] = {}
    if by_ids:
        found: dict[int, list[torch.Tensor]] = {k: [] for k in by_ids}
        totals = every[:, by_ids].sum(1)
        width = int(totals.max())
        mine = torch.full((width,), -1, dtype=torch.int64)
        own = torch.cat([touched[k].cpu() for k in by_ids])
        mine[: own.numel()] = own
        theirs = plane.all_gather(mine.to(on)).cpu()
        sent += allgather_bytes(width * 8, n)
        for r in range(n):
            parts = theirs[r][: int(totals[r])].split(every[r, by_ids].tolist())
            for k, ids in zip(by_ids, parts, strict=True):
                found[k].append(ids)
        for k in by_ids:
            union[k] = torch.unique(torch.cat(found[k]))
    if by_bitmap:
        bitmaps = []
        for k in by_bitmap:
            mask = torch.zeros(shards[k][0].shape[0], dtype=torch.bool)
            mask[touched[k].cpu()] = True
            bitmaps.append(_pack(mask))
        packed = torch.cat(bitmaps)
        plane.bitwise_or_(packed)
        sent += allreduce_bytes(packed.numel(), n)
        for k, bits in zip(by_bitmap, packed.split([b.numel() for b in bitmaps]), strict=True):
            union[k] = torch.nonzero(_unpack(bits, shards[k][0].shape[0])).flatten()
    if written is not None:
        for k in whole:
            written[k].fill_(True)
        for k, ids in union.items():
            written[k][ids.to(written[k].device)] = True
    tensors: list[torch.Tensor] = [t for k in whole for t in shards[k]] + list(extra)
    plane.average_(tensors, apart=apart)
    sent += allreduce_bytes(_wire_bytes(tensors) + _wire_bytes(apart), n)
    # The touched rows of every tensor, gathered straight into one scratch buffer per dtype,
    # averaged there and copied back (one copy each way).
    by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for k, ids in union.items():
        union[k] = ids = ids.to(shards[k][0].device)
        for t in shards[k]:
            by_dtype.setdefault(t.dtype, []).append((t, ids))
    for dtype, parts in by_dtype.items():
        sizes = [ids.numel() * t[0].numel() for t, ids in parts]
        flat = torch.empty(sum(sizes), dtype=dtype, device=parts[0][0].device)
        views = [
            v.view(ids.numel(), *t.shape[1:])
            for v, (t, ids) in zip(flat.split(sizes), parts, strict=True)
        ]
        for v, (t, ids) in zip(views, parts, strict=True):
            torch.index_select(t, 0, ids, out=v)
        plane.mean_(flat)
        sent += allreduce_bytes(_wire_bytes([flat]), n)
        for v, (t, ids) in zip(views, parts, strict=True):
            t.index_copy_(0, ids, v)
    averaged = sum(shards[k][0].shape[0] for k in whole) + sum(u.numel() for u in union.values())
    return SyncTraffic(bytes_sent=sent, rows=averaged, whole_shards=len(whole), shards=len(shards))


def shard_bytes(
    kernels: Sequence[SplitTableBatchedEmbeddingBagsCodegen], *, optimizer_state: bool
) -> int:
    """Bytes the all-reduce of a whole sync carries for the shards ``kernels`` hold: their
    weights and, with ``optimizer_state``, their fused optimizer state (shapes alone)."""
    tensors = [w for tbe in kernels for w in tbe.split_embedding_weights()]
    if optimizer_state:
        tensors += [s for tbe in kernels for st in tbe.split_optimizer_states() for s in st]
    return _wire_bytes(tensors)


def syncs_whole(nbytes: int) -> bool:
    """Whether shards whose whole sync carries ``nbytes`` are synced whole whatever
    ``sync.rows`` says (:data:`WHOLE_SYNC_BELOW_BYTES`)."""
    return nbytes < WHOLE_SYNC_BELOW_BYTES


def _wire_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of ``tensors`` as the all-reduce carries them (half precision widened to fp32)."""
    wide = (torch.float16, torch.bfloat16)
    return sum(t.numel() * (4 if t.dtype in wide else t.element_size()) for t in tensors)


def full_traffic(
    tensors: Sequence[torch.Tensor],
    apart: Sequence[torch.Tensor],
    members: int,
    kernels: Sequence[SplitTableBatchedEmbeddingBagsCodegen],
) -> SyncTraffic:
    """What a sync of every row (``sync.rows: all``) of the shards ``kernels`` hold moved."""
    rows = [w.shape[0] for tbe in kernels for w in tbe.split_embedding_weights()]
    return SyncTraffic(
        bytes_sent=allreduce_bytes(_wire_bytes(tensors) + _wire_bytes(apart), members),
        rows=sum(rows),
        whole_shards=len(rows),
        shards=len(rows),
    )
