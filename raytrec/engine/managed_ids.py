"""Managed ids: raw ids of any size mapped to a table's rows while training, the same map on
every rank of the job (docs/managed_ids.md).

Each managed table keeps TorchRec's :class:`~torchrec.modules.mc_modules.MCHManagedCollisionModule`
(its sorted raw ids, their rows and the eviction policy's metadata): its ``remap`` maps a
batch's raw ids to rows, an id not in the map to the default row (the last of the budget), and
its ``_update_and_evict`` with TorchRec's ``LRU_EvictionPolicy`` / ``LFU_EvictionPolicy``
admits new ids and evicts stale ones.

What TorchRec does not do, and this module does: TorchRec's module profiles the ids of its own
forward passes and evicts on its own schedule, so in a 2D job each replica group (each rank,
even) would admit different ids and give the same id different rows. Here the map is frozen
between job-wide syncs and identical everywhere; each rank only *observes* the ids it trains
(counts and last step seen, :meth:`ManagedIds.remap`), and at a job-wide sync
(:meth:`ManagedIds.merge`) the observations of every rank are gathered (over the gang world,
then over the replica plane), coalesced into one sorted list (integer sums and maxima, so the
result does not depend on the order of arrival), and fed to the module's
``_update_and_evict`` on every rank: the same input and the same state give the same decision
(its sorts are stable; ties go to the live id, then to the more frequent, then the smaller
id). The rows given to new ids are returned so that their weights and optimizer state can be
reset (:mod:`raytrec.engine.managed_rows`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence

import torch
from torchrec.modules.mc_modules import (
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from raytrec.config.model import ModelConfig, TableConfig

__all__ = [
    "FREE",
    "ManagedIds",
    "ManagedTable",
    "coalesce",
    "gather_ragged",
    "map_features",
]

#: What :meth:`ManagedTable.row_ids` shows for a row no id holds (and the default row).
FREE = -1
#: TorchRec's marker of an empty slot in the sorted raw ids; a raw id equal to it is reserved.
_EMPTY = torch.iinfo(torch.int64).max
# Observations buffered per table before they are coalesced (bounds a rank's memory).
_COALESCE_EVERY = 64

#: Gathers one int64 tensor of one shape from every member of a group, stacked.
Gather = Callable[[torch.Tensor], torch.Tensor]


def coalesce(obs: torch.Tensor) -> torch.Tensor:
    """Observations ``[n, 4]`` int64 rows of (table, raw id, count, last step) -> one row per
    (table, raw id), sorted by both, counts summed and last steps maxed. Integer sums and
    maxima: any order of the input rows gives the same result."""
    if obs.shape[0] == 0:
        return obs.reshape(0, 4)
    keys, inverse = torch.unique(obs[:, :2], dim=0, return_inverse=True)
    counts = torch.zeros(keys.shape[0], dtype=torch.int64).scatter_add_(0, inverse, obs[:, 2])
    last = torch.zeros(keys.shape[0], dtype=torch.int64).scatter_reduce_(
        0, inverse, obs[:, 3], reduce="amax", include_self=False
    )
    return torch.cat([keys, counts[:, None], last[:, None]], dim=1)


def gather_ragged(rows: torch.Tensor, gather: Gather, device: torch.device) -> torch.Tensor:
    """Every member's ``rows`` (``[n_i, k]`` int64, ``n_i`` differing), concatenated in member
    order, on the CPU. ``gather`` runs on ``device`` (a CUDA device for NCCL)."""
    n = gather(torch.tensor([rows.shape[0]], dtype=torch.int64, device=device)).view(-1)
    sizes = [int(v) for v in n.cpu()]
    padded = torch.zeros((max(sizes), rows.shape[1]), dtype=torch.int64, device=device)
    padded[: rows.shape[0]] = rows.to(device)
    stacked = gather(padded).cpu()
    return torch.cat([stacked[i, :s] for i, s in enumerate(sizes)])


def _chain(lineage: torch.Tensor, step: int, state: Sequence[torch.Tensor]) -> int:
    """The next lineage: a hash of the last one, the merge's step and the maps after it."""
    h = hashlib.sha256(f"{int(lineage.item())}/{step}".encode())
    for t in state:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little", signed=True)


