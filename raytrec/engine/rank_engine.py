"""The in-rank 2D engine: a gang world running DMP, plus a replica plane.

Inside a rank process the default ``torch.distributed`` group is the rank's gang (world size
L), and TorchRec's ``DistributedModelParallel`` shards the model over it with the job's single
plan. Across gangs, rank k of every gang joins replica group k on the replica plane.
:class:`RankEngine` is the surface the rank actor and the tests use; the work is done by its
parts, one module each:

- :mod:`raytrec.engine.build`: joining the gang world, sharding the model, the optimizers;
- :mod:`raytrec.engine.rank_model`: the built model and views of its state;
- :mod:`raytrec.engine.stepping`: the step, the train pipeline, the syncs between steps;
- :mod:`raytrec.engine.replica_sync`: the replica plane, syncs, heals and broadcasts;
- :mod:`raytrec.engine.dense_update`: the dense update and settling a step that failed.

This module knows nothing of Ray; the rank actor is a thin shell over it and tests drive it
with plain processes on gloo.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.keyed import KeyedOptimizerWrapper

from raytrec.config import TrainConfig
from raytrec.data.source import Batch
from raytrec.engine.build import build_rank
from raytrec.engine.dense_optimizer import DENSE_OPTIMIZERS, dense_optimizer_kwargs
from raytrec.engine.dense_update import DenseUpdate
from raytrec.engine.rank_model import RankModel
from raytrec.engine.replica_plane import RENDEZVOUS_TIMEOUT_S, LevelPlanes, ReplicaPlane
from raytrec.engine.replica_sync import ReplicaSync
from raytrec.engine.spec import RankSpec, StoreAddress, dropout_seed, embedding_seed
from raytrec.engine.stepping import (
    StepBegins,
    StepEvent,
    StepFailed,
    StepInput,
    Stepper,
    StepResult,
)
from raytrec.sync.schedule import SyncDecision, SyncPlan

__all__ = [
    "RENDEZVOUS_TIMEOUT_S",
    "EngineParts",
    "RankEngine",
    "RankSpec",
    "StepFailed",
    "StepInput",
    "StepResult",
    "StoreAddress",
    "dense_optimizer_kwargs",
    "dropout_seed",
    "embedding_seed",
]

# Kept for callers that built their own dense optimizer from these names.
_DENSE_OPTIMIZERS = DENSE_OPTIMIZERS


@dataclasses.dataclass(frozen=True, eq=False)
class EngineParts:
    """A built rank's parts; each receives only what it uses."""

    model: RankModel
    replicas: ReplicaSync
    dense: DenseUpdate
    stepper: Stepper

    @classmethod
    def assemble(cls, spec: RankSpec, model: RankModel, store: dist.Store) -> EngineParts:
        cfg = spec.config
        replicas = ReplicaSync(
            model=model,
            store=store,
            config=cfg.sync,
            gang=spec.gang,
            gang_rank=spec.gang_rank,
            gang_size=spec.gang_size,
            backend=cfg.scaling.resolved_backend,
            timeout=timedelta(seconds=spec.timeout_s),
        )
        dense = DenseUpdate(model, replicas)
        stepper = Stepper(model, dense, replicas, pipeline=cfg.resolved_pipeline)
        return cls(model=model, replicas=replicas, dense=dense, stepper=stepper)


