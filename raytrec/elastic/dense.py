"""Where a failure leaves the dense parameters, so each row's dense gradient counts once (pure).

With ``sync.dense="every_step"`` every step's dense gradients are averaged over all live gangs
and applied on every rank. When a gang is lost, its batches since the last job-wide sync are
replayed by the survivors for their embedding rows (those died with the gang's shards), but
the dense gradients of the steps whose all-reduce completed are already in every survivor's
dense parameters: replaying those batches must not apply them again. The step whose all-reduce
failed is the opposite case: its embedding updates happened (fused into backward) and its
dense update did not, on any survivor that saw the failure.

:func:`settle_failed_step` decides, from the survivors' ``recover`` reports, whose dense state
the re-formed job goes on from, the last step whose dense update that state holds
(``dense_through``), and whether the survivors finish the failed step's dense update among
themselves. The accounting (:meth:`~.accounting.BatchAccounting.plan_drop`) then marks the lost
gangs' batches trained at or before ``dense_through`` as *embedding-only* replays, which the
ranks train with a zero dense gradient. With ``sync.dense="with_schedule"`` a lost gang's dense
changes since the last job-wide sync die with it like its embedding updates, so every replay
updates both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from raytrec.elastic.report import RankReport

__all__ = ["FailedStepSettlement", "settle_failed_step"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FailedStepSettlement:
    """What re-forming does with the dense update of the step that failed."""

    step: int  # the step the job goes on from (the furthest any survivor reached)
    #: The last step whose dense update is in the dense state the survivors go on from: every
    #: batch trained at or before it, by any gang of the old generation, is in it.
    dense_through: int
    source: int  # the job rank whose dense state (parameters, optimizer state) all take
    #: The survivors average the dense gradients they kept for ``step`` over the new
    #: generation and apply them, so their own batches of that step reach the dense parameters.
    finish: bool

    @property
    def survivors_through(self) -> int:
        """The last step whose dense update of the survivors' own batches the dense state holds
        once the failed step is settled: a survivor's batch of the failed step reaches it when
        the survivors finish that step. A survivor that rolls back under a hierarchical schedule
        (:mod:`~.group_rollback`) replays its batches trained at or before it embedding-only."""
        return self.step if self.finish else self.dense_through


def settle_failed_step(
    recovered: Sequence[RankReport],
    *,
    every_step: bool,
    committed_through: int,
) -> FailedStepSettlement:
    """The settlement for survivors that reported ``recovered`` (in gang order).

    ``every_step``: ``sync.dense == "every_step"``; ``committed_through``: the last job-wide
    sync every gang completed. Averaging dense gradients every step, a survivor that finished
    the furthest step's dense update (its report shows that step and no abandoned update)
    holds the job's average of it, lost gangs' gradients included: its state is taken and
    nothing is finished. Otherwise no survivor applied that step's dense update: the first
    survivor's state is taken (all agree on the steps before), and the survivors that were in
    that step finish it among themselves. Averaging dense parameters with the schedule
    (``"with_schedule"``), the dense state the survivors share holds the lost gangs' batches
    up to the last job-wide sync only.
    """
    if not recovered:
        raise ValueError("settle_failed_step needs at least one survivor's report")
    step = max(r.step for r in recovered)
    first = recovered[0].rank
    if not every_step:
        return FailedStepSettlement(
            step=step, dense_through=committed_through, source=first, finish=False
        )
    done = [r.rank for r in recovered if r.step == step and not r.abandoned_dense_update]
    if done:
        return FailedStepSettlement(step=step, dense_through=step, source=done[0], finish=False)
    return FailedStepSettlement(
        step=step,
        dense_through=step - 1,
        source=first,
        finish=any(r.abandoned_dense_update for r in recovered),
    )
