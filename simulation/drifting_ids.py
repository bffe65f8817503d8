"""A synthetic stream whose ids drift, for managed ids (docs/managed_ids.md): the rows of
:class:`~raytrec.data.synthetic.SyntheticCriteo`, each sparse id ``v`` of batch ``step`` sent
as the raw int64 id ``(v + (step // drift_every) * drift) * 2654435761 + 2**40``. Every
``drift_every`` steps the popular ids move on: new raw ids appear and old ones stop appearing."""

from __future__ import annotations

import dataclasses

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from raytrec.data.source import Batch
from raytrec.data.synthetic import SyntheticCriteo

__all__ = ["DriftingCriteo", "raw_id"]


def raw_id(v: torch.Tensor | int, window: int, drift: int) -> torch.Tensor | int:
    """The raw id of synthetic id ``v`` in drift window ``window``."""
    return (v + window * drift) * 2654435761 + (1 << 40)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DriftingCriteo(SyntheticCriteo):
    """:class:`SyntheticCriteo` with raw ids that drift (see the module doc)."""

    drift_every: int = 4
    drift: int = 3

    def make_batch(self, shard: int, step: int, batch_size: int) -> Batch:
        batch = super().make_batch(shard, step, batch_size)
        kjt = batch.sparse_features
        values = raw_id(kjt.values().to(torch.int64), step // self.drift_every, self.drift)
        assert isinstance(values, torch.Tensor)
        sparse = KeyedJaggedTensor(
            keys=kjt.keys(), values=values, lengths=kjt.lengths(), stride=kjt.stride()
        )
        return dataclasses.replace(batch, sparse_features=sparse)
