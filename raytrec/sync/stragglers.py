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

from typing import Literal

import numpy as np
import numpy.typing as npt

from raytrec.config.base import ConfigModel, NonNegativeFloat, NonNegativeInt, Probability

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


class StragglerSpec(ConfigModel):
    """Injected stalls: ``rate`` per (step, rank), ``stall_s`` seconds each."""

    rate: Probability
    """The probability that a rank stalls at a step."""
    stall_s: NonNegativeFloat
    """Seconds of each stall."""
    mode: StragglerMode = "transient"
    """`transient`: every rank stalls independently at every step; `persistent`: only `rank`
    ever stalls, as a degraded host would."""
    rank: NonNegativeInt = 0
    """The one rank that stalls in `persistent` mode."""
    seed: NonNegativeInt = 0
    """Seeds the draws: the same seed stalls the same ranks at the same steps."""

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
