"""Straggler injection: which rank stalls at which step, and for how long.

The decision for ``(step, rank)`` is a pure function of the spec's seed: a
counter-based hash (SplitMix64 over seed, step and rank) gives a uniform
draw in [0, 1), and the rank stalls when the draw is below ``rate``. Every
process computes the same answer with no shared RNG state, a rank can ask
about its own step alone, and the simulator draws whole steps of thousands
of ranks at once with the same function.

Modes:

- ``transient``: every rank stalls independently with probability ``rate`` at
  every step, so stragglers land on different ranks each time (seed 002's
  experiment: 1 s stalls at 1% or 2%).
- ``persistent``: only ``rank`` ever stalls, with probability ``rate`` per step
  (1.0: every step), as a degraded host would.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

import numpy as np
import numpy.typing as npt

from raytrec.errors import ConfigError

__all__ = ["StragglerMode", "StragglerSpec", "uniform_draws"]

StragglerMode = Literal["transient", "persistent"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finaliser: a bijection of 64-bit words that spreads every input bit."""
    x = x + _GOLDEN  # wraps modulo 2**64
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def uniform_draws(seed: int, step: int, ranks: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """One uniform draw in [0, 1) per rank for ``(seed, step, rank)``; deterministic."""
    r = np.atleast_1d(np.asarray(ranks, dtype=np.uint64))
    with np.errstate(over="ignore"):
        h = _mix(np.full_like(r, np.uint64(seed)))
        h = _mix(h ^ np.uint64(step))
        h = _mix(h ^ r)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StragglerSpec:
    """Injected stalls: ``rate`` per (step, rank), ``stall_s`` seconds each."""

    rate: float
    stall_s: float
    mode: StragglerMode = "transient"
    rank: int = 0  # the one rank that stalls in persistent mode
    seed: int = 0

    def __post_init__(self) -> None:
        for field in ("rate", "stall_s"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"stragglers.{field} must be a number, got {value!r}")
        if not 0.0 <= self.rate <= 1.0:
            raise ConfigError(f"stragglers.rate={self.rate!r} must be in [0, 1]")
        if self.stall_s < 0:
            raise ConfigError(f"stragglers.stall_s={self.stall_s!r} must be >= 0 seconds")
        if self.mode not in get_args(StragglerMode):
            allowed = ", ".join(map(repr, get_args(StragglerMode)))
            raise ConfigError(f"stragglers.mode={self.mode!r} is not one of {allowed}")
        for field in ("rank", "seed"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(
                    f"stragglers.{field} must be a non-negative integer, got {value!r}"
                )

    def stalls(self, step: int, ranks: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """Seconds each of ``ranks`` stalls at ``step`` (vectorised :meth:`stall_seconds`)."""
        r = np.atleast_1d(np.asarray(ranks, dtype=np.int64))
        hit = uniform_draws(self.seed, step, r) < self.rate
        if self.mode == "persistent":
            hit &= r == self.rank
        return np.where(hit, float(self.stall_s), 0.0)

    def stall_seconds(self, step: int, rank: int) -> float:
        """How long ``rank`` sleeps at ``step`` (0.0 for no stall); the same in every process."""
        return float(self.stalls(step, [rank])[0])