class RankEngine:
    """One rank's model, optimizers and process groups."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.cfg: TrainConfig = spec.config
        self._parts: EngineParts | None = None

    def build(self) -> None:
        """Joins the gang world, shards the model and builds the optimizers."""
        model, store = build_rank(self.spec)
        self._parts = EngineParts.assemble(self.spec, model, store)

    @property
    def parts(self) -> EngineParts:
        """The built parts (:meth:`build` first)."""
        assert self._parts is not None, "build() first"
        return self._parts

    # -- the built rank -------------------------------------------------------

    @property
    def state(self) -> RankModel:
        """The model, its optimizers and the views of their state."""
        return self.parts.model

    @property
    def device(self) -> torch.device:
        return self.state.device if self._parts is not None else torch.device("cpu")

    @property
    def model(self) -> DistributedModelParallel:
        return self.state.model

    @property
    def dense_params(self) -> dict[str, nn.Parameter]:
        return self.state.dense_params

    @property
    def dense_optimizer(self) -> KeyedOptimizerWrapper:
        return self.state.dense_optimizer

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        return self._parts.dense.step if self._parts is not None else 0

    @step.setter
    def step(self, step: int) -> None:
        self.parts.dense.step = step

    @property
    def replicas(self) -> ReplicaSync:
        """This rank's replica-plane side: its groups, syncs, heals and broadcasts."""
        return self.parts.replicas

    @property
    def replica(self) -> ReplicaPlane | None:
        """This rank's replica group of the generation (all live gangs)."""
        return self._parts.replicas.replica if self._parts is not None else None

    @replica.setter
    def replica(self, plane: ReplicaPlane | None) -> None:
        self.parts.replicas.replica = plane

    @property
    def sync_plan(self) -> SyncPlan | None:
        return self._parts.replicas.sync_plan if self._parts is not None else None

    @property
    def levels(self) -> LevelPlanes | None:
        """This rank's group at each level of the joined sync plan."""
        return self._parts.replicas.levels if self._parts is not None else None

    # State views (:class:`RankModel`), which sync, heal, checkpoint and digest move.

    def embedding_weights(self) -> list[torch.Tensor]:
        return self.state.embedding_weights()

    def write_back_caches(self) -> None:
        self.state.write_back_caches()

    def embeddings_written(self) -> None:
        self.state.embeddings_written()

    def embedding_optimizer_states(self) -> list[torch.Tensor]:
        return self.state.embedding_optimizer_states()

    def embedding_step_counters(self) -> list[torch.Tensor]:
        return self.state.embedding_step_counters()

    def step_counters_written(self) -> None:
        self.state.step_counters_written()

    def shard_state(self, *, optimizer_state: bool = True) -> list[torch.Tensor]:
        return self.state.shard_state(optimizer_state=optimizer_state)

    def shard_state_written(self) -> None:
        self.state.shard_state_written()

    def dense_state(self) -> list[torch.Tensor]:
        return self.state.dense_state()

    def dense_optimizer_state(self) -> list[torch.Tensor]:
        return self.state.dense_optimizer_state()

    # -- training (:mod:`raytrec.engine.stepping`) ----------------------------

    def train_step(self, batch: Batch, *, dense: bool = True) -> StepResult:
        """One forward/backward/update on this rank's local batch (:meth:`Stepper.train_step`).
        ``dense=False``: a replayed batch whose dense gradient already reached the dense
        parameters updates its embedding rows only."""
        return self.parts.stepper.train_step(StepInput(batch, dense=dense))

    def train_steps(self, inputs: Iterator[StepInput], num_steps: int) -> Iterator[StepEvent]:
        """Trains ``num_steps`` steps with the syncs the schedule puts between them
        (:meth:`Stepper.train_steps`)."""
        return self.parts.stepper.train_steps(inputs, num_steps)

    def run_steps(self, inputs: Iterable[StepInput]) -> Iterator[StepBegins | StepResult]:
        """Trains every input, in order, without syncs (:meth:`Stepper.run_steps`)."""
        return self.parts.stepper.run_steps(inputs)

    def score(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and labels on this rank's batch, in eval mode (:meth:`Stepper.score`)."""
        return self.parts.stepper.score(batch)

    def gang_agrees(self, ok: bool) -> bool:
        """Whether every rank of this gang says ``ok`` (a one-number all-reduce over the gang
        world; at once for a gang of one)."""
        if self.spec.gang_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    # -- a failed step (:mod:`raytrec.engine.dense_update`) -------------------

    def abandon_failed_step(self) -> bool:
        """After a replica-plane failure inside a step: whether this rank holds that step's
        dense update, not applied (:meth:`DenseUpdate.abandon_failed_step`)."""
        return self.parts.dense.abandon_failed_step()

    def settle_failed_step(self, *, finish: bool) -> None:
        """After re-forming: finishes the failed step's dense update among this generation's
        gangs, or drops it (:meth:`DenseUpdate.settle_failed_step`)."""
        self.parts.dense.settle_failed_step(finish=finish)

    # -- the replica plane (:mod:`raytrec.engine.replica_sync`) ---------------

    def join_replica_plane(self, *, generation: int, member_rank: int, size: int) -> None:
        self.replicas.join_replica_plane(generation=generation, member_rank=member_rank, size=size)

    def join_sync_plan(self, plan: SyncPlan) -> None:
        self.replicas.join_sync_plan(plan)

    def abort_replica_planes(self) -> None:
        """Aborts this rank's replica-plane groups (all levels), failing pending collectives."""
        self.replicas.abort()

    def decide(self, step: int) -> SyncDecision:
        return self.replicas.decide(step)

    def sync(
        self, decision: SyncDecision | None = None, *, optimizer_state: bool | None = None
    ) -> None:
        self.replicas.sync(decision, optimizer_state=optimizer_state)

    def sync_without(self, rolled_back: tuple[int, ...]) -> None:
        self.replicas.sync_without(rolled_back)

    def broadcast_dense(self, *, src: int, gang_src: int = 0) -> None:
        self.replicas.broadcast_dense(src=src, gang_src=gang_src)

    def broadcast_state(self, *, src: int) -> None:
        self.replicas.broadcast_state(src=src)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._parts is not None:
            self._parts.replicas.close()
