"""The replica plane: standalone process groups across gangs.

Rank k of every gang holds the same embedding shards; those ranks form
replica group k. Their process group is built straight from a shared store
under a generation-specific prefix and is never registered with
``torch.distributed``: the gang's own world (the default group that
``DistributedModelParallel`` shards over) is untouched when membership
changes, and a new generation simply builds a new plane under a new prefix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["ReplicaPlane"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaPlane:
    """This rank's replica group for one generation."""

    generation: int
    replica_group: int  # the shard position k shared by the members
    rank: int  # position of this rank's gang among the group's live gangs
    size: int
    # A c10d Backend (gloo or nccl), or None for a group of one. Typed Any
    # because torch's stubs omit the collectives of Backend subclasses.
    pg: Any

    @classmethod
    def build(
        cls,
        store: dist.Store,
        *,
        generation: int,
        replica_group: int,
        rank: int,
        size: int,
        backend: str,
        timeout: timedelta,
    ) -> ReplicaPlane:
        if size == 1:
            return cls(generation=generation, replica_group=replica_group, rank=0, size=1, pg=None)
        prefix = dist.PrefixStore(f"gen{generation}/replica{replica_group}", store)
        pg: Any
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefix, rank, size, opts)
        else:
            pg = dist.ProcessGroupGloo(prefix, rank, size, timeout)
        return cls(generation=generation, replica_group=replica_group, rank=rank, size=size, pg=pg)

    def average_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replaces every tensor with its mean over the group, in place.

        Tensors are flattened per dtype into one buffer so each sync is one
        collective per dtype, whatever the number of tables.
        """
        if self.pg is None or not tensors:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = _flatten_dense_tensors(group)
            # Gloo has no AVG reduction: sum, then divide.
            self.pg.allreduce([flat]).wait()
            flat.div_(self.size)
            for dst, src in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                dst.copy_(src)

    def broadcast_(self, tensors: Sequence[torch.Tensor], *, src: int) -> None:
        """Copies the tensors of member ``src`` to every member, in place."""
        if self.pg is None or not tensors:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = _flatten_dense_tensors(group)
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            self.pg.broadcast([flat], opts).wait()
            for dst, s in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                dst.copy_(s)
