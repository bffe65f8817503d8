"""What the coordinator does at a boundary, as one union of values.

Every decision about the job, whoever's rule makes it, is one of these frozen dataclasses, and
:func:`raytrec.elastic.boundary.decide` is the one function that returns them. The coordinator
(:mod:`actors.coordinator`) and its parts carry them out with a ``match`` on
:data:`Decision`; nothing else in the control loop decides.

- :class:`Continue`: nothing to change here.
- :class:`Reform`: drop the gangs that lost a rank (none, after a failure with every rank
  alive) and start a new generation among the survivors.
- :class:`TotalLoss`: no gang is intact, so some shard may have no live copy; with ``point``,
  rebuild the whole job from that checkpoint.
- :class:`Grow`: placed gangs join, each healing from a live peer gang.
- :class:`Wait`: too few gangs, or the job's placement groups not ready: wait until
  ``deadline``.
- :class:`Drain`: give gangs back on purpose, without losing a row (a persistent straggler's:
  ``straggler`` says why).
- :class:`Checkpoint`: save one here.
- :class:`Evaluate`: run the held-out evaluation here.
- :class:`Stop`: stop training here and save what was trained (a user's request, the end of
  the data, early stopping).
- :class:`Fail`: end the job, saying why and which setting (``config_key``) bears on it.

:class:`RollbackPoint` is the checkpoint a :class:`TotalLoss` goes back to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from raytrec.elastic.membership import Gang

__all__ = [
    "Checkpoint",
    "Continue",
    "Decision",
    "Drain",
    "Evaluate",
    "Fail",
    "Grow",
    "NewGang",
    "Reform",
    "RollbackPoint",
    "SlowGang",
    "Stop",
    "TotalLoss",
    "Wait",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Continue:
    reason: str = ""
    #: The sync boundary at which ready placements will join, when some are waiting for one.
    join_at: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reform:
    """Drop ``drop``; the survivors form generation ``generation``."""

    drop: tuple[int, ...]
    survivors: tuple[int, ...]
    generation: int
    lost_ranks: tuple[int, ...]
    hung_ranks: tuple[int, ...]
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class RollbackPoint:
    """A committed checkpoint of this job and the batch accounting at its step."""

    uri: str
    step: int
    accounting: Mapping[str, Any]  # BatchAccounting.snapshot() taken at ``step``
    restores: int = 0  # rebuilds from it so far


@dataclasses.dataclass(frozen=True, kw_only=True)
class TotalLoss:
    """Every live copy of some shard may be gone: re-forming on survivors cannot help."""

    #: Replica groups (shard positions) whose every copy was on a lost rank.
    lost_shards: tuple[int, ...]
    lost_ranks: tuple[int, ...]
    reason: str
    #: The gangs that failed (every live gang, or those a host took with it).
    lost_gangs: tuple[int, ...] = ()
    #: The checkpoint the job is rebuilt from; None where only the loss itself was decided.
    point: RollbackPoint | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class NewGang:
    gang: Gang
    #: The live gang whose state (shards, optimizer state, dense state, step counters) it copies.
    heal_from: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Grow:
    """Add ``gangs`` at sync boundary ``join_step``; they form generation ``generation``."""

    gangs: tuple[NewGang, ...]
    join_step: int
    generation: int
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Wait:
    """Wait for resources until ``deadline`` (gangs below ``elastic.min_gangs``, or the job's
    placement groups not ready yet)."""

    deadline: float
    reason: str
    missing_gangs: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlowGang:
    """A gang slower than the others' median ``others_s`` (seconds a step) for the last
    ``intervals`` intervals in a row; ``step_s``: its step time in the last of them."""

    gang: int
    step_s: float
    others_s: float
    intervals: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Drain:
    """Give ``gangs`` back at this boundary; the job may have ``max_gangs`` from now on.
    ``straggler``: the one gang is evicted as a persistent straggler (it is replaced)."""

    gangs: tuple[int, ...]
    max_gangs: int
    reason: str
    straggler: SlowGang | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """Save a checkpoint at this boundary (after a job-wide sync)."""

    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Evaluate:
    """Run the held-out evaluation at this boundary."""

    step: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stop:
    """Stop training here: the model trained so far is synced, checked and saved.

    ``cause``: ``request`` (:meth:`~actors.coordinator.Coordinator.request_stop` or
    ``raytrec.stop``), ``data`` (a rank could not prepare what comes next: bad input or the
    end of its data) or ``early_stop`` (the evaluation metric stopped improving; ``metric``,
    ``best`` and ``best_step`` say how)."""

    cause: Literal["request", "data", "early_stop"]
    reason: str
    metric: str = ""
    best: float = 0.0
    best_step: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fail:
    """End the job. ``config_key``: the setting that bears on it (what to change, or what would
    have allowed the job to go on). ``needs_checkpoint``: only a checkpoint can bring it back."""

    reason: str
    config_key: str
    needs_checkpoint: bool = False


Decision = Continue | Reform | TotalLoss | Grow | Wait | Drain | Checkpoint | Evaluate | Stop | Fail