def map_features(
    kjt: KeyedJaggedTensor, rows: Callable[[str, torch.Tensor], torch.Tensor | None]
) -> KeyedJaggedTensor:
    """``kjt`` with each feature's ids replaced by ``rows(key, ids)`` (int64 in, rows out; None
    keeps the feature as it is); lengths and weights unchanged."""
    keys = kjt.keys()
    values = list(torch.split(kjt.values(), kjt.length_per_key()))
    changed = False
    for i, key in enumerate(keys):
        mapped = rows(key, values[i].to(torch.int64))
        if mapped is not None:
            values[i] = mapped.to(kjt.values().dtype)
            changed = True
    if not changed:
        return kjt
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(values),
        weights=kjt.weights_or_none(),
        lengths=kjt.lengths(),
        offsets=kjt.offsets(),
        stride=kjt.stride(),
    )


class ManagedTable:
    """One managed table's map: TorchRec's MCH module over ``budget`` rows (the last is the
    default row), and this rank's observations since the last merge."""

    def __init__(self, table: TableConfig, index: int) -> None:
        self.name = table.name
        self.index = index  # position among the model's managed tables
        self.budget = table.id_budget
        self.eviction = table.ids.eviction
        policy = LRU_EvictionPolicy() if self.eviction == "lru" else LFU_EvictionPolicy()
        # The eviction interval is never reached: profile() is not called (the module would
        # admit ids from this rank's batches alone); merge() drives the decisions.
        self.module = MCHManagedCollisionModule(
            zch_size=self.budget,
            device=torch.device("cpu"),
            eviction_policy=policy,
            eviction_interval=1,
            name=table.name,
        )
        self._metadata = "last_access_iter" if self.eviction == "lru" else "counts"
        # The job step of the last merge applied (the map's version).
        self.version = torch.zeros(1, dtype=torch.int64)
        self._seen: list[torch.Tensor] = []  # [n, 4] observation blocks since the last merge

    @property
    def default_row(self) -> int:
        """The row every id not in the map reads (TorchRec's ``zch_size - 1``)."""
        return self.budget - 1

    def lookup(self, values: torch.Tensor) -> torch.Tensor:
        """Rows of raw ids (int64, CPU), through TorchRec's remap; ids not in the map get the
        default row."""
        jt = JaggedTensor(values=values, lengths=torch.tensor([values.numel()]))
        return self.module.remap({self.name: jt})[self.name].values()

    def observe(self, values: torch.Tensor, step: int) -> None:
        """Records that this rank trained ``values`` at ``step`` (counted at the next merge)."""
        if values.numel() == 0:
            return
        ids, counts = torch.unique(values, return_counts=True)
        block = torch.empty((ids.shape[0], 4), dtype=torch.int64)
        block[:, 0] = self.index
        block[:, 1] = ids
        block[:, 2] = counts
        block[:, 3] = step
        self._seen.append(block)
        if len(self._seen) >= _COALESCE_EVERY:
            self._seen = [coalesce(torch.cat(self._seen))]

    def take_observed(self) -> torch.Tensor:
        """This rank's observations since the last merge, coalesced, and forgets them."""
        seen = (
            coalesce(torch.cat(self._seen))
            if self._seen
            else torch.empty((0, 4), dtype=torch.int64)
        )
        self._seen = []
        return seen

    @torch.no_grad()
    def apply(self, merged: torch.Tensor, step: int) -> torch.Tensor:
        """Applies one decision from the job's merged observations of this table (``[n, 4]``,
        sorted by raw id, :func:`coalesce`) at job step ``step``; returns the rows given to new
        ids (sorted), whose old contents belong to evicted ids or to no id."""
        self.version.fill_(step)
        ids = merged[:, 1]
        keep = ids != _EMPTY  # the reserved value never enters the map
        if not bool(keep.any()):
            return torch.empty(0, dtype=torch.int64)
        module = self.module
        module._current_iter = step
        metadata = {"last_access_iter": merged[keep, 3].clone()} if self.eviction == "lru" else {}
        module._update_and_evict(ids[keep].clone(), merged[keep, 2].clone(), metadata)
        evicted = module.evict()
        if evicted is None:
            return torch.empty(0, dtype=torch.int64)
        return torch.sort(evicted.to(torch.int64)).values

    def state(self) -> list[torch.Tensor]:
        """The map's state, as live tensors (write into them to replace it): the sorted raw
        ids, their rows, the eviction metadata and the version."""
        module = self.module
        return [
            module._mch_sorted_raw_ids,
            module._mch_remapped_ids_mapping,
            module._mch_metadata[self._metadata],
            self.version,
        ]

    def row_ids(self) -> torch.Tensor:
        """The raw id each row holds (``[budget]``), :data:`FREE` for a row no id holds."""
        rows = torch.full((self.budget,), FREE, dtype=torch.int64)
        raw = self.module._mch_sorted_raw_ids
        live = raw != _EMPTY
        rows[self.module._mch_remapped_ids_mapping[live]] = raw[live]
        return rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class MergeOutcome:
    """What a merge changed: table name -> rows given to new ids (sorted)."""

    step: int
    renewed: Mapping[str, torch.Tensor]


