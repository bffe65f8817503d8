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

:func:`early_stop_decision` is the early-stopping policy: from the metric at each evaluation so
far, whether the job stops now.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "EarlyStop",
    "EvalPlan",
    "assign_eval_batches",
    "early_stop_decision",
    "eval_due",
    "eval_plan",
    "higher_is_better",
    "keep_eval_batches",
]


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


def keep_eval_batches(
    num_batches: int,
    ranks: Sequence[int],
    *,
    before: Mapping[int, Sequence[int]],
    gang_of: Callable[[int], int],
) -> dict[int, list[int | None]]:
    """As :func:`assign_eval_batches`, but each live rank keeps the batches it scored at the
    evaluation ``before`` (rank -> batch ids): a rank reads a held-out batch once in its life
    and keeps it, so a new split after a gang was lost or joined would make most ranks read
    batches again (seconds each, which every gang waits for at the boundary). The batches of
    ranks no longer live go one by one to the rank holding the fewest (the first in ``ranks``
    on a tie), so a joined gang takes them before the survivors do; a joined gang with none
    to take scores nothing. Each gang's ranks are then padded with None to its most rounds
    (its sharded forward is a collective). With no live rank in ``before``:
    :func:`assign_eval_batches`."""
    if not any(r in before for r in ranks):
        return assign_eval_batches(num_batches, ranks)
    kept = {r: [b for b in before.get(r, ()) if b < num_batches] for r in ranks}
    taken = {b for held in kept.values() for b in held}
    order = {r: i for i, r in enumerate(ranks)}
    for b in range(num_batches):
        if b not in taken:
            fewest = min(ranks, key=lambda r: (len(kept[r]), order[r]))
            kept[fewest].append(b)
    rounds: dict[int, int] = {}
    for r in ranks:
        rounds[gang_of(r)] = max(rounds.get(gang_of(r), 0), len(kept[r]))
    return {r: [*held, *([None] * (rounds[gang_of(r)] - len(held)))] for r, held in kept.items()}


def eval_due(step: int, *, every: int | None, last_eval_step: int, end_step: int) -> bool:
    """Whether an evaluation runs at the boundary at ``step``: at the end, and at the first
    boundary at or after each multiple of ``every`` steps; never twice at one step."""
    if step == last_eval_step:
        return False
    if step >= end_step:
        return True
    return every is not None and step // every > last_eval_step // every


@dataclasses.dataclass(frozen=True, kw_only=True)
class EarlyStop:
    """Stop the job here: the metric stopped improving. ``best_step``: where it was best."""

    reason: str
    best_step: int
    best: float


def higher_is_better(metric: str) -> bool:
    """AUC grows as a model improves; NE and log loss fall."""
    return metric.endswith("auc")


def early_stop_decision(
    scores: Sequence[tuple[int, float | None]], *, metric: str, patience: int, min_delta: float
) -> EarlyStop | None:
    """Whether to stop after the evaluations ``scores`` (their step and ``metric``, in order):
    when the last ``patience`` of them did not improve on the best before them by more than
    ``min_delta``. A missing or NaN score counts as no improvement."""
    sign = 1.0 if higher_is_better(metric) else -1.0
    best: tuple[int, float] | None = None  # index and value of the best score so far
    for i, (_, score) in enumerate(scores):
        if score is None or math.isnan(score):
            continue
        if best is None or sign * (score - best[1]) > min_delta:
            best = (i, score)
    if best is None:
        since = len(scores)
        if since < patience:
            return None
        return EarlyStop(
            reason=f"{metric} was not measured in {since} evaluations", best_step=0, best=math.nan
        )
    since = len(scores) - 1 - best[0]
    if since < patience:
        return None
    step = scores[best[0]][0]
    return EarlyStop(
        reason=f"early stopping: {metric} did not improve on its best ({best[1]:.4f}, at step "
        f"{step}) by more than {min_delta:g} in {since} evaluations",
        best_step=step,
        best=best[1],
    )
