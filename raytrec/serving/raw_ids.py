"""Serving a model with managed ids (docs/managed_ids.md): the exported model carries each
managed table's map, so it takes raw ids.

The maps are buffers of a ``managed_ids`` submodule of the served model (its state dict keys
``managed_ids.<table>.sorted_raw_ids`` and ``managed_ids.<table>.rows``: the sorted raw ids of
the map and the row of each), and a forward pre-hook maps a batch's raw ids to rows before the
model reads them. An id the map does not hold reads the table's default row (its last row of
the budget), as in training. The lookup is TorchRec's (``searchsorted`` over the sorted ids),
written with ``torch.where`` so that it has no data-dependent shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from raytrec.checkpoint.errors import CheckpointError
from raytrec.checkpoint.storage import storage_reader
from raytrec.config.model import ModelConfig
from raytrec.engine.managed_ids import map_features

__all__ = ["MAPS", "IdMaps", "attach_maps", "read_maps", "split_maps"]

#: The served model's submodule (and state dict prefix) holding the maps; also the prefix of
#: the maps in checkpoints and final models.
MAPS = "managed_ids"
_PARTS = ("sorted_raw_ids", "rows")


class _TableMap(nn.Module):
    sorted_raw_ids: torch.Tensor
    rows: torch.Tensor

    def __init__(self, budget: int) -> None:
        super().__init__()
        empty = torch.iinfo(torch.int64).max
        self.register_buffer("sorted_raw_ids", torch.full((budget,), empty, dtype=torch.int64))
        self.register_buffer("rows", torch.arange(budget, dtype=torch.int64))
        self.default_row = budget - 1

    def lookup(self, values: torch.Tensor) -> torch.Tensor:
        sorted_ids, rows = self.sorted_raw_ids, self.rows
        # The last slot is never searched: TorchRec keeps it empty (its default row's).
        at = torch.searchsorted(sorted_ids[:-1], values.to(torch.int64))
        hit = sorted_ids[at] == values
        return torch.where(hit, rows[at], torch.full_like(values, self.default_row))


class IdMaps(nn.ModuleDict):
    """The managed tables' maps (one :class:`_TableMap` per managed table)."""

    def __init__(self, model: ModelConfig) -> None:
        managed = [t for t in model.tables if t.managed]
        super().__init__({t.name: _TableMap(t.id_budget) for t in managed})
        self.table_of = {f: t.name for t in managed for f in t.features}

    def remap(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``kjt`` with the managed features' raw ids replaced by rows."""

        def rows(key: str, raw: torch.Tensor) -> torch.Tensor | None:
            table = self.table_of.get(key)
            if table is None:
                return None
            table_map = self[table]
            assert isinstance(table_map, _TableMap)
            return table_map.lookup(raw)

        return map_features(kjt, rows)


def _remap_inputs(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    maps = getattr(module, MAPS)
    assert isinstance(maps, IdMaps)
    return (args[0], maps.remap(args[1]), *args[2:])


def split_maps(
    state: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A served model's state dict -> (the model's own entries, the maps' entries)."""
    prefix = MAPS + "."
    own = {k: v for k, v in state.items() if not k.startswith(prefix)}
    maps = {k: v for k, v in state.items() if k.startswith(prefix)}
    return own, maps


def attach_maps(
    model: nn.Module, config: ModelConfig, maps: Mapping[str, torch.Tensor], *, where: str
) -> nn.Module:
    """Gives ``model`` (built from ``config``, holding its trained weights) the managed
    tables' ``maps`` (``managed_ids.<table>.<part>``; extra parts such as the eviction
    metadata are ignored) and the hook that maps raw ids; ``model`` as it is when no table of
    ``config`` is managed."""
    if not any(t.managed for t in config.tables):
        return model
    ids = IdMaps(config)
    wanted = {f"{MAPS}.{name}.{part}" for name in ids for part in _PARTS}
    missing = sorted(wanted - set(maps))
    if missing:
        raise CheckpointError(f"{where} lacks the maps of its managed tables: {missing}")
    ids.load_state_dict({k[len(MAPS) + 1 :]: maps[k] for k in wanted}, strict=True)
    model.add_module(MAPS, ids)
    model.register_forward_pre_hook(_remap_inputs)
    return model


def read_maps(uri: str) -> dict[str, torch.Tensor]:
    """The managed tables' maps saved in a checkpoint or final model (``managed_ids.*``); empty
    when it holds none. Read in this process, with no process group."""
    md = storage_reader(uri).read_metadata()
    state: dict[str, Any] = {
        key: torch.empty(list(entry.size), dtype=entry.properties.dtype)
        for key, entry in md.state_dict_metadata.items()
        if key.startswith(MAPS + ".") and isinstance(entry, TensorStorageMetadata)
    }
    if state:
        try:
            dcp.load(state, storage_reader=storage_reader(uri), no_dist=True)
        except Exception as e:
            raise CheckpointError(f"{uri} is corrupt: reading its id maps failed ({e})") from None
    return state
