"""The replica plane: standalone process groups across gangs.

Rank k of every gang holds the same embedding shards; those ranks form
replica group k. Their process group is built straight from a shared store
under a generation-specific prefix and is never registered with
``torch.distributed``: the gang's own world (the default group that
``DistributedModelParallel`` shards over) is untouched when membership
changes, and a new generation simply builds a new plane under a new prefix.

A hierarchical sync schedule (:mod:`raytrec.sync.schedule`) adds, for each
lower level, one such group per (level group, shard position): rank k of
the gangs in group j of level l, under ``gen{n}/level{l}/group{j}/replica{k}``.
:class:`LevelPlanes` holds this rank's group at each of those levels.

The ranks of one gang sit in different replica groups, so a failure (a lost gang's rank, or
an abort) can fail one rank's replica collective while its gang peer's succeeds; the peer then
waits in the next step's gang collectives until the coordinator, told of the loss, releases it
(docs/fault_tolerance.md, "Limits").
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from raytrec.sync.schedule import SyncPlan

__all__ = [
    "ABORT_POLL",
    "RENDEZVOUS_TIMEOUT_S",
    "LevelPlanes",
    "ReplicaPlane",
    "ReplicaPlaneError",
    "in_place_flat",
]

#: How long joining a gang world or a replica plane may wait for the other members.
RENDEZVOUS_TIMEOUT_S = 300.0
#: How often a gloo collective that is waiting looks whether its plane was aborted.
ABORT_POLL = timedelta(milliseconds=100)


def in_place_flat(
    tensors: Sequence[torch.Tensor],
    collective: Callable[[torch.Tensor], None],
    *,
    apart: Sequence[torch.Tensor] = (),
) -> None:
    """Runs ``collective`` on one flat buffer per dtype and writes the result back in place, so a
    sync costs one collective per dtype whatever the number of tables.

    The tensors in ``apart`` get buffers of their own. A ring all-reduce sums each element in an
    order set by its offset in the buffer, so tensors that every rank of a gang holds (dense
    state) must not share a buffer with the rank's own shards, whose sizes differ by rank: the
    gang's replica groups then sum them in different orders and the copies part by rounding.

    Nothing is written back unless every collective succeeded: a failed one leaves all the
    tensors as they were (a failed step's dense gradients stay this rank's own, to be finished
    after re-forming: :meth:`raytrec.engine.rank_engine.RankEngine.settle_failed_step`)."""
    by_dtype: dict[tuple[bool, torch.dtype], list[torch.Tensor]] = {}
    for own, part in ((False, tensors), (True, apart)):
        for t in part:
            by_dtype.setdefault((own, t.dtype), []).append(t)
    flats = []
    for group in by_dtype.values():
        flat = _flatten_dense_tensors(group)
        collective(flat)
        flats.append((group, flat))
    for group, flat in flats:
        for dst, value in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
            dst.copy_(value)


class ReplicaPlaneError(RuntimeError):
    """A replica-plane collective failed: a member died, hung past the timeout, or aborted."""


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
    # For a lower level of a hierarchical schedule: (level, group index); None: all live gangs.
    level_group: tuple[int, int] | None = None
    backend: str = "gloo"  # nccl: collectives take CUDA tensors and have no bitwise reductions
    # Set by abort(), from another thread too; a waiting collective looks at it (see _wait).
    _aborted: threading.Event = dataclasses.field(
        default_factory=threading.Event, init=False, repr=False, compare=False
    )

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
        level_group: tuple[int, int] | None = None,
    ) -> ReplicaPlane:
        """Joins the group; a collective with the other ``size - 1`` members over ``store``."""
        if level_group is None:
            name = f"gen{generation}/replica{replica_group}"
        else:
            level, group = level_group
            name = f"gen{generation}/level{level}/group{group}/replica{replica_group}"
        pg: Any = None
        if size == 1:
            rank = 0
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(dist.PrefixStore(name, store), rank, size, opts)
        else:
            # Gloo connects its full mesh within the given timeout: give the rendezvous as long
            # as the store allows, then the collectives the short, failure-detecting one.
            rendezvous = max(timeout, timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
            pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, rendezvous)
            pg._set_default_timeout(timeout)
        return cls(
            generation=generation,
            replica_group=replica_group,
            rank=rank,
            size=size,
            pg=pg,
            level_group=level_group,
            backend=backend,
        )

    def average_(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        apart: Sequence[torch.Tensor] = (),
    ) -> None:
        """Replaces every tensor with its mean over the group, in place (an integer tensor,
        such as a step counter, with its mean rounded down: equal counts stay as they are);
        ``apart`` as in :func:`in_place_flat` (the tensors every rank of a gang must keep
        identical)."""
        if self.pg is None or not (tensors or apart):
            return
        in_place_flat(tensors, self.mean_, apart=apart)

    def mean_(self, flat: torch.Tensor) -> None:
        """Replaces one contiguous buffer with its mean over the group, in place (as
        :meth:`average_` does each of its buffers). A failed collective may leave it partly
        summed: for a scratch buffer whose values are copied out afterwards."""
        if self.pg is None:
            return
        # Gloo has no AVG reduction: sum (half precision in fp32, so the mean loses no more
        # than its own rounding), then divide.
        wide = self.sum_(flat)
        if wide.is_floating_point():
            wide.div_(self.size)
        else:
            wide.div_(self.size, rounding_mode="floor")
        if wide is not flat:
            flat.copy_(wide)

    def sum_(self, flat: torch.Tensor) -> torch.Tensor:
        """The sum over the group of one contiguous buffer: half precision summed in fp32 and
        returned in fp32 (``flat`` then holds its own values still), any other dtype summed in
        ``flat`` itself and returned."""
        wide = flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat
        if self.pg is not None:
            self._wait(self.pg.allreduce([wide]))
        return wide

    @property
    def device(self) -> torch.device:
        """Where this plane's collectives take their tensors."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every member's ``tensor`` (all of one shape, on :attr:`device`), stacked in member
        order."""
        if self.pg is None:
            return tensor.unsqueeze(0).clone()
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self._wait(self.pg.allgather([out], [tensor]))
        return torch.stack(out)

    def bitwise_or_(self, tensor: torch.Tensor) -> None:
        """Replaces an integer ``tensor`` with the bitwise OR of every member's, in place (gloo
        only: NCCL has no bitwise reductions)."""
        if self.pg is None:
            return
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.BOR  # type: ignore[assignment]
        self._wait(self.pg.allreduce([tensor], opts))

    def _wait(self, work: Any) -> None:
        """Waits for a collective. When it fails (a member died, or the group was aborted),
        this member aborts the group too: gloo's ring collectives only fail fast at the dead
        member's neighbours, and aborting closes this member's connections, so the failure
        reaches every member at once instead of after the collective timeout.

        Gloo's own ``abort`` fails later collectives but leaves one already waiting for a
        member that will never come (alive, but gone from the step) to the collective timeout.
        So a gloo collective is waited for in slices of :data:`ABORT_POLL`, and a wait that
        :meth:`abort` marked ends after the slice it is in. (A wait on the collective's future
        would end at once, but hands every collective from thread to thread: about 1 ms more
        each on a busy machine, every step.) NCCL's abort ends its collectives itself."""
        try:
            if self._aborted.is_set():
                raise RuntimeError("the plane was aborted")
            if self.backend == "nccl":
                work.wait()
                return
            while True:
                try:
                    work.wait(ABORT_POLL)
                    return
                except RuntimeError:
                    if work.is_completed():
                        work.wait()  # it ended meanwhile: its own result or error
                        return
                    if self._aborted.is_set():
                        raise RuntimeError(
                            "the plane was aborted while this collective waited"
                        ) from None
        except Exception as e:
            self.abort()
            raise ReplicaPlaneError(
                f"replica plane of generation {self.generation}, replica group "
                f"{self.replica_group}: a collective failed ({str(e).splitlines()[0][:200]})"
            ) from e

    def abort(self) -> None:
        """Closes this member's connections; a collective waiting now (within
        :data:`ABORT_POLL`) and later ones fail. Safe from another thread (the rank actor's
        control calls)."""
        self._aborted.set()
        if self.pg is not None and hasattr(self.pg, "abort"):
            self.pg.abort()

    def broadcast_(self, tensors: Sequence[torch.Tensor], *, src: int) -> None:
        """Copies the tensors of member ``src`` to every member, in place."""
        if self.pg is None or not tensors:
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        in_place_flat(tensors, lambda flat: self._wait(self.pg.broadcast([flat], opts)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LevelPlanes:
    """This rank's replica group at every level of one generation's sync plan.

    ``planes[l]`` averages among rank k of the gangs in this gang's group at
    level l. The top (job-wide) level is the generation's own
    :class:`ReplicaPlane`, shared rather than built twice.
    """

    generation: int
    planes: tuple[ReplicaPlane, ...]  # by level index, the last one job-wide
    groups: tuple[tuple[int, ...], ...]  # this gang's group (gang ids) at each level

    @classmethod
    def build(
        cls,
        store: dist.Store,
        *,
        plan: SyncPlan,
        gang: int,
        job_wide: ReplicaPlane,
        backend: str,
        timeout: timedelta,
    ) -> LevelPlanes:
        """Joins this rank's group at every lower level, lowest first (collectives per group)."""
        if job_wide.generation != plan.generation or job_wide.size != len(plan.live_gangs):
            raise ValueError(
                f"the job-wide replica plane (generation {job_wide.generation}, "
                f"{job_wide.size} gangs) does not match the sync plan (generation "
                f"{plan.generation}, {len(plan.live_gangs)} live gangs); join the "
                "generation's replica plane first"
            )
        planes, groups = [], []
        for level in plan.levels[:-1]:
            j = plan.group_index(gang, level.index)
            group = level.groups[j]
            planes.append(
                ReplicaPlane.build(
                    store,
                    generation=plan.generation,
                    replica_group=job_wide.replica_group,
                    rank=group.index(gang),
                    size=len(group),
                    backend=backend,
                    timeout=timeout,
                    level_group=(level.index, j),
                )
            )
            groups.append(group)
        planes.append(job_wide)
        groups.append(plan.levels[-1].groups[0])
        return cls(generation=plan.generation, planes=tuple(planes), groups=tuple(groups))
