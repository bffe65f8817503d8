"""The loss of the coordinator, as a fault of the fault-space simulation.

A ``coordinator_dies`` fault of a schedule ends the in-process coordinator where a process death
would: at a step (through the coordinator's own ``kill_coordinator`` fault, which its journal
fires as it books that step) or as one of a rank's calls is made (in a recovery, a checkpoint
save, a heal, a join...). The kill raises :class:`CoordinatorKilled`, a ``BaseException`` that
no handler of the coordinator's takes for a failure of its own, so nothing of that coordinator
runs after it. The fake ranks it owned die with it (fate sharing) and its placements are
released; the run then goes on as the driver's: :class:`~raytrec.restarts.CoordinatorSeat`
decides, from the run's journal, whether and from which checkpoint a new coordinator starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from raytrec.checkpoint.layout import CheckpointStore
from raytrec.checkpoint.manifest import Manifest, ModelSignature
from simulation.doubles.fake_faults import AtCall
from simulation.doubles.fake_group import FakeWorkerGroup
from simulation.doubles.fake_rank import FakePlacement, RankState

__all__ = ["CoordinatorDies", "CoordinatorKilled", "LosableGroup", "kill_coordinator"]

#: The cause a rank of a lost coordinator dies of.
OWNER_DIED = "ActorDiedError: the actor's owner (the coordinator) died"


class CoordinatorKilled(BaseException):
    """The coordinator's process died here (BaseException: the coordinator's ``except
    Exception`` handlers let it through, as a SIGKILL would leave them no chance to run)."""


def kill_coordinator() -> None:
    raise CoordinatorKilled("the coordinator's process was killed (a coordinator_dies fault)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorDies(AtCall):
    """The coordinator dies as rank ``rank``'s ``nth`` ``on`` call is made (``action``:
    :func:`kill_coordinator`)."""


class LosableGroup(FakeWorkerGroup):
    """The fake worker group, outliving the coordinators of one run: :meth:`coordinator_lost`
    ends the ranks and placements of a lost one; its checkpoints stay (with a manifest on disk
    holding their accounting, which a resuming coordinator reads)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.placed: list[FakePlacement] = []

    def place(self, spec: Any, *, name: str = "") -> FakePlacement:
        placement = super().place(spec, name=name)
        self.placed.append(placement)
        return placement

    def save_checkpoint(self, states: list[RankState], ops: Any) -> dict[int, Any]:
        out = super().save_checkpoint(states, ops)
        root = ops[states[0].spec.rank].args[0]
        step, uri = next(iter(out.values()))
        _, _, generation, extra = self.checkpoints[uri]
        store = CheckpointStore(root)
        pending = store.begin(step)
        store.commit(pending, _manifest(step, generation, extra))
        return out

    def coordinator_lost(self) -> None:
        """Fate sharing: every rank the lost coordinator created dies, its placements are
        released, and the next coordinator starts its ranks (numbered from 0 again) anew."""
        now = self.clock.now
        for rank in self._ranks.values():
            self._kill(rank, OWNER_DIED, at=now)
        self._time_passed()
        for placement in self.placed:
            self.release(placement)
        self.placed = []
        self._ranks = {}
        self.copies = {}
        self._runs = {}
        self._live = []


def _manifest(step: int, generation: int, extra: dict[str, Any]) -> Manifest:
    return Manifest(
        step=step,
        generation=generation,
        gang_size=1,
        num_gangs=1,
        sharding_type="fake",
        signature=ModelSignature(
            arch="fake", tables=(), embedding_optimizer="", dense_optimizer="", dense_params={}
        ),
        files={},
        extra=extra,
        created_unix=0.0,
    )
