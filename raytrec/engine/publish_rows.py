"""Rows to publish (``publish`` in the config, docs/serving.md): which rows of this rank's table
shards may have changed since the job's last publish, read out under their tables' global ids
for the coordinator to write as a delta.

A row changes when a lookup touches it (the fused optimizer updates it in the backward), when a
replica sync writes its group's mean into it, or when its shard is overwritten (a heal, a
checkpoint load). Lookups are recorded by a forward pre-hook on each FBGEMM kernel (the
touched-row sync's, :func:`~raytrec.engine.touched_rows.record_lookups`); a sync marks the rows
it wrote (every row of a shard it averaged whole); an overwrite marks every row. The set is the
publish's own: a sync does not clear it, a publish does (:meth:`UnpublishedRows.published`).
Before the first publish (the base) every row counts as unpublished.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.nn import Module

from raytrec.engine.touched_rows import record_lookups

__all__ = ["PublishedRows", "ShardRows", "UnpublishedRows", "read_unpublished"]

#: DLRMTrain's prefix of the model's own names (what an export's state dict is keyed by).
_PREFIX = "model."


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardRows:
    """A local table shard's unpublished rows: the table's state dict key (TorchRec's names, as
    in an export), its first column, the rows' global ids and their values ``[n, cols]``."""

    key: str
    col_offset: int
    ids: torch.Tensor
    rows: torch.Tensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishedRows:
    """What one rank hands over for a delta: its shards' unpublished rows, and (gang rank 0
    only) the dense state dict, copied."""

    shards: tuple[ShardRows, ...]
    dense: dict[str, torch.Tensor]


class UnpublishedRows:
    """Per local table shard (the order of ``split_embedding_weights`` over ``kernels``), a
    mask of the rows that may have changed since the last publish (module doc)."""

    def __init__(self, kernels: Sequence[SplitTableBatchedEmbeddingBagsCodegen]) -> None:
        self.masks: list[torch.Tensor] = []
        self._hooks = []
        for tbe in kernels:
            first = len(self.masks)
            for w in tbe.split_embedding_weights():
                self.masks.append(torch.ones(w.shape[0], dtype=torch.bool, device=w.device))
            record = functools.partial(
                record_lookups, self.mark, first, tuple(tbe.feature_table_map)
            )
            self._hooks.append(tbe.register_forward_pre_hook(record, with_kwargs=True))

    def mark(self, shard: int, ids: torch.Tensor) -> None:
        self.masks[shard][ids] = True

    def mark_all(self) -> None:
        """Every row of every shard may have changed (a heal, a load, a whole sync)."""
        for mask in self.masks:
            mask.fill_(True)

    def rows(self, shard: int) -> torch.Tensor:
        """The local rows of ``shard`` not published since they last changed, sorted."""
        return torch.nonzero(self.masks[shard]).flatten()

    def published(self) -> None:
        """A publish holds every row as it is now."""
        for mask in self.masks:
            mask.fill_(False)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def read_unpublished(
    model: Module,
    kernels: Sequence[SplitTableBatchedEmbeddingBagsCodegen],
    unpublished: UnpublishedRows,
    *,
    dense: bool,
    every_row: bool = False,
) -> PublishedRows:
    """Copies out the unpublished rows of this rank's shards (``every_row``: all their rows),
    and, with ``dense``, the dense state dict, keyed as an export is: the sharded model's state
    dict names each local shard's table and its global row and column offsets; its tensor is
    one of the kernels' weights."""
    weights = [w for tbe in kernels for w in tbe.split_embedding_weights()]
    index = {(w.data_ptr(), tuple(w.shape)): k for k, w in enumerate(weights)}
    shards: list[ShardRows] = []
    state: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        name = key.removeprefix(_PREFIX)
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                t = shard.tensor
                k = index.get((t.data_ptr(), tuple(t.shape)))
                if k is None:
                    raise RuntimeError(
                        f"table {name}: a local shard is none of this rank's FBGEMM tables"
                    )
                ids = torch.arange(t.shape[0]) if every_row else unpublished.rows(k)
                ids = ids.to(t.device)
                row, col = shard.metadata.shard_offsets
                shards.append(
                    ShardRows(
                        key=name,
                        col_offset=int(col),
                        ids=(ids + int(row)).cpu(),
                        rows=t.index_select(0, ids).cpu(),
                    )
                )
        elif dense and isinstance(value, torch.Tensor):
            state[name] = value.detach().cpu().clone()
    return PublishedRows(shards=tuple(shards), dense=state)
