"""The in-rank 2D engine: a gang world running DMP, plus a replica plane.

Inside a rank process the default ``torch.distributed`` group is the rank's
gang (world size L), and TorchRec's ``DistributedModelParallel`` shards the
model over it with the job's single plan. Across gangs, rank k of every gang
joins replica group k on the :class:`~raytrec.engine.replica_plane.ReplicaPlane`.

Per step: forward, backward (FBGEMM applies the embedding update inside
backward; DDP averages dense gradients over the gang). With
``sync.dense="every_step"`` the dense gradients are then averaged over the
replica group too, so every rank of the job applies the same dense update and
dense weights stay identical everywhere. At the sync schedule's steps the
embedding shards and their optimizer state are averaged over the replica
group (local-SGD semantics for embeddings, as DMPCollection does on GPU;
DMPCollection itself requires CUDA), or, under a hierarchical schedule, over
the rank's group at the level that is due (:meth:`RankEngine.sync` with a
:class:`~raytrec.sync.schedule.SyncDecision`). With
``sync.dense="with_schedule"`` dense parameters and dense optimizer state are
averaged with them instead of every step, so a slow gang holds back only the
gangs it syncs with.

After a loss, a replayed batch whose dense gradient already reached the dense parameters trains
with a zero dense gradient (``train_step(batch, dense=False)``), and a step whose dense
all-reduce failed keeps its gradients until the re-formed job finishes or drops that update
(:meth:`RankEngine.settle_failed_step`); :mod:`raytrec.elastic.dense` decides which.

This module knows nothing of Ray; the rank actor is a thin shell over it and
tests drive it with plain processes on gloo.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from raytrec._quiet import quiet_known_warnings
from raytrec.config import TrainConfig
from raytrec.data.source import Batch
from raytrec.data.spec import FeatureSpec
from raytrec.engine.dense_optimizer import (
    DENSE_OPTIMIZERS,
    build_dense_optimizer,
    dense_optimizer_kwargs,
    state_tensors,
)
from raytrec.engine.plan import apply_embedding_optimizer, sharders
from raytrec.engine.replica_plane import (
    RENDEZVOUS_TIMEOUT_S,
    LevelPlanes,
    ReplicaPlane,
    in_place_flat,
)
from raytrec.models import ModelFactory, build_train_model
from raytrec.sync.schedule import SyncDecision, SyncPlan, plan_sync

if TYPE_CHECKING:
    from raytrec.serving.model_spec import ModelSpec

__all__ = [
    "RENDEZVOUS_TIMEOUT_S",
    "RankEngine",
    "RankSpec",
    "StepInput",
    "StoreAddress",
    "dense_optimizer_kwargs",
]

# Kept for callers that built their own dense optimizer from these names.
_DENSE_OPTIMIZERS = DENSE_OPTIMIZERS


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreAddress:
    """Where the job's rendezvous store (hosted by the coordinator) listens, and the job's
    secret: every key the job writes or reads lies under it, so a client outside the job (who
    can reach the port but was not handed the secret through Ray) can neither read the job's
    keys nor write one the job would read."""

    host: str
    port: int
    secret: str = ""

    def connect(self, timeout: timedelta) -> dist.Store:
        """A client of the store, seeing the job's keys only."""
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout)
        return dist.PrefixStore(self.secret, store) if self.secret else store


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankSpec:
    """Everything a rank needs to build itself; picklable, sent to the rank actor."""

    rank: int  # position in the job
    gang: int
    gang_rank: int
    gang_size: int
    config: TrainConfig
    plan: ShardingPlan
    num_dense: int
    store: StoreAddress
    model_factory: ModelFactory = build_train_model
    timeout_s: float = 120.0  # collectives (failure detection); rendezvous waits longer
    # The row layout the job trains on (column names, vocabularies); None: raytrec's own
    # Parquet layout for the config. Saved with every checkpoint and final model.
    features: FeatureSpec | None = None

    def model_spec(self) -> ModelSpec:
        """What rebuilds this model outside training (written beside its saved state)."""
        from raytrec.serving.model_spec import ModelSpec

        if self.features is None:
            return ModelSpec.for_config(self.config, self.num_dense)
        return ModelSpec(model=self.config.model, num_dense=self.num_dense, features=self.features)


