"""The batch-source contract between data pipelines and ranks.

A :class:`BatchSource` is configured on the driver and split once per job
into one :class:`BatchShard` per rank, in the job's rank order (the rank
order of :mod:`raytrec.cluster.topology`). Every shard is picklable: it travels to its
rank actor and yields :class:`torchrec.datasets.utils.Batch` values there
(dense features ``[B, num_dense]`` float32, sparse features as a
``KeyedJaggedTensor`` in key-major order, labels ``[B]`` float32).

The split happens where the pipeline needs it: a synthetic source only
records each shard's index, while a Ray Data source will hand each shard a
streaming split of one dataset.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence

from torchrec.datasets.utils import Batch

__all__ = ["Batch", "BatchShard", "BatchSource"]


class BatchShard(abc.ABC):
    """One rank's share of the data stream."""

    #: Whether :meth:`replay` can rebuild any batch by its id (elastic training hands a lost
    #: gang's uncommitted batches to the survivors this way).
    replayable: bool = False

    @abc.abstractmethod
    def batches(self, batch_size: int, *, start_step: int = 0) -> Iterator[Batch]:
        """Yields this shard's batches of ``batch_size`` rows, from batch ``start_step`` on."""

    def identified_batches(
        self, batch_size: int, *, start_step: int = 0
    ) -> Iterator[tuple[int | None, Batch]]:
        """:meth:`batches` with each batch's id (a non-negative int, unique in the job), or
        None where the source cannot name its batches."""
        return ((None, b) for b in self.batches(batch_size, start_step=start_step))

    def replay(self, batch_id: int, batch_size: int) -> Batch:
        """The batch with id ``batch_id`` again (any shard's, for replayable sources)."""
        raise NotImplementedError(f"{type(self).__name__} cannot replay batches")


class BatchSource(abc.ABC):
    """Describes a stream of training rows and splits it among ranks."""

    @property
    @abc.abstractmethod
    def dense_features(self) -> int:
        """Number of dense (float) features per row."""

    @property
    @abc.abstractmethod
    def sparse_features(self) -> Sequence[str]:
        """Names of the sparse features, in the order of the KeyedJaggedTensor keys."""

    @abc.abstractmethod
    def split(self, num_shards: int) -> list[BatchShard]:
        """Returns ``num_shards`` disjoint shards; shard ``r`` feeds the job's rank ``r``."""
