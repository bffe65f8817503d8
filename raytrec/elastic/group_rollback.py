"""Exactly once under a hierarchical schedule: which survivors of a loss roll back (pure).

Between two job-wide syncs, a lower level of ``sync.levels`` averages each group of gangs: its
members' copies of a row then each hold part of every member's updates. When a gang is lost,
what it trained since the last job-wide sync is replayed by the survivors; but the survivors
that averaged with it at a lower level hold part of that work already, and the lost gang took
part of theirs with it. Replaying on top of such a copy would count the lost gang's rows more
than once, and keeping it would count their own rows less than once.

So those survivors roll back: they do not add their copy to the re-forming's job-wide sync but
take the mean of the other survivors' copies (which never mixed with a lost gang since the last
job-wide sync: each holds its own work, whole), and every batch they trained since the last
job-wide sync is replayed, like the lost gangs' batches. Each row then reaches the model once:
through a clean survivor's copy at the re-forming's sync, or through a replay after it.
:func:`rolled_back_gangs` names them from the old generation's sync plan. When every survivor
averaged with a lost gang, no live copy is free of the lost gangs' unsynced work:
:func:`no_clean_survivor` describes it for a total loss (a rebuild from the last checkpoint).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # raytrec.sync imports the config, which imports this package
    from raytrec.sync.schedule import SyncPlan

__all__ = ["no_clean_survivor", "rolled_back_gangs"]


def rolled_back_gangs(
    plan: SyncPlan, *, lost: Collection[int], last_sync_step: int, through: int
) -> tuple[int, ...]:
    """The live gangs of ``plan`` (the generation that lost ``lost``) that shared a group with a
    lost gang at a lower-level sync after the job-wide sync of ``last_sync_step`` and up to step
    ``through`` (the furthest step a survivor reached: a sync there may have completed for some
    members), in ``plan``'s order, lost gangs left out.

    A sync whose groups hold every live gang (the top level, warmup, a lower level capped at
    one group) is a job-wide one: it does not roll anyone back (nothing was pending across it
    once it completed, and one that failed at the failed step mixed nothing: a failed
    collective writes nothing back). Counting a sync that failed at ``through`` as done only
    rolls back more gangs than needed, which costs replays, never a row.
    """
    gone = set(lost)
    if not gone:
        return ()
    # Groups nest, so the highest lower level due in the window has the widest groups.
    level = -1
    for step in range(last_sync_step + 1, through + 1):
        decision = plan.decide(step)
        if decision.due and not decision.job_wide and decision.level is not None:
            level = max(level, decision.level)
    if level < 0:
        return ()
    mixed: set[int] = set()
    for group in plan.levels[level].groups:
        if gone.intersection(group):
            mixed.update(group)
    return tuple(g for g in plan.live_gangs if g in mixed and g not in gone)


def no_clean_survivor(
    *, survivors: Sequence[int], rolled_back: Collection[int], last_sync_step: int
) -> str | None:
    """Why re-forming cannot keep every row once, when every one of ``survivors`` rolls back
    (None when some survivor's copy is clean)."""
    back = set(rolled_back)
    if not survivors or any(g not in back for g in survivors):
        return None
    return (
        f"every surviving gang {list(survivors)} averaged with a lost gang at a lower level of "
        f"sync.levels since the job-wide sync of step {last_sync_step}, so no live copy is free "
        "of the lost gangs' unsynced work"
    )