@dataclasses.dataclass(frozen=True, slots=True)
class StepInput:
    """One step's batch for :meth:`RankEngine.run_steps`: the batch (on the CPU), whether its
    dense gradient counts (``dense=False``: a replay whose dense gradient is already in the
    model) and the caller's name for it (a batch id)."""

    batch: Batch
    dense: bool = True
    tag: Any = None


def embedding_seed(seed: int, gang_rank: int) -> int:
    """The seed of the embedding shards a rank initialises: one seed per place in a gang,
    none equal to the dense layers' (``seed`` itself)."""
    return seed * 1_000_003 + gang_rank + 1


def dropout_seed(seed: int, rank: int) -> int:
    """The seed of job rank ``rank``'s dropout masks (``model.dropout``)."""
    return int(np.random.SeedSequence([seed, rank, 0xD5]).generate_state(1)[0])


class RankEngine:
    """One rank's model, optimizers and process groups."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.cfg = spec.config
        self.device = torch.device("cpu")
        self.step = 0  # optimizer steps taken
        self.replica: ReplicaPlane | None = None  # all live gangs of this generation
        self.sync_plan: SyncPlan | None = None
        self.levels: LevelPlanes | None = None  # this rank's group at each schedule level
        self._job_wide_plan: SyncPlan | None = None  # decide()'s plan when none was joined
        self._store: dist.Store | None = None
        # (logits, labels) of the last step, detached, for the rank's metrics.
        self.last_output: tuple[torch.Tensor, torch.Tensor] | None = None
        self._step_in_flight = False
        self._holding_failed_step = False  # dense gradients of a failed step kept, not applied
        # While a batch trains whose dense gradient is already in the model (a replay): hooks
        # that make its dense gradient zero (_set_dense_grads).
        self._mask_hooks: list[Any] = []
        # TorchRec's train pipeline (cfg.resolved_pipeline), made at the first pipelined step;
        # the inputs it has taken and not yet started, oldest first; and run_steps' callback.
        self._pipeline: Any = None
        self._taken: deque[StepInput] = deque()
        self._on_start: Callable[[StepInput], None] | None = None
        self._last_loss = torch.zeros(())
        self.sync_seconds = 0.0  # spent in train_steps' syncs

    # -- construction -------------------------------------------------------

    def build(self) -> None:
        """Joins the gang world, shards the model and builds the optimizers."""
        quiet_known_warnings()
        spec, cfg = self.spec, self.cfg
        if cfg.scaling.use_gpu:
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU.
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(max(1, int(cfg.scaling.cpus_per_rank)))
        # Rendezvous waits for the slowest rank to start (imports take seconds, more on a
        # loaded machine); collectives afterwards get the short timeout that failure detection
        # relies on.
        rendezvous = timedelta(seconds=max(spec.timeout_s, RENDEZVOUS_TIMEOUT_S))
        self._store = spec.store.connect(rendezvous)
        dist.init_process_group(
            backend=cfg.scaling.resolved_backend,
            store=dist.PrefixStore(f"gang{spec.gang}", self._store),
            rank=spec.gang_rank,
            world_size=spec.gang_size,
            timeout=rendezvous,
        )
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=spec.timeout_s))
        model = spec.model_factory(cfg.model, spec.num_dense, self.device, cfg.seed)
        apply_embedding_optimizer(model, cfg.optimizer)
        # DistributedModelParallel allocates this rank's embedding shards and initialises them
        # from the global generator: seeded here from the job's seed and the rank's place in
        # its gang, so that a run is reproducible (the other gangs then copy the first's state).
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(embedding_seed(cfg.seed, spec.gang_rank))
            self.model = DistributedModelParallel(
                module=model,
                env=ShardingEnv.from_process_group(dist.group.WORLD),
                device=self.device,
                plan=spec.plan,
                sharders=sharders(),
            )
        if cfg.model.dropout:
            # Dropout draws its masks from the global generator: one seed per job rank, from
            # the job's seed, so that a run with dropout reproduces too.
            torch.manual_seed(dropout_seed(cfg.seed, spec.rank))
        self.dense_params = dict(in_backward_optimizer_filter(self.model.named_parameters()))
        # Its state exists from here on with the shapes a stepped rank's has (Adam's moments
        # and step counts included), so every state movement works before the first step.
        self.dense_optimizer: KeyedOptimizerWrapper = build_dense_optimizer(
            self.dense_params, cfg.optimizer
        )
        self._tbes = _fused_tables(self.model)

    def _set_dense_grads(self, on: bool) -> None:
        """Whether the dense gradient of the batch training now counts. While it does not, a
        hook on every dense parameter makes its gradient zero: a tensor hook runs before the
        gradient is accumulated, so DDP (whose hooks run after accumulation) averages a zero
        for this rank's batch; every rank of the gang still applies the same dense update, and
        the other ranks' batches keep their weight. The hooks exist only then (each costs every
        backward a Python call)."""
        if on and self._mask_hooks:
            for hook in self._mask_hooks:
                hook.remove()
            self._mask_hooks = []
        elif not on and not self._mask_hooks:
            self._mask_hooks = [
                p.register_hook(torch.zeros_like) for p in self.dense_params.values()
            ]

    def join_replica_plane(self, *, generation: int, member_rank: int, size: int) -> None:
        """(Re)builds this rank's replica group for ``generation``.

        A sync plan joined for an earlier generation is dropped: its groups
        name gangs that may be gone. Join the new generation's with
        :meth:`join_sync_plan`.
        """
        assert self._store is not None, "build() first"
        self.replica = ReplicaPlane.build(
            self._store,
            generation=generation,
            replica_group=self.spec.gang_rank,
            rank=member_rank,
            size=size,
            backend=self.cfg.scaling.resolved_backend,
            timeout=timedelta(seconds=self.spec.timeout_s),
        )
        if self.sync_plan is not None and self.sync_plan.generation != generation:
            self.sync_plan = None
            self.levels = None

    def join_sync_plan(self, plan: SyncPlan) -> None:
        """Builds this rank's replica group at every lower level of ``plan``.

        ``plan`` is the same value on every rank (``plan_sync`` over the
        generation's live gangs); call after :meth:`join_replica_plane` for
        the same generation. Collective: every rank of every live gang calls it.
        """
        assert self._store is not None, "build() first"
        assert self.replica is not None, "join_replica_plane() first"
        self.levels = LevelPlanes.build(
            self._store,
            plan=plan,
            gang=self.spec.gang,
            job_wide=self.replica,
            backend=self.cfg.scaling.resolved_backend,
            timeout=timedelta(seconds=self.spec.timeout_s),
        )
        self.sync_plan = plan

    # -- state views ----------------------------------------------------------

    def embedding_weights(self) -> list[torch.Tensor]:
        """Views of this rank's embedding shards (one per local table shard), holding their true
        contents: a UVM-cached table's cache is written back first. Whoever writes into them
        calls :meth:`embeddings_written` afterwards."""
        self.write_back_caches()
        return [w for tbe in self._tbes for w in tbe.split_embedding_weights()]

    def write_back_caches(self) -> None:
        """Writes the rows a UVM-cached table's cache holds back to UVM (FBGEMM's write-back
        cache; nothing to do for a table without one), so the tables hold their true contents."""
        for tbe in self._tbes:
            tbe.flush()

    def embeddings_written(self) -> None:
        """After the tables' contents were overwritten (a sync, a heal, a checkpoint load): a
        UVM-cached table's cache no longer holds what its rows hold, so it is emptied and the
        next lookups read the rows from UVM."""
        for tbe in self._tbes:
            tbe.reset_cache_states()

    def embedding_optimizer_states(self) -> list[torch.Tensor]:
        """Views of the fused optimizer state (Adagrad sums, Adam moments, ...)."""
        return [s for tbe in self._tbes for states in tbe.split_optimizer_states() for s in states]

    def embedding_step_counters(self) -> list[torch.Tensor]:
        """The fused optimizer's step counters: FBGEMM's ``iter`` buffer (one int64 per
        table-batched kernel) where its optimizer reads it (fused Adam's bias correction, ...),
        which FBGEMM marks by keeping the buffer in the kernel's state dict. TorchRec's fused
        optimizer state does not hold it, so sync, heal, checkpoint and digest add it. Whoever
        writes into them calls :meth:`step_counters_written` afterwards."""
        return [
            tbe.iter
            for tbe in self._tbes
            if "iter" in tbe._buffers and "iter" not in tbe._non_persistent_buffers_set
        ]

    def step_counters_written(self) -> None:
        """After the step counters were overwritten: FBGEMM computes with a CPU copy of the
        counter (``iter_cpu``) that it reads from ``iter`` only while the copy is 0, so the copy
        is set here."""
        for tbe in self._tbes:
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

    def shard_state_written(self) -> None:
        """After :meth:`shard_state`'s tensors were overwritten."""
        self.embeddings_written()
        self.step_counters_written()

    def dense_state(self) -> list[torch.Tensor]:
        """Dense parameters and the dense optimizer's tensor state."""
        return [p.data for p in self.dense_params.values()] + self.dense_optimizer_state()

    def dense_optimizer_state(self) -> list[torch.Tensor]:
        """The dense optimizer's tensor state (Adagrad sums and step counts, Adam moments and
        step counts), by parameter and state key in a fixed order. It exists from
        :meth:`build` on, with the same shapes on a rank that has stepped and one that has
        not."""
        return list(state_tensors(self.dense_optimizer, self.dense_params))

    # -- training -------------------------------------------------------------

    def train_step(self, batch: Batch, *, dense: bool = True) -> float:
        """One forward/backward/update on this rank's local batch; returns the loss.

        ``dense=False``: the batch updates its embedding rows only; its dense gradient is zero
        (a replayed batch whose dense gradient already reached the dense parameters). The step
        still takes part in every collective, so it is a step like any other for the job.
        """
        return float(self._train_step(batch, dense=dense))

    def _train_step(self, batch: Batch, *, dense: bool) -> torch.Tensor:
        """:meth:`train_step`, its loss left on the device (a detached scalar)."""
        batch = batch.to(self.device)
        loss, (_, logits, labels) = self.model(batch)
        self._set_dense_grads(dense)
        try:
            loss.backward()
        finally:
            self._set_dense_grads(True)
        self.last_output = (logits.detach(), labels.detach())
        self._begin_dense_update()
        return loss.detach()

    def train_steps(
        self,
        take: Callable[[], StepInput],
        num_steps: int,
        on_start: Callable[[StepInput], None],
        on_sync: Callable[[], None] | None = None,
    ) -> Iterator[torch.Tensor]:
        """Trains ``num_steps`` steps on the inputs ``take()`` gives, syncing with the replicas
        after every step the schedule says (:meth:`decide`); yields each step's loss.
        ``on_sync()`` is called as each of those syncs begins.

        The steps run in segments that end at each sync due with another gang and at
        ``num_steps`` (each one :meth:`run_steps`), so a train pipeline holds no batch in flight
        at a sync, nor when this returns. Seconds spent syncing add up in ``sync_seconds``.
        """
        left = num_steps
        while left:
            n = next((k for k in range(1, left) if self._syncs_at(self.step + k)), left)
            yield from self.run_steps((take() for _ in range(n)), on_start)
            left -= n
            decision = self.decide(self.step)
            if decision.due:
                started = time.perf_counter()
                if on_sync is not None:
                    on_sync()
                self.sync(decision)
                self.sync_seconds += time.perf_counter() - started

    def _syncs_at(self, step: int) -> bool:
        """Whether the sync due after ``step`` averages with another gang (a group of one, such
        as a job of one gang, has nothing to average: its pipeline need not drain)."""
        decision = self.decide(step)
        if not decision.due:
            return False
        if self.sync_plan is None:  # job-wide, on the generation's replica plane
            assert self.replica is not None
            return self.replica.size > 1
        return len(decision.group_of(self.spec.gang)) > 1

    def run_steps(
        self, inputs: Iterable[StepInput], on_start: Callable[[StepInput], None]
    ) -> Iterator[torch.Tensor]:
        """Trains every input, in order; yields each step's loss (a detached scalar tensor, left
        on the device: reading it waits for the step) as the step ends.

        ``on_start(input)`` is called as each step begins (from then on its embedding update
        may happen, so the step counts: :meth:`abandon_failed_step`). With a train pipeline
        (``cfg.resolved_pipeline``) up to two inputs beyond the current one are taken from
        ``inputs`` ahead of their steps, and are copied and input-distributed while the current
        one trains; once ``inputs`` ends, the pipeline runs what it holds and is empty when the
        last loss is yielded. If a step fails, the inputs taken but not started are
        :meth:`unstarted` (nothing of them reached the model) and the pipeline is emptied.
        """
        if self.cfg.resolved_pipeline == "off":
            for item in inputs:
                on_start(item)
                yield self._train_step(item.batch, dense=item.dense)
            return
        pipeline = self._pipeline or self._make_pipeline()
        self._taken.clear()

        def batches() -> Iterator[Batch]:
            for item in inputs:
                self._taken.append(item)
                yield item.batch

        source = batches()  # a new iterator: the pipeline starts filling again from it
        self._on_start = on_start
        try:
            while True:
                try:
                    _, logits, labels = pipeline.progress(source)
                except StopIteration:
                    return
                self.last_output = (logits, labels)
                yield self._last_loss
        except BaseException:
            pipeline.reset()  # the in-flight batches are dropped here (unstarted() names them)
            raise
        finally:
            self._on_start = None

    def unstarted(self) -> list[StepInput]:
        """The inputs :meth:`run_steps` took ahead and never started, oldest first (empty
        unless a pipelined step failed)."""
        return list(self._taken)

    def _make_pipeline(self) -> Any:
        from torchrec.distributed.train_pipeline.train_pipelines import (
            TrainPipelineSemiSync,
            TrainPipelineSparseDist,
        )

        cls = (
            TrainPipelineSemiSync
            if self.cfg.resolved_pipeline == "semi_sync"
            else TrainPipelineSparseDist
        )
        self._pipeline = cls(
            self.model,
            optimizer=cast(torch.optim.Optimizer, _PipelineSteps(self)),
            device=self.device,
            execute_all_batches=True,
            custom_model_fwd=self._pipelined_forward,
        )
        return self._pipeline

    def _pipelined_forward(self, batch: Any) -> tuple[torch.Tensor, Any]:
        """The pipeline's forward of its oldest batch: the step of the oldest input taken."""
        item = self._taken.popleft()
        if self._on_start is not None:
            self._on_start(item)
        self._set_dense_grads(item.dense)
        loss, output = self.model(batch)
        self._last_loss = loss.detach()
        return loss, output

    def _begin_dense_update(self) -> None:
        # FBGEMM updated the embeddings inside backward: from here on the step has happened,
        # whatever becomes of the dense update (see abandon_failed_step).
        self._set_dense_grads(True)
        self._step_in_flight = True
        self._average_dense_grads()
        self.dense_optimizer.step()
        self.dense_optimizer.zero_grad(set_to_none=False)
        self.step += 1
        self._step_in_flight = False

    def score(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's logits and the labels on this rank's local batch, in eval mode and under
        ``torch.no_grad()``: no backward, so no embedding or dense update. Every rank of the
        gang scores a batch at once (the forward is sharded)."""
        batch = batch.to(self.device)
        if self._pipeline is not None:
            # The pipeline's rewritten forwards read inputs it distributed; it attaches again
            # (rewriting them anew) at its next step.
            self._pipeline.detach()
        # FBGEMM advances its step counter on every forward, scoring included: put it back,
        # so that scoring leaves fused Adam's bias correction where training had it.
        counters = [(c, c.clone()) for c in self.embedding_step_counters()]
        self.model.eval()
        try:
            with torch.no_grad():
                _, (_, logits, labels) = self.model(batch)
        finally:
            self.model.train()
            if counters:
                for counter, value in counters:
                    counter.copy_(value)
                self.step_counters_written()
        return logits.detach(), labels.detach()

    def gang_agrees(self, ok: bool) -> bool:
        """Whether every rank of this gang says ``ok`` (a one-number all-reduce over the gang
        world; at once for a gang of one)."""
        if self.spec.gang_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def abandon_failed_step(self) -> bool:
        """Cleans up after a replica-plane failure inside :meth:`train_step`.

        The embedding update of that step already happened (fused into backward) and cannot
        be undone, so the step counts. Its dense update did not happen: the all-reduce failed,
        and a failed collective writes nothing back, so the dense gradients are still this
        gang's own (DDP's average over the gang). They are kept until the coordinator, once
        the job has re-formed, says whether to finish that update among the survivors or drop
        it (:meth:`settle_failed_step`). Returns whether this rank holds such a step (also when
        it is asked again, after a further loss interrupted the re-forming).
        """
        if self._step_in_flight:
            self.step += 1
            self._step_in_flight = False
            self._holding_failed_step = True
        elif not self._holding_failed_step:
            self.dense_optimizer.zero_grad(set_to_none=False)
        return self._holding_failed_step

    def settle_failed_step(self, *, finish: bool) -> None:
        """After re-forming: applies the failed step's dense update among this generation's
        gangs (``finish``), or drops it.

        Finishing averages the dense gradients each rank kept (:meth:`abandon_failed_step`;
        zero on a rank that had not reached the step) over the new replica plane and steps the
        dense optimizer, so the survivors' batches of that step reach the dense parameters
        once, averaged over the live gangs like any step's. Collective: every live rank calls
        it with the same ``finish``, after the dense state was made identical
        (:meth:`broadcast_dense`).
        """
        if finish:
            for p in self.dense_params.values():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._average_dense_grads()
            self.dense_optimizer.step()
        self.dense_optimizer.zero_grad(set_to_none=False)
        self._holding_failed_step = False

    def abort_replica_planes(self) -> None:
        """Aborts this rank's replica-plane groups (all levels), failing pending collectives."""
        planes = list(self.levels.planes) if self.levels is not None else []
        if self.replica is not None and all(p is not self.replica for p in planes):
            planes.append(self.replica)
        for plane in planes:
            plane.abort()

    def _average_dense_grads(self) -> None:
        assert self.replica is not None, "join_replica_plane() first"
        if self.cfg.sync.dense != "every_step" or self.replica.size == 1:
            # DDP averaged them over the gang; the schedule averages dense parameters; or this
            # rank is its replica group's only member.
            return
        grads = [p.grad for p in self.dense_params.values() if p.grad is not None]
        self.replica.average_(grads)

    def sync(
        self, decision: SyncDecision | None = None, *, optimizer_state: bool | None = None
    ) -> None:
        """Averages this rank's shards with its replicas: job-wide, or as ``decision`` says.

        With no decision: over all live gangs, optimizer state per
        ``optimizer_state`` (default ``sync.sync_optimizer_state``). With a
        decision from the sync plan: over this gang's group at the decided
        level, optimizer state when the decision includes it; nothing when no
        level is due. Embedding shards always (with the optimizer state: their fused state and
        step counters, :meth:`shard_state`); with ``sync.dense="with_schedule"`` also dense
        parameters (and dense optimizer state with the optimizer state).
        """
        assert self.replica is not None, "join_replica_plane() first"
        if decision is None:
            plane = self.replica
            if optimizer_state is None:
                optimizer_state = self.cfg.sync.sync_optimizer_state
        else:
            if optimizer_state is not None:
                raise ValueError("optimizer_state comes from the decision; pass one or the other")
            if decision.level is None:
                return
            plane = self._plane_for(decision)
            optimizer_state = decision.optimizer_state
        if plane.size == 1:
            return  # a group of one: every tensor is already its own mean
        tensors = self.shard_state(optimizer_state=optimizer_state)
        dense: list[torch.Tensor] = []
        if self.cfg.sync.dense == "with_schedule":
            dense = [p.data for p in self.dense_params.values()]
            if optimizer_state:
                dense += self.dense_optimizer_state()
        # Dense state in a buffer of its own, so the gang's ranks keep identical copies.
        plane.average_(tensors, apart=dense)
        self.shard_state_written()

    def _plane_for(self, decision: SyncDecision) -> ReplicaPlane:
        """This rank's group at the decision's level, checked against the decision's groups."""
        assert decision.level is not None and self.replica is not None
        if self.levels is None:
            # No plan joined: only a job-wide decision can be carried out, on the replica plane.
            sizes = [len(g) for g in decision.groups]
            if sizes != [self.replica.size]:
                raise RuntimeError(
                    f"step {decision.step} syncs level {decision.level} in groups of "
                    f"{sizes} gangs; join_sync_plan() first"
                )
            return self.replica
        group = decision.group_of(self.spec.gang)
        if decision.level >= len(self.levels.planes):
            raise RuntimeError(
                f"decision level {decision.level} is not in the joined sync plan "
                f"({len(self.levels.planes)} levels)"
            )
        if set(self.levels.groups[decision.level]) != set(group):
            raise RuntimeError(
                f"step {decision.step}: the decision's group {group} at level {decision.level} "
                f"is not this rank's group {self.levels.groups[decision.level]} of generation "
                f"{self.levels.generation}"
            )
        return self.levels.planes[decision.level]

    def decide(self, step: int) -> SyncDecision:
        """The joined plan's decision for ``step``; without one, the job-wide schedule.

        Without a joined plan only a schedule with no lower levels can be
        followed (all groups are the whole replica plane).
        """
        replica = self.replica
        assert replica is not None, "join_replica_plane() first"
        plan = self.sync_plan
        if plan is None:
            if self.cfg.sync.levels:
                raise RuntimeError("a hierarchical schedule needs join_sync_plan() first")
            plan = self._job_wide_plan
            if plan is None or plan.generation != replica.generation:
                gangs = range(replica.size)
                plan = plan_sync(self.cfg.sync, generation=replica.generation, live_gangs=gangs)
                self._job_wide_plan = plan
        return plan.decide(step)

    def broadcast_dense(self, *, src: int, gang_src: int = 0) -> None:
        """Copies the dense parameters and dense optimizer state of gang rank ``gang_src`` of
        member ``src``'s gang to every rank.

        After a failure the survivors may disagree on the step that failed (some finished its
        dense all-reduce before the failure reached them, some did not); one survivor's dense
        state becomes everyone's, so dense state is identical again."""
        assert self.replica is not None, "join_replica_plane() first"
        tensors = self.dense_state()
        # Ranks of one gang can disagree too (each sits in another replica group, and one
        # group's collective may have finished where another's failed): first gang rank
        # ``gang_src``'s copy within the gang, then member ``src``'s across gangs.
        if self.spec.gang_size > 1:
            in_place_flat(tensors, lambda flat: dist.broadcast(flat, src=gang_src))
        self.replica.broadcast_(tensors, src=src)

    def broadcast_state(self, *, src: int) -> None:
        """Copies a live member's full state to the rest of the replica group."""
        assert self.replica is not None, "join_replica_plane() first"
        self.replica.broadcast_(self.shard_state() + self.dense_state(), src=src)
        self.shard_state_written()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.replica = None
        self.sync_plan = None
        self.levels = None
        self._store = None


class _PipelineSteps:
    """What a TorchRec train pipeline takes as its optimizer: its ``step()`` is the end of a
    raytrec step (the dense update, averaged over the replica group per ``sync.dense``, and the
    step count); its ``zero_grad()`` does nothing, the step having zeroed the gradients. The
    embedding update is FBGEMM's, inside backward, as in :meth:`RankEngine.train_step`."""

    def __init__(self, engine: RankEngine) -> None:
        self._engine = engine
        self.param_groups = engine.dense_optimizer.param_groups  # SemiSync checks them

    def zero_grad(self, set_to_none: bool = False) -> None:
        # Nothing to do: every step ends with the gradients zeroed (RankEngine's dense update),
        # and a failed step's gradients must stay for settle_failed_step.
        pass

    def step(self, closure: Any = None) -> None:
        self._engine._begin_dense_update()


def _fused_tables(model: nn.Module) -> list[SplitTableBatchedEmbeddingBagsCodegen]:
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
    return found
