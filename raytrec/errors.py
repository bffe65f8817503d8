"""Errors shared by every layer (kept free of imports so any module can raise them)."""

from __future__ import annotations

__all__ = ["ConfigError", "JobFailedError"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


class JobFailedError(RuntimeError):
    """An elastic job cannot go on: too few gangs for too long, or a shard lost every copy."""
