"""When to checkpoint and how many checkpoints to keep.

:class:`CheckpointConfig` follows Ray Train's ``CheckpointConfig`` where it
fits (``num_to_keep``) and adds the triggers a training loop that raytrec
owns can act on: every N steps, every M minutes (either, both or neither),
and at the end. Checkpoints live under ``<run_dir>/checkpoints/``
(:func:`checkpoint_root`), ``run_dir`` being under ``TrainConfig.storage_path``,
which may be any fsspec URI.

:func:`save_decision` is the policy: a pure function of the config, the step,
the clock and the last save, returning a :class:`SaveDecision` value with a
reason that tests and logs can read. A save is only ever due on a sync
boundary, where every replica of a shard holds the same values, so the one
copy a gang writes is the job's state.
"""

from __future__ import annotations

import dataclasses
import math

from raytrec.errors import ConfigError

__all__ = [
    "CHECKPOINTS_DIRNAME",
    "CheckpointConfig",
    "SaveDecision",
    "checkpoint_root",
    "save_decision",
]

CHECKPOINTS_DIRNAME = "checkpoints"


def _optional_positive_int(field: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"checkpoint.{field} must be None or a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoint triggers and retention.

    ``num_to_keep``: keep the newest K committed checkpoints (None keeps all),
    as in ``ray.train.CheckpointConfig``. ``every_n_steps`` / ``every_minutes``:
    save once that many steps / minutes have passed since the last save (or
    the start), at the next sync boundary; None disables a trigger.
    ``checkpoint_at_end``: also save after the last step.
    """

    num_to_keep: int | None = None
    every_n_steps: int | None = None
    every_minutes: float | None = None
    checkpoint_at_end: bool = False

    def __post_init__(self) -> None:
        _optional_positive_int("num_to_keep", self.num_to_keep)
        _optional_positive_int("every_n_steps", self.every_n_steps)
        m = self.every_minutes
        if m is not None and (
            isinstance(m, bool) or not isinstance(m, int | float) or not math.isfinite(m) or m <= 0
        ):
            raise ConfigError(
                f"checkpoint.every_minutes must be None or a positive finite number, got {m!r}"
            )
        if not isinstance(self.checkpoint_at_end, bool):
            raise ConfigError(
                "checkpoint.checkpoint_at_end must be True or False, "
                f"got {self.checkpoint_at_end!r}"
            )

    @property
    def periodic(self) -> bool:
        return self.every_n_steps is not None or self.every_minutes is not None


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
) -> SaveDecision:
    """The checkpoint policy after optimizer step ``step``, at clock time ``now_s`` (seconds).

    ``last_save_step`` / ``last_save_s`` are the step and time of the last
    save, or of the start (or resume) when there was none. ``final_step`` is
    the job's last step, for ``checkpoint_at_end``. ``stopping``: the job stops on request
    here; it saves when any checkpoint trigger is configured, so it can be resumed.
    """
    if step <= last_save_step:
        return SaveDecision(save=False, reason=f"step {step} is already saved")
    if step % sync_every:
        return SaveDecision(
            save=False, reason=f"step {step} is not a sync boundary (sync_every={sync_every})"
        )
    if stopping and (config.periodic or config.checkpoint_at_end):
        return SaveDecision(save=True, reason=f"stopped on request at step {step}")
    if config.checkpoint_at_end and final_step is not None and step >= final_step:
        return SaveDecision(save=True, reason=f"checkpoint_at_end: step {step} is the last")
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


def checkpoint_root(run_dir: str) -> str:
    """``<run_dir>/checkpoints`` for a local path or any fsspec URI (``s3://b/run``)."""
    return run_dir.rstrip("/") + "/" + CHECKPOINTS_DIRNAME
