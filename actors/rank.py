"""The rank actor: a thin Ray shell over :class:`raytrec.engine.rank.RankEngine`.

It owns one rank's engine and its data shard, and answers the coordinator's
calls. All training logic lives in the engine, which tests drive without Ray.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray
import torch

from raytrec.data.source import Batch, BatchShard
from raytrec.engine.rank import RankEngine, RankSpec

__all__ = ["RankWorker"]


class RankWorker:
    """One rank of the job. Made a Ray actor by the coordinator (``ray.remote(RankWorker)``)."""

    def __init__(self, spec: RankSpec, shard: BatchShard) -> None:
        self.spec = spec
        self.shard = shard
        self.engine = RankEngine(spec)
        self._batches: Iterator[Batch] | None = None

    def build(self) -> dict[str, Any]:
        """Joins the gang world and shards the model; returns where this rank runs."""
        self.engine.build()
        self._batches = self.shard.batches(self.spec.config.data.batch_size)
        return {
            "rank": self.spec.rank,
            "gang": self.spec.gang,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }

    def join_replica_plane(self, generation: int, member_rank: int, size: int) -> None:
        self.engine.join_replica_plane(generation=generation, member_rank=member_rank, size=size)

    def broadcast_state(self, src: int) -> None:
        self.engine.broadcast_state(src=src)

    def train(self, num_steps: int) -> dict[str, Any]:
        """Trains ``num_steps`` steps; returns losses and where the time went."""
        assert self._batches is not None, "build() first"
        engine, every = self.engine, self.spec.config.sync.sync_every
        losses: list[float] = []
        data_s = sync_s = 0.0
        start = time.perf_counter()
        for _ in range(num_steps):
            t0 = time.perf_counter()
            try:
                batch = next(self._batches)
            except StopIteration:
                raise RuntimeError(
                    f"rank {self.spec.rank}: the data source ran out after {engine.step} steps; "
                    "lower num_steps or raise the source's epochs"
                ) from None
            t1 = time.perf_counter()
            losses.append(engine.train_step(batch))
            data_s += t1 - t0
            if engine.step % every == 0:
                t2 = time.perf_counter()
                engine.sync()
                sync_s += time.perf_counter() - t2
        return {
            "rank": self.spec.rank,
            "step": engine.step,
            "losses": losses,
            "rows": num_steps * self.spec.config.data.batch_size,
            "seconds": time.perf_counter() - start,
            "data_wait_s": data_s,
            "sync_s": sync_s,
        }

    def sync(self) -> None:
        self.engine.sync()

    def save(self, path: str) -> None:
        """Writes this gang's model with torch.distributed.checkpoint (a collective in the gang)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self.engine.model.state_dict(), checkpoint_id=path)

    def state_arrays(self) -> dict[str, list[np.ndarray]]:
        """Copies of this rank's embedding shards, their optimizer state and dense state."""
        engine = self.engine
        return {
            "embedding_weights": _arrays(engine.embedding_weights()),
            "embedding_optimizer_states": _arrays(engine.embedding_optimizer_states()),
            "dense_state": _arrays(engine.dense_state()),
        }

    def state_digest(self) -> dict[str, str]:
        """Content hashes of this rank's shard state and dense state, to compare replicas."""
        engine = self.engine
        return {
            "shards": _digest(engine.embedding_weights() + engine.embedding_optimizer_states()),
            "dense": _digest(engine.dense_state()),
        }

    def close(self) -> None:
        self.engine.close()


def _arrays(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    return [t.detach().cpu().numpy().copy() for t in tensors]


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
