"""Errors shared by every layer (kept free of imports so any module can raise them)."""

from __future__ import annotations

__all__ = ["ConfigError", "JobFailedError"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


class StopRequested(Exception):
    """The job was asked to stop (SIGTERM, SIGINT, ``ray job stop``): it stopped at an interval
    boundary, with its work synced, checkpointed (when checkpoints are configured) and saved."""


class EarlyStopped(Exception):
    """Held-out evaluation stopped improving (``eval.early_stopping_patience``): the job ended at
    an interval boundary like a finished one. Not an error: ``fit`` returns its result."""


class JobFailedError(RuntimeError):
    """An elastic job cannot go on: too few gangs for too long, or a shard lost every copy."""
