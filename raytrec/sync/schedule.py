"""Which gangs average their state after which step: synchronous, local and hierarchical SGD.

A schedule has levels, lowest first. Level ``l`` has a period (in steps) and a
group size (in gangs); the top level is the job-wide sync every
``sync_every`` steps. After step ``s`` only the highest level whose period
divides ``s`` syncs: its groups average embedding shards (and, when due,
optimizer state) among their members, and lower levels due at the same step
are skipped because the larger groups already contain them. Steps
``1..warmup_steps`` sync job-wide every step first.

A schedule is laid over one generation's live gangs by :func:`plan_sync`,
which returns a :class:`SyncPlan`; :meth:`SyncPlan.decide` turns a step into
a :class:`SyncDecision` value. Groups are cut from the live gangs in locality
order (gangs on the same host or rack next to each other), so the most
frequent, smallest groups stay on the fastest links.

Group sizes after a membership change (the remainder rule): with ``n`` live
gangs and a configured size ``s``, a level has ``n // s`` groups of ``s``
consecutive gangs and the last group also takes the ``n % s`` gangs left
over (it may hold up to ``2s - 1``). With fewer than ``s`` live gangs the
level is capped: one group of all ``n``. Because configured sizes divide
each other, every group still is a union of whole groups of the level below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from raytrec.cluster.topology import Topology
from raytrec.config import SyncConfig

__all__ = [
    "LocalityKey",
    "ScheduleError",
    "SyncDecision",
    "SyncLevel",
    "SyncPlan",
    "form_groups",
    "gang_locality",
    "plan_sync",
]

#: How close gangs are: gangs whose keys sort next to each other are grouped first. A tuple such
#: as ``(rack, host)`` orders rack-major, so a host's gangs share the lowest-level groups and a
#: rack's gangs the next ones.
LocalityKey = tuple[int | str, ...]

Groups = tuple[tuple[int, ...], ...]


class ScheduleError(ValueError):
    """Live gangs, locality or a step that a schedule cannot be laid over."""


def form_groups(ordered_gangs: Sequence[int], group_size: int | None) -> Groups:
    """Cuts ``ordered_gangs`` into consecutive groups of ``group_size`` (None: one group).

    The last group absorbs the remainder; fewer gangs than ``group_size`` make one group.
    """
    gangs = tuple(ordered_gangs)
    if not gangs:
        raise ScheduleError("live_gangs is empty; a schedule needs at least one live gang")
    if group_size is None or group_size >= len(gangs):
        return (gangs,)
    if group_size < 1:
        raise ScheduleError(f"group_size={group_size} must be a positive number of gangs")
    count = len(gangs) // group_size
    groups = [gangs[i * group_size : (i + 1) * group_size] for i in range(count - 1)]
    groups.append(gangs[(count - 1) * group_size :])
    return tuple(groups)


def gang_locality(topology: Topology) -> dict[int, LocalityKey]:
    """Gang -> the hosts its ranks run on, the locality key for :func:`plan_sync`.

    With ``replicas_across_hosts`` a gang sits on one host (or a run of whole
    hosts), so gangs sharing a host get equal keys and land in the same
    lowest-level groups.
    """
    return {g: topology.gang_hosts(g) for g in range(topology.num_gangs)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncLevel:
    """One level of a schedule, laid over one generation's live gangs."""

    index: int  # 0 = lowest; the last level is the job-wide one
    period: int  # steps between this level's syncs
    group_size: int | None  # configured gangs per group; None: all live gangs
    groups: Groups  # gang ids of each group, in locality order
    note: str  # how the remainder rule shaped the groups ("" when it did not apply)

    def describe(self) -> str:
        size = "all live gangs" if self.group_size is None else f"groups of {self.group_size}"
        text = f"level {self.index} (every {self.period} steps, {size})"
        return f"{text}; {self.note}" if self.note else text


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncDecision:
    """What the replicas do after one step: a value the rank carries out."""

    step: int
    level: int | None  # None: no sync after this step
    period: int  # the due level's period; 1 during warmup; 0 when nothing is due
    groups: Groups  # the gang groups that average, each independently; () when nothing is due
    optimizer_state: bool  # whether optimizer state (fused; dense with dense sync) goes too
    reason: str

    @property
    def due(self) -> bool:
        return self.level is not None

    @property
    def job_wide(self) -> bool:
        """Whether every live gang averages in one group: the top level, warmup, or a lower
        level capped at one group of all (fewer live gangs than its group size, or fewer
        than twice). Every replica is then identical, as after the top level's sync."""
        return len(self.groups) == 1

    def group_of(self, gang: int) -> tuple[int, ...]:
        """The group ``gang`` averages with at this step."""
        for group in self.groups:
            if gang in group:
                return group
        raise ScheduleError(f"gang {gang} is in no group of the decision for step {self.step}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncPlan:
    """A schedule laid over the live gangs of one generation; :meth:`decide` is pure."""

    generation: int
    live_gangs: tuple[int, ...]  # in locality order
    levels: tuple[SyncLevel, ...]  # lowest first; the last is job-wide
    warmup_steps: int
    sync_optimizer_state: bool
    optimizer_state_every: int | None

    @property
    def top(self) -> int:
        """Index of the job-wide level."""
        return len(self.levels) - 1

    def decide(self, step: int) -> SyncDecision:
        """The sync after optimizer step ``step`` (1-based: the engine's step count after it)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ScheduleError(f"step must be a positive integer (1-based), got {step!r}")
        top = self.levels[-1]
        if step <= self.warmup_steps:
            return self._decision(
                step,
                top,
                period=1,
                reason=f"warmup: step {step} of {self.warmup_steps} syncs all live gangs",
            )
        for level in reversed(self.levels):
            if step % level.period == 0:
                skipped = [lv.index for lv in self.levels[: level.index] if step % lv.period == 0]
                reason = f"{level.describe()} is the highest level due at step {step}"
                if skipped:
                    reason += f"; it covers levels {skipped}, also due"
                return self._decision(step, level, period=level.period, reason=reason)
        periods = ", ".join(str(lv.period) for lv in self.levels)
        return SyncDecision(
            step=step,
            level=None,
            period=0,
            groups=(),
            optimizer_state=False,
            reason=f"no level due at step {step} (periods {periods})",
        )

    def _decision(self, step: int, level: SyncLevel, *, period: int, reason: str) -> SyncDecision:
        every = self.optimizer_state_every
        state = self.sync_optimizer_state and (every is None or step % every == 0)
        if self.sync_optimizer_state and not state:
            reason += f"; optimizer state waits for a multiple of {every}"
        return SyncDecision(
            step=step,
            level=level.index,
            period=period,
            groups=level.groups,
            optimizer_state=state,
            reason=reason,
        )

    def group_index(self, gang: int, level: int) -> int:
        """Which group of ``level`` holds ``gang``."""
        for j, group in enumerate(self.levels[level].groups):
            if gang in group:
                return j
        raise ScheduleError(
            f"gang {gang} is not live in generation {self.generation}; "
            f"live gangs: {sorted(self.live_gangs)}"
        )


def _ordered(live: tuple[int, ...], locality: Mapping[int, LocalityKey] | None) -> tuple[int, ...]:
    if locality is None:
        return tuple(sorted(live))
    missing = [g for g in live if g not in locality]
    if missing:
        raise ScheduleError(f"locality has no key for live gangs {missing}")
    keys = {g: tuple(locality[g]) for g in live}
    try:
        return tuple(sorted(live, key=lambda g: (keys[g], g)))
    except TypeError:
        raise ScheduleError(
            f"locality keys must be mutually comparable tuples, got e.g. "
            f"{[keys[g] for g in live[:4]]}"
        ) from None


def plan_sync(
    config: SyncConfig,
    *,
    generation: int,
    live_gangs: Iterable[int],
    locality: Mapping[int, LocalityKey] | None = None,
) -> SyncPlan:
    """Lays ``config``'s schedule over ``live_gangs`` for ``generation``.

    Call it again with the survivors after a membership change; the groups are
    recomputed under the remainder rule (see the module docstring) while
    periods, warmup and the optimizer-state schedule stay as configured, so a
    step's level does not depend on the generation.
    """
    live = tuple(live_gangs)
    bad = [g for g in live if isinstance(g, bool) or not isinstance(g, int) or g < 0]
    if bad:
        raise ScheduleError(f"live_gangs must be non-negative gang ids, got {bad[:4]}")
    if len(set(live)) != len(live):
        dupes = sorted({g for g in live if live.count(g) > 1})
        raise ScheduleError(f"live_gangs lists gangs {dupes} more than once")
    if not live:
        raise ScheduleError("live_gangs is empty; a schedule needs at least one live gang")
    ordered = _ordered(live, locality)
    n = len(ordered)
    sizes: list[int | None] = [size for _, size in config.levels]
    sizes.append(None)
    levels = []
    for index, (period, size) in enumerate(zip(config.periods, sizes, strict=True)):
        note = ""
        if size is not None and n < size:
            note = f"capped at {n} live gangs"
        elif size is not None and n % size:
            note = f"{n} live gangs: the last group absorbs {n % size} more"
        levels.append(
            SyncLevel(
                index=index,
                period=period,
                group_size=size,
                groups=form_groups(ordered, size),
                note=note,
            )
        )
    return SyncPlan(
        generation=generation,
        live_gangs=ordered,
        levels=tuple(levels),
        warmup_steps=config.warmup_steps,
        sync_optimizer_state=config.sync_optimizer_state,
        optimizer_state_every=config.optimizer_state_every,
    )
