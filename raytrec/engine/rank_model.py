"""One rank's built model and optimizers, and views of the state its replicas share.

A :class:`RankModel` is what :func:`raytrec.engine.build.build_rank` makes: the
``DistributedModelParallel`` model, its dense parameters and optimizer, and the FBGEMM kernels
that hold the rank's embedding shards with their fused optimizer state. Its views list that
state in a fixed order (the same in every gang), which is what sync, heal, checkpoint and
digest move; whoever writes into a view calls the matching ``*_written`` method afterwards.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.keyed import KeyedOptimizerWrapper

from raytrec.engine.dense_optimizer import state_tensors

if TYPE_CHECKING:
    from torchrec.datasets.utils import Batch

    from raytrec.engine.managed_ids import ManagedIds
    from raytrec.engine.publish_rows import UnpublishedRows
    from raytrec.engine.touched_rows import TouchedRows

__all__ = ["RankModel", "fused_tables"]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class RankModel:
    """One rank's sharded model, dense optimizer and embedding kernels."""

    device: torch.device
    model: DistributedModelParallel
    dense_params: dict[str, nn.Parameter]
    dense_optimizer: KeyedOptimizerWrapper
    tables: tuple[SplitTableBatchedEmbeddingBagsCodegen, ...]  # fused_tables(model)
    # With sync.rows="touched": the rows this rank's lookups touched (TouchedRows.attach).
    touched: TouchedRows | None = None
    # With publish.every_n_steps: the rows that changed since the last publish.
    unpublished: UnpublishedRows | None = None
    # With managed tables (tables[].ids.policy="managed"): their raw id -> row maps, the same
    # on every rank of the job (docs/managed_ids.md); ``seed`` draws the rows they renew.
    ids: ManagedIds | None = None
    seed: int = 0

    def remapped(self, batch: Batch, step: int | None) -> Batch:
        """``batch`` with its managed features' raw ids mapped to rows; ``step``: the step
        that trains it (its ids are observed for the next merge), None when only scoring."""
        if self.ids is None:
            return batch
        return dataclasses.replace(
            batch, sparse_features=self.ids.remap(batch.sparse_features, step=step)
        )

    def ids_state(self) -> list[torch.Tensor]:
        """The managed ids' maps (live tensors), identical on every rank of the job: moved by
        heals and re-forming, saved by checkpoints, covered by the state digest."""
        return self.ids.state() if self.ids is not None else []

    def embedding_weights(self) -> list[torch.Tensor]:
        """Views of this rank's embedding shards (one per local table shard), holding their true
        contents: a UVM-cached table's cache is written back first. Whoever writes into them
        calls :meth:`embeddings_written` afterwards."""
        self.write_back_caches()
        return [w for tbe in self.tables for w in tbe.split_embedding_weights()]

    def write_back_caches(self) -> None:
        """Writes the rows a UVM-cached table's cache holds back to UVM (FBGEMM's write-back
        cache; nothing to do for a table without one), so the tables hold their true contents."""
        for tbe in self.tables:
            tbe.flush()

    def embeddings_written(self, *, synced: bool = False) -> None:
        """After the tables' contents were overwritten (a sync, a heal, a checkpoint load): a
        UVM-cached table's cache no longer holds what its rows hold, so it is emptied and the
        next lookups read the rows from UVM. Unless ``synced`` (the replica group's mean was
        written), the touched rows are forgotten: the next sync averages every row."""
        for tbe in self.tables:
            tbe.reset_cache_states()
        if self.touched is not None and not synced:
            self.touched.forget()
        if self.unpublished is not None and not synced:
            self.unpublished.mark_all()

    def embedding_optimizer_states(self) -> list[torch.Tensor]:
        """Views of the fused optimizer state (Adagrad sums, Adam moments, ...)."""
        return [s for tbe in self.tables for states in tbe.split_optimizer_states() for s in states]

    def embedding_step_counters(self) -> list[torch.Tensor]:
        """The fused optimizer's step counters: FBGEMM's ``iter`` buffer (one int64 per
        table-batched kernel) where its optimizer reads it (fused Adam's bias correction, ...),
        which FBGEMM marks by keeping the buffer in the kernel's state dict. TorchRec's fused
        optimizer state does not hold it, so sync, heal, checkpoint and digest add it. Whoever
        writes into them calls :meth:`step_counters_written` afterwards."""
        return [
            tbe.iter
            for tbe in self.tables
            if "iter" in tbe._buffers and "iter" not in tbe._non_persistent_buffers_set
        ]

    def step_counters_written(self) -> None:
        """After the step counters were overwritten: FBGEMM computes with a CPU copy of the
        counter (``iter_cpu``) that it reads from ``iter`` only while the copy is 0, so the copy
        is set here."""
        for tbe in self.tables:
            if "iter" in tbe._buffers:
                tbe.iter_cpu = tbe.iter.detach().cpu().clone()

    def shard_state(self, *, optimizer_state: bool = True) -> list[torch.Tensor]:
        """This rank's embedding shards, and (``optimizer_state``) their fused optimizer state
        and step counters: what its replicas average and a heal copies. The weights are
        written back from a UVM cache first (:meth:`embedding_weights`)."""
        tensors = self.embedding_weights()
        if optimizer_state:
            tensors += self.embedding_optimizer_states() + self.embedding_step_counters()
        return tensors

    def table_shards(self, *, optimizer_state: bool = True) -> list[tuple[torch.Tensor, ...]]:
        """Per local table shard (in :meth:`embedding_weights`' order): its weights and, with
        ``optimizer_state``, its fused optimizer state tensors, each indexed by row first."""
        self.write_back_caches()
        shards: list[tuple[torch.Tensor, ...]] = []
        for tbe in self.tables:
            weights = tbe.split_embedding_weights()
            states = tbe.split_optimizer_states() if optimizer_state else []
            if len(states) != len(weights):  # SGD keeps none
                states = [[] for _ in weights]
            shards += [(w, *s) for w, s in zip(weights, states, strict=True)]
        return shards

    def shard_state_written(self, *, synced: bool = False) -> None:
        """After :meth:`shard_state`'s tensors were overwritten (``synced``: with the replica
        group's mean, :meth:`embeddings_written`)."""
        self.embeddings_written(synced=synced)
        self.step_counters_written()

    def dense_state(self) -> list[torch.Tensor]:
        """Dense parameters and the dense optimizer's tensor state."""
        return [p.data for p in self.dense_params.values()] + self.dense_optimizer_state()

    def dense_optimizer_state(self) -> list[torch.Tensor]:
        """The dense optimizer's tensor state (Adagrad sums and step counts, Adam moments and
        step counts), by parameter and state key in a fixed order. It exists from the build on,
        with the same shapes on a rank that has stepped and one that has not."""
        return list(state_tensors(self.dense_optimizer, self.dense_params))


def fused_tables(model: nn.Module) -> tuple[SplitTableBatchedEmbeddingBagsCodegen, ...]:
    """The FBGEMM table-batched kernels that hold this rank's shards, in a fixed order.

    Sharded modules keep their lookups in a plain list (``_lookups``), not as
    registered children, so ``model.modules()`` does not reach the kernels;
    this walks both, as DMPCollection does. The order depends only on the
    model and the plan, both the same in every gang, so list position k names
    the same shard in every replica.
    """
    found: list[SplitTableBatchedEmbeddingBagsCodegen] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if isinstance(module, SplitTableBatchedEmbeddingBagsCodegen):
            found.append(module)
        for lookup in getattr(module, "_lookups", None) or ():
            visit(lookup)
        for child in module.children():
            visit(child)

    visit(model)
    return tuple(found)
