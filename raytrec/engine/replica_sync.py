"""A rank's replica-plane side: joining planes, syncing with replicas, healing, broadcasting.

Across gangs, rank k of every gang joins replica group k on the
:class:`~raytrec.engine.replica_plane.ReplicaPlane` of the generation. At the sync schedule's
steps the embedding shards and their optimizer state are averaged over the replica group
(local-SGD semantics for embeddings, as DMPCollection does on GPU; DMPCollection itself
requires CUDA), or, under a hierarchical schedule, over the rank's group at the level that is
due (:meth:`ReplicaSync.sync` with a :class:`~raytrec.sync.schedule.SyncDecision`). With
``sync.dense="every_step"`` the dense gradients are averaged over the replica group every step
(:meth:`ReplicaSync.average_dense_grads`), so dense weights stay identical everywhere; with
``sync.dense="with_schedule"`` dense parameters and dense optimizer state are averaged with the
embeddings instead, so a slow gang holds back only the gangs it syncs with.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import timedelta

import torch
import torch.distributed as dist

from raytrec.config import SyncConfig
from raytrec.engine.managed_rows import on_device, realigned
from raytrec.engine.rank_model import RankModel
from raytrec.engine.replica_plane import (
    LevelPlanes,
    ReplicaPlane,
    ReplicaPlaneError,
    in_place_flat,
)
from raytrec.engine.touched_rows import (
    SyncTraffic,
    average_rows,
    full_traffic,
    shard_bytes,
    syncs_whole,
)
from raytrec.sync.schedule import SyncDecision, SyncPlan, plan_sync

__all__ = ["GangPeerFailed", "ReplicaSync"]


class GangPeerFailed(ReplicaPlaneError):
    """This rank's replica collective succeeded, but another rank of its gang's failed: the
    gang leaves the step together (:meth:`ReplicaSync.leave_with_gang`)."""


class ReplicaSync:
    """This rank's groups on the replica plane and what it does with them."""

    def __init__(
        self,
        *,
        model: RankModel,
        store: dist.Store,
        config: SyncConfig,
        gang: int,
        gang_rank: int,
        gang_size: int,
        backend: str,
        timeout: timedelta,
    ) -> None:
        self._model = model
        self._store: dist.Store | None = store  # None once closed
        self.config = config  # the schedule and dense mode followed (read at each use)
        self._gang = gang
        self._gang_rank = gang_rank
        self._gang_size = gang_size
        self._backend = backend
        self._timeout = timeout
        self.replica: ReplicaPlane | None = None  # all live gangs of this generation
        self.sync_plan: SyncPlan | None = None
        self.levels: LevelPlanes | None = None  # this rank's group at each schedule level
        self._job_wide_plan: SyncPlan | None = None  # decide()'s plan when none was joined
        self.last_traffic: SyncTraffic | None = None  # what this rank's last sync moved
        self._shard_bytes: dict[bool, int] = {}  # by optimizer_state: the shapes never change

    def join_replica_plane(self, *, generation: int, member_rank: int, size: int) -> None:
        """(Re)builds this rank's replica group for ``generation``.

        A sync plan joined for an earlier generation is dropped: its groups
        name gangs that may be gone. Join the new generation's with
        :meth:`join_sync_plan`.
        """
        assert self._store is not None, "closed"
        self.replica = ReplicaPlane.build(
            self._store,
            generation=generation,
            replica_group=self._gang_rank,
            rank=member_rank,
            size=size,
            backend=self._backend,
            timeout=self._timeout,
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
        assert self._store is not None, "closed"
        assert self.replica is not None, "join_replica_plane() first"
        self.levels = LevelPlanes.build(
            self._store,
            plan=plan,
            gang=self._gang,
            job_wide=self.replica,
            backend=self._backend,
            timeout=self._timeout,
        )
        self.sync_plan = plan

    def abort(self) -> None:
        """Aborts this rank's replica-plane groups (all levels), failing pending collectives."""
        planes = list(self.levels.planes) if self.levels is not None else []
        if self.replica is not None and all(p is not self.replica for p in planes):
            planes.append(self.replica)
        for plane in planes:
            plane.abort()

    def close(self) -> None:
        self._store = None
        self.replica = None
        self.sync_plan = None
        self.levels = None

    # -- every step -----------------------------------------------------------

    def average_dense_grads(self) -> bool:
        """With ``sync.dense="every_step"``: averages the dense gradients over the replica
        group. A failed all-reduce leaves them as they were (this gang's own). Returns whether
        it averaged with other gangs (every rank of a gang answers alike)."""
        assert self.replica is not None, "join_replica_plane() first"
        if self.config.dense != "every_step" or self.replica.size == 1:
            # DDP averaged them over the gang; the schedule averages dense parameters; or this
            # rank is its replica group's only member.
            return False
        grads = [p.grad for p in self._model.dense_params.values() if p.grad is not None]
        self.replica.average_(grads)
        return True

    def leave_with_gang(self, ok: bool) -> None:
        """After a collective over the replica planes, which each rank of a gang runs in its
        own replica group: whether every rank of the gang finished its own (``ok``: this
        one did), agreed over the gang. Raises :class:`GangPeerFailed` when this rank's
        finished and another's did not.

        Without it, a rank whose replica group lost a member fails out of the step while its
        gang peer, whose group finished, goes on into the next step's collectives over the
        gang, waits there for the rank that left and times out; a timed-out gloo pair is
        closed for good, so the gang's process group, and with it a gang whose every rank is
        alive, would be lost. Call with ``ok=False`` before raising a replica collective's
        failure, so that the peers stop at the same point. The wait is longer than the
        collective timeout: a peer still in its replica collective gets out of it (failed,
        aborted or done) within that timeout.
        """
        if self._gang_size == 1:
            return
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self._model.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        opts.timeout = 2 * self._timeout + timedelta(seconds=5)
        gang = dist.group.WORLD
        assert gang is not None, "the gang's process group is not initialised"
        gang.allreduce([flag], opts).wait()
        if ok and not flag.item():
            raise GangPeerFailed(
                "another rank of this gang failed its replica collective in this step; this "
                "rank stops with it"
            )

    # -- the schedule ---------------------------------------------------------

    def decide(self, step: int) -> SyncDecision:
        """The joined plan's decision for ``step``; without one, the job-wide schedule.

        Without a joined plan only a schedule with no lower levels can be
        followed (all groups are the whole replica plane).
        """
        replica = self.replica
        assert replica is not None, "join_replica_plane() first"
        plan = self.sync_plan
        if plan is None:
            if self.config.levels:
                raise RuntimeError("a hierarchical schedule needs join_sync_plan() first")
            plan = self._job_wide_plan
            if plan is None or plan.generation != replica.generation:
                gangs = range(replica.size)
                plan = plan_sync(self.config, generation=replica.generation, live_gangs=gangs)
                self._job_wide_plan = plan
        return plan.decide(step)

    def syncs_with_others(self, step: int) -> bool:
        """Whether the sync due after ``step`` averages with another gang (a group of one, such
        as a job of one gang, has nothing to average)."""
        decision = self.decide(step)
        if not decision.due:
            return False
        if self.sync_plan is None:  # job-wide, on the generation's replica plane
            assert self.replica is not None
            return self.replica.size > 1
        return len(decision.group_of(self._gang)) > 1

    def sync(
        self, decision: SyncDecision | None = None, *, optimizer_state: bool | None = None
    ) -> None:
        """Averages this rank's shards with its replicas: job-wide, or as ``decision`` says.

        With no decision: over all live gangs, optimizer state per
        ``optimizer_state`` (default ``sync.sync_optimizer_state``). With a
        decision from the sync plan: over this gang's group at the decided
        level, optimizer state when the decision includes it; nothing when no
        level is due. Embedding shards always (with the optimizer state: their fused state and
        step counters, :meth:`RankModel.shard_state`); with ``sync.dense="with_schedule"`` also
        dense parameters (and dense optimizer state with the optimizer state).
        """
        assert self.replica is not None, "join_replica_plane() first"
        if decision is None:
            plane = self.replica
            if optimizer_state is None:
                optimizer_state = self.config.sync_optimizer_state
        else:
            if optimizer_state is not None:
                raise ValueError("optimizer_state comes from the decision; pass one or the other")
            if decision.level is None:
                return
            plane = self._plane_for(decision)
            optimizer_state = decision.optimizer_state
        if plane.size == 1:
            return  # a group of one: every tensor is already its own mean
        model = self._model
        dense: list[torch.Tensor] = []
        if self.config.dense == "with_schedule":
            dense = [p.data for p in model.dense_params.values()]
            if optimizer_state:
                dense += model.dense_optimizer_state()
        # The schedule's level, job-wide (the top one) for a sync without a decision.
        level = len(self.config.levels) if decision is None else decision.level
        assert level is not None
        touched = model.touched
        known = touched is not None and touched.valid(
            level, optimizer_state=optimizer_state, generation=plane.generation
        )
        rows = self.config.rows
        if rows == "touched" and syncs_whole(self._bytes(optimizer_state)):
            rows = "all"  # small shards: one whole all-reduce costs less than agreeing on rows
        if touched is not None and known and rows == "touched":
            counters = model.embedding_step_counters() if optimizer_state else []
            self.last_traffic = average_rows(
                plane,
                model.table_shards(optimizer_state=optimizer_state),
                [touched.rows(k, level, optimizer_state=optimizer_state) for k in touched.shards],
                max_share=self.config.touched_max_share,
                extra=counters,
                apart=dense,
                written=None if model.unpublished is None else model.unpublished.masks,
            )
        else:
            # rows: all, shards below WHOLE_SYNC_BELOW_BYTES, or touched sets unknown (each
            # level's first sync of a generation, after a heal or a load): the plain mean of
            # every row.
            tensors = model.shard_state(optimizer_state=optimizer_state)
            # Dense state in a buffer of its own, so the gang's ranks keep identical copies.
            plane.average_(tensors, apart=dense)
            self.last_traffic = full_traffic(tensors, dense, plane.size, model.tables)
            if model.unpublished is not None:
                model.unpublished.mark_all()
        model.shard_state_written(synced=True)
        if touched is not None:
            touched.synced(level, optimizer_state=optimizer_state, generation=plane.generation)

    def sync_without(self, rolled_back: Collection[int]) -> None:
        """A job-wide sync in which the members ``rolled_back`` (replica-plane member ranks) take
        the mean of the other members' state instead of adding their own to it: embedding
        shards with their fused optimizer state and step counters, and with
        ``sync.dense="with_schedule"`` the dense state too (with every step's dense all-reduce
        it is the same everywhere already). A gang that averaged with a lost gang at a lower
        level of a hierarchical schedule holds part of that gang's unsynced work
        (:mod:`raytrec.elastic.group_rollback`); its own since the last job-wide sync is
        replayed instead."""
        plane = self.replica
        assert plane is not None, "join_replica_plane() first"
        keep = plane.size - len(set(rolled_back))
        if keep < 1 or any(not 0 <= m < plane.size for m in rolled_back):
            raise ValueError(
                f"sync_without({sorted(rolled_back)}) on a replica plane of {plane.size} members "
                "needs at least one member left to take the mean of"
            )
        model = self._model
        tensors = model.shard_state(optimizer_state=True)
        dense = model.dense_state() if self.config.dense == "with_schedule" else []
        own = plane.rank not in rolled_back

        def mean_of_kept(flat: torch.Tensor) -> None:
            if not own:
                flat.zero_()
            wide = plane.sum_(flat)
            if wide.is_floating_point():
                wide.div_(keep)
            else:
                wide.div_(keep, rounding_mode="floor")
            if wide is not flat:
                flat.copy_(wide)

        in_place_flat(tensors, mean_of_kept, apart=dense)
        self.last_traffic = full_traffic(tensors, dense, plane.size, model.tables)
        # Every copy changed as a whole: the touched rows are forgotten (the next sync of each
        # level averages every row) and every row is due for publishing.
        model.shard_state_written()

    def _bytes(self, optimizer_state: bool) -> int:
        """What a whole sync of this rank's shards all-reduces (:func:`shard_bytes`)."""
        if optimizer_state not in self._shard_bytes:
            found = shard_bytes(self._model.tables, optimizer_state=optimizer_state)
            self._shard_bytes[optimizer_state] = found
        return self._shard_bytes[optimizer_state]

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
        group = decision.group_of(self._gang)
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

    # -- heal and re-forming ----------------------------------------------------

    def broadcast_dense(self, *, src: int, gang_src: int = 0) -> None:
        """Copies the dense parameters and dense optimizer state of gang rank ``gang_src`` of
        member ``src``'s gang to every rank.

        After a failure the survivors may disagree on the step that failed (some finished its
        dense all-reduce before the failure reached them, some did not); one survivor's dense
        state becomes everyone's, so dense state is identical again."""
        assert self.replica is not None, "join_replica_plane() first"
        replica = self.replica

        def copy(ids_state: list[torch.Tensor]) -> None:
            # The managed ids' maps too (a failure inside a merge can leave them one decision
            # apart), renewing the rows whose id the copy changed (realigned).
            tensors = self._model.dense_state() + ids_state
            # Ranks of one gang can disagree too (each sits in another replica group, and one
            # group's collective may have finished where another's failed): first gang rank
            # ``gang_src``'s copy within the gang, then member ``src``'s across gangs.
            if self._gang_size > 1:
                in_place_flat(tensors, lambda flat: dist.broadcast(flat, src=gang_src))
            replica.broadcast_(tensors, src=src)

        realigned(self._model, copy, replica.device)

    def broadcast_state(self, *, src: int) -> None:
        """Copies a live member's full state to the rest of the replica group (the managed
        ids' maps included, with the rows they map)."""
        assert self.replica is not None, "join_replica_plane() first"
        model = self._model
        replica = self.replica
        with on_device(model.ids_state(), replica.device) as ids_state:
            replica.broadcast_(model.shard_state() + model.dense_state() + ids_state, src=src)
        model.shard_state_written()