class ManagedIds:
    """The managed tables of a model: remapping a batch's features, and merging."""

    def __init__(self, model: ModelConfig) -> None:
        managed = [t for t in model.tables if t.managed]
        self.tables = {t.name: ManagedTable(t, i) for i, t in enumerate(managed)}
        self.table_of = {f: self.tables[t.name] for t in managed for f in t.features}
        # A hash chained through every merge applied (its step and the maps after it): ranks
        # with equal lineages went through the same maps after every merge.
        self.lineage = torch.zeros(1, dtype=torch.int64)

    @classmethod
    def for_model(cls, model: ModelConfig) -> ManagedIds | None:
        """The model's managed ids; None when no table manages its ids."""
        return cls(model) if any(t.managed for t in model.tables) else None

    def remap(self, kjt: KeyedJaggedTensor, *, step: int | None) -> KeyedJaggedTensor:
        """``kjt`` with the managed features' raw ids replaced by rows; with ``step``, the raw
        ids are observed as trained at that step (None: scoring, nothing observed)."""

        def rows(key: str, raw: torch.Tensor) -> torch.Tensor | None:
            table = self.table_of.get(key)
            if table is None:
                return None
            if step is not None:
                table.observe(raw, step)
            return table.lookup(raw)

        return map_features(kjt, rows)

    def merge(self, step: int, gathers: Sequence[tuple[Gather, torch.device]]) -> MergeOutcome:
        """One job-wide decision: this rank's observations of every table are gathered through
        ``gathers`` in turn (the gang world, then the replica plane: after both, every rank
        holds the job's), coalesced, and applied to every table. Collective over every group
        of ``gathers``."""
        rows = [t.take_observed() for t in self.tables.values()]
        merged = torch.cat(rows) if rows else torch.empty((0, 4), dtype=torch.int64)
        for gather, device in gathers:
            merged = coalesce(gather_ragged(merged, gather, device))
        renewed: dict[str, torch.Tensor] = {}
        for table in self.tables.values():
            mine = merged[merged[:, 0] == table.index]
            renewed[table.name] = table.apply(mine, step)
        self.lineage.fill_(_chain(self.lineage, step, self.state()))
        return MergeOutcome(step=step, renewed=renewed)

    def state(self) -> list[torch.Tensor]:
        """Every table's map state (:meth:`ManagedTable.state`), in table order, then the
        lineage."""
        return [t for table in self.tables.values() for t in table.state()] + [self.lineage]

    def named_state(self) -> dict[str, torch.Tensor]:
        """:meth:`state` by name (``<table>.<part>``), as checkpoints keep it."""
        parts = ("sorted_raw_ids", "rows", "metadata", "version")
        named = {
            f"{name}.{part}": t
            for name, table in self.tables.items()
            for part, t in zip(parts, table.state(), strict=True)
        }
        named["lineage"] = self.lineage
        return named

    def row_ids(self) -> dict[str, torch.Tensor]:
        """Table name -> the raw id of each row (:meth:`ManagedTable.row_ids`)."""
        return {name: table.row_ids() for name, table in self.tables.items()}
