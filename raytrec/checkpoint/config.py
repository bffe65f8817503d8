"""When to checkpoint and how many checkpoints to keep.

:class:`CheckpointConfig` follows Ray Train's ``CheckpointConfig`` where it
fits (``num_to_keep``, ``checkpoint_score_attribute``, ``checkpoint_score_order``) and adds the
triggers a training loop that raytrec
owns can act on: every N steps, every M minutes (either, both or neither),
and at the end. Checkpoints live under ``<run_dir>/checkpoints/``
(:func:`checkpoint_root`), ``run_dir`` being under ``TrainConfig.storage_path``,
which may be any fsspec URI.

:func:`save_decision` is the policy: a pure function of the config, the step,
the clock and the last save, returning a :class:`SaveDecision` value with a
reason that tests and logs can read. A save is only ever due on a sync
boundary, where every replica of a shard holds the same values, so the one
copy a gang writes is the job's state. :func:`checkpoints_to_remove` is the
retention policy: the newest K, or the best K by a metric plus the newest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal, get_args

from raytrec.config.base import ConfigModel, PositiveFloat, PositiveInt

__all__ = [
    "CHECKPOINTS_DIRNAME",
    "SCORE_ATTRIBUTES",
    "CheckpointConfig",
    "SaveDecision",
    "SavedCheckpoint",
    "better",
    "checkpoint_root",
    "checkpoints_to_remove",
    "ranked",
    "save_decision",
]

CHECKPOINTS_DIRNAME = "checkpoints"

#: The metrics a checkpoint can be ranked by: the interval row's fields
#: (raytrec.observability.metrics.IntervalMetrics) at the step it was saved.
ScoreAttribute = Literal["eval_auc", "eval_ne", "eval_log_loss", "loss", "auc", "ne"]
SCORE_ATTRIBUTES: tuple[str, ...] = get_args(ScoreAttribute)

ScoreOrder = Literal["max", "min"]


class CheckpointConfig(ConfigModel):
    """Checkpoint triggers and retention."""

    num_to_keep: PositiveInt | None = None
    """How many committed checkpoints to keep (null keeps all), as in
    `ray.train.CheckpointConfig`: the newest K, or with `checkpoint_score_attribute` the best K
    by that metric, and the newest one besides (what a rebuild after a total loss or a resume
    starts from)."""
    checkpoint_score_attribute: ScoreAttribute | None = None
    """The metric that ranks checkpoints: `eval_auc`, `eval_ne`, `eval_log_loss` (the held-out
    evaluation at the checkpoint's step) or `loss`, `auc`, `ne` (the training interval's).
    Ranked by an evaluation metric, a checkpoint is also saved at every evaluation, and one
    saved where none ran ranks last. `Result.best_checkpoints` lists them, best first."""
    checkpoint_score_order: ScoreOrder = "max"
    """Whether a higher (`max`, as in Ray Train) or lower (`min`) score is better."""
    every_n_steps: PositiveInt | None = None
    """Save once this many steps have passed since the last save (or the start), at the next
    sync boundary; null: no step trigger."""
    every_minutes: PositiveFloat | None = None
    """Save once this many minutes have passed since the last save (or the start), at the next
    sync boundary; null: no time trigger."""
    checkpoint_at_end: bool = False
    """Also save after the last step."""

    @property
    def periodic(self) -> bool:
        return self.every_n_steps is not None or self.every_minutes is not None

    @property
    def scored_by_eval(self) -> bool:
        """Checkpoints are ranked by a held-out evaluation metric (one is saved at each)."""
        return (self.checkpoint_score_attribute or "").startswith("eval_")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveDecision:
    """Whether to save now, and why (or why not)."""

    save: bool
    reason: str


def save_decision(
    config: CheckpointConfig,
    *,
    step: int,
    now_s: float,
    last_save_step: int,
    last_save_s: float,
    sync_every: int,
    final_step: int | None = None,
    stopping: bool = False,
    evaluated: bool = False,
) -> SaveDecision:
    """The checkpoint policy after optimizer step ``step``, at clock time ``now_s`` (seconds).

    ``last_save_step`` / ``last_save_s`` are the step and time of the last
    save, or of the start (or resume) when there was none. ``final_step`` is
    the job's last step, for ``checkpoint_at_end``. ``stopping``: the job stops on request
    here; it saves when any checkpoint trigger is configured, so it can be resumed.
    ``evaluated``: a held-out evaluation just scored the model at ``step``; it saves when
    checkpoints are ranked by an evaluation metric.
    """
    if step <= last_save_step:
        return SaveDecision(save=False, reason=f"step {step} is already saved")
    if step % sync_every:
        return SaveDecision(
            save=False, reason=f"step {step} is not a sync boundary (sync_every={sync_every})"
        )
    if stopping and (config.periodic or config.checkpoint_at_end or config.scored_by_eval):
        return SaveDecision(save=True, reason=f"stopped on request at step {step}")
    if config.checkpoint_at_end and final_step is not None and step >= final_step:
        return SaveDecision(save=True, reason=f"checkpoint_at_end: step {step} is the last")
    if evaluated and config.scored_by_eval:
        return SaveDecision(
            save=True,
            reason=f"checkpoints are ranked by {config.checkpoint_score_attribute}: an "
            f"evaluation scored step {step}",
        )
    steps = step - last_save_step
    if config.every_n_steps is not None and steps >= config.every_n_steps:
        return SaveDecision(
            save=True,
            reason=f"every_n_steps={config.every_n_steps}: {steps} steps since step "
            f"{last_save_step}",
        )
    minutes = (now_s - last_save_s) / 60.0
    if config.every_minutes is not None and minutes >= config.every_minutes:
        return SaveDecision(
            save=True,
            reason=f"every_minutes={config.every_minutes:g}: {minutes:.2f} minutes since step "
            f"{last_save_step}",
        )
    return SaveDecision(save=False, reason="not due")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SavedCheckpoint:
    """A committed checkpoint as retention sees it: its name, step and score (None: the
    metric was not measured at its step)."""

    name: str
    step: int
    score: float | None = None


def better(a: float | None, b: float | None, order: ScoreOrder) -> bool:
    """Whether score ``a`` ranks above ``b`` (a missing or NaN score ranks below any other)."""
    if b is None or math.isnan(b):
        return a is not None and not math.isnan(a)
    if a is None or math.isnan(a):
        return False
    return a > b if order == "max" else a < b


def ranked(saved: Sequence[SavedCheckpoint], order: ScoreOrder) -> list[SavedCheckpoint]:
    """``saved`` best first by score; a missing score last; among equal scores the newer first."""

    def key(c: SavedCheckpoint) -> tuple[int, float, int]:
        missing = c.score is None or math.isnan(c.score)
        value = 0.0 if missing else float(c.score)  # type: ignore[arg-type]
        return (1 if missing else 0, -value if order == "max" else value, -c.step)

    return sorted(saved, key=key)


def checkpoints_to_remove(saved: Sequence[SavedCheckpoint], config: CheckpointConfig) -> list[str]:
    """The names of the committed checkpoints that retention removes after a commit.

    Without a score attribute, all but the newest ``num_to_keep``; with one, all but the best
    ``num_to_keep`` by score (:func:`ranked`) and the newest, which is kept whatever its score:
    it is what a rebuild after a total loss or a resume starts from (as Ray Train keeps its
    latest checkpoint)."""
    if config.num_to_keep is None or not saved:
        return []
    by_step = sorted(saved, key=lambda c: c.step)
    if config.checkpoint_score_attribute is None:
        return [c.name for c in by_step[: max(0, len(by_step) - config.num_to_keep)]]
    keep = {c.name for c in ranked(saved, config.checkpoint_score_order)[: config.num_to_keep]}
    keep.add(by_step[-1].name)
    return [c.name for c in by_step if c.name not in keep]


def checkpoint_root(run_dir: str) -> str:
    """``<run_dir>/checkpoints`` for a local path or any fsspec URI (``s3://b/run``)."""
    return run_dir.rstrip("/") + "/" + CHECKPOINTS_DIRNAME
