"""How many steps a job trains: ``num_steps``, or when it is None every batch of the data.

``TrainConfig.num_steps=None`` asks for ``data.epochs`` passes over the data and no more. Only a
source with an end can say how many steps that is: Parquet, whose footers give the rows, and so
the batches of every rank (read by index: the plan's steps per rank; streaming: each rank's
equal share of every epoch, cut into batches). The endless synthetic source, and sources of the
caller's whose length is unknown, need ``num_steps``. The driver resolves it once, after
splitting the source and before any rank starts, so every later reader (the coordinator's end
step, the progress bar, the ledger) sees one number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from raytrec.data.source import BatchShard
from raytrec.errors import ConfigError

__all__ = ["data_steps", "endless_refusal", "resolve_num_steps"]


def endless_refusal(source: str) -> str:
    """Why ``num_steps=None`` cannot be resolved for a source (``source``: what it is)."""
    return (
        f"num_steps=None takes the job's length from data.epochs passes over the data, but "
        f"{source} has no known end: set num_steps (the steps every rank trains)"
    )


def resolve_num_steps(num_steps: int | None, data_steps: int | None, *, source: str) -> int:
    """``num_steps`` when given, else ``data_steps`` (the batches per rank of all the data's
    epochs; None for a source with no known end, which is refused naming ``source``)."""
    if num_steps is not None:
        return num_steps
    if data_steps is None:
        raise ConfigError(endless_refusal(source))
    if data_steps < 1:
        raise ConfigError(f"{source} holds no batch to train: num_steps=None resolves to 0")
    return data_steps


def data_steps(shards: Sequence[BatchShard], batch_size: int) -> int | None:
    """Batches each rank trains over all the data's epochs, from a split of a Parquet source
    (read by index or streaming); None for other sources."""
    from raytrec.data.parquet import ParquetShard
    from raytrec.data.parquet_indexed import IndexedParquetShard

    if not shards:
        return None
    first = shards[0]
    if isinstance(first, IndexedParquetShard):
        return first.plan(batch_size).num_steps
    if isinstance(first, ParquetShard):
        # Every shard receives the same rows per epoch (streaming_split(equal=True), padded).
        return first.epochs * math.ceil(first.rows_per_epoch / batch_size)
    return None
