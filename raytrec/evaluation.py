"""Evaluation on held-out rows while the job trains (``TrainConfig.eval``).

The held-out Parquet is read by index as one stream of batches (one epoch, file order, no
shuffle): batch ``k`` holds rows ``k * batch_size`` on. At an evaluation, after a job-wide sync
(so every gang holds the job's model), the live ranks share those batches: in each round every
rank scores one batch, rank ``i`` of the ``R`` live ranks taking batch ``round * R + i``. Every
rank of a gang takes part in each of its gang's sharded forward passes, so every rank runs the
same number of rounds; in the last round a rank with no batch left scores batch 0 again and
leaves it out of its metrics. The model scores in eval mode under ``torch.no_grad()``: no
backward runs, so FBGEMM's fused optimizer (which updates inside backward) changes nothing.

The ranks' metric states (TorchRec's NE sums, and every prediction and label for AUC) are
merged on the coordinator exactly as the training metrics are, so AUC, NE and log loss are
those of the union of the held-out rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["EvalPlan", "assign_eval_batches", "eval_due", "eval_plan"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalPlan:
    """What one evaluation reads: ``num_batches`` batches of at most ``batch_size`` rows."""

    num_batches: int
    batch_size: int
    rows: int


def eval_plan(*, total_rows: int, batch_size: int, max_rows: int | None) -> EvalPlan:
    """The batches of the held-out stream that an evaluation scores (``max_rows``: the first
    rows only, rounded up to whole batches)."""
    rows = total_rows if max_rows is None else min(total_rows, max_rows)
    return EvalPlan(num_batches=-(-rows // batch_size), batch_size=batch_size, rows=rows)


def assign_eval_batches(num_batches: int, ranks: Sequence[int]) -> dict[int, list[int | None]]:
    """Rank -> the batch it scores in each round (None: a padding round, scored but not
    counted). Every rank gets the same number of rounds."""
    if not ranks:
        raise ValueError("an evaluation needs at least one live rank")
    width = len(ranks)
    rounds = -(-num_batches // width)
    return {
        r: [k if (k := t * width + i) < num_batches else None for t in range(rounds)]
        for i, r in enumerate(ranks)
    }


def eval_due(step: int, *, every: int | None, last_eval_step: int, end_step: int) -> bool:
    """Whether an evaluation runs at the boundary at ``step``: at the end, and at the first
    boundary at or after each multiple of ``every`` steps; never twice at one step."""
    if step == last_eval_step:
        return False
    if step >= end_step:
        return True
    return every is not None and step // every > last_eval_step // every
