"""Errors shared by every layer (kept free of imports so any module can raise them)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""
