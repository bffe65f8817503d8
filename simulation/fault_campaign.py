"""Campaigns over the fault space: many seeded schedules, a summary, shrunk reproducers.

:func:`campaign` runs the schedules of seeds ``seed .. seed + n - 1``
(:func:`~simulation.fault_schedule.generate`) on ``workers`` processes and sums up their
outcomes by class and the phases their faults landed in. Each distinct defect (its kind and
message) is :func:`shrink`-ed: faults are removed and settings simplified for as long as the
schedule still fails the same way, and the result is printed as one line that replays it
(:func:`~simulation.fault_schedule.reproducer`). ``python -m simulation`` is the
command; it starts at a :func:`fresh_seed` unless given one, so each campaign explores
schedules no earlier one ran, and prints its seeds so that it can be run again.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import re
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

from simulation import fault_space
from simulation.fault_schedule import Schedule, generate
from simulation.fault_space import Outcome, run_schedule

__all__ = ["CampaignResult", "campaign", "defect_signature", "fresh_seed", "seed_range", "shrink"]


@dataclasses.dataclass
class CampaignResult:
    """What a campaign found: outcome counts by class, fault phases covered (a fault's kind @
    the coordinator's phase / the call), and for each distinct defect its first seed, its
    shrunk schedule and that schedule's outcome."""

    schedules: int = 0
    seed: int = 0  # the first schedule's seed: the campaign ran seeds seed .. seed + schedules - 1
    wall_s: float = 0.0
    outcomes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    phases: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # Settings drawn: "data=<source>", "layout=<layout>", "grow", "checkpoints", "sync.levels",
    # by count.
    settings: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    defects: dict[str, tuple[int, Outcome]] = dataclasses.field(default_factory=dict)
    shrunk: dict[str, tuple[Schedule, Outcome]] = dataclasses.field(default_factory=dict)

    def lines(self) -> list[str]:
        seeds = seed_range(self.seed, self.schedules)
        out = [f"{self.schedules} schedules in {self.wall_s:.1f}s ({seeds})"]
        out += [f"  {n:7d}  {key}" for key, n in self.outcomes.most_common()]
        out.append("settings: " + ", ".join(f"{k} {n}" for k, n in sorted(self.settings.items())))
        out.append(f"phases covered: {len(self.phases)}")
        out += [f"  {n:7d}  {p}" for p, n in sorted(self.phases.items())]
        for signature, (seed, _) in sorted(self.defects.items()):
            out.append(f"DEFECT (seed {seed}): {signature}")
            if signature in self.shrunk:
                schedule, shrunk = self.shrunk[signature]
                out.append(f"  shrunk to {len(schedule.faults)} fault(s): {shrunk.detail}")
                out.append(f"  {reproducer_line(schedule)}")
        return out


def fresh_seed() -> int:
    """A first seed no campaign is likely to have run (32 random bits from the OS): a campaign
    that always started at the same seed would test the same schedules every time."""
    return secrets.randbits(32)


def seed_range(seed: int, n: int) -> str:
    """The seeds of a campaign of ``n`` schedules from ``seed``, and how to run them again."""
    return f"seeds {seed} to {seed + n - 1}; again: --seed {seed} --schedules {n}"


def reproducer_line(schedule: Schedule) -> str:
    from simulation.fault_schedule import reproducer

    return reproducer(schedule)


def defect_signature(outcome: Outcome) -> str:
    """A defect's kind and message without the numbers that differ between schedules (ranks,
    steps, times), so one defect met by many schedules is shrunk once."""
    detail = re.sub(r"\[[0-9, ]*\]", "[..]", outcome.detail)
    return f"{outcome.name}: {re.sub(r'[0-9]+', 'N', detail)[:160]}"


def _one(seed: int) -> tuple[int, Outcome]:
    return seed, run_schedule(generate(seed))


def _results(seeds: range, workers: int) -> Iterator[tuple[int, Outcome]]:
    if workers <= 1:
        yield from map(_one, seeds)
        return
    # Forked workers share the modules the parent imported (seconds of torch imports each),
    # and write their data in the parent's folder, which the parent removes when it exits.
    fault_space.data_root()
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        yield from pool.imap_unordered(_one, seeds, chunksize=16)


def campaign(
    n: int,
    *,
    seed: int = 0,
    workers: int = 1,
    shrink_defects: bool = True,
    progress: Callable[[int, CampaignResult], None] | None = None,
) -> CampaignResult:
    """Runs the schedules of seeds ``seed .. seed + n - 1`` (module doc)."""
    from simulation.fault_space import parquet_shards

    for world in (2, 3, 4, 6, 8):  # the tiny Parquet files, made once before forking
        for epochs in (1, 2, 3):
            parquet_shards(world, 1, epochs)
    result = CampaignResult()
    t0 = time.monotonic()
    for done, (s, outcome) in enumerate(_results(range(seed, seed + n), workers), 1):
        result.outcomes[outcome.key] += 1
        drawn = generate(s).settings
        result.settings.update(
            [f"data={drawn.data}", f"layout={drawn.layout}"]
            + [f"epochs={drawn.epochs}"] * (drawn.epochs > 1)
            + ["grow"] * drawn.grow
            + ["checkpoints"] * (drawn.checkpoint_every is not None)
            + ["sync.levels"] * bool(drawn.levels)
        )
        result.phases.update(outcome.phases)
        if outcome.verdict == "defect":
            signature = defect_signature(outcome)
            if signature not in result.defects or s < result.defects[signature][0]:
                result.defects[signature] = (s, outcome)
        if progress is not None and done % 1000 == 0:
            progress(done, result)
    result.schedules, result.seed = n, seed
    result.wall_s = time.monotonic() - t0
    if shrink_defects:
        for signature, (s, outcome) in result.defects.items():
            result.shrunk[signature] = shrink(generate(s), outcome)
    return result


def shrink(
    schedule: Schedule, outcome: Outcome, *, run: Callable[[Schedule], Outcome] = run_schedule
) -> tuple[Schedule, Outcome]:
    """The smallest schedule found that still ends as ``outcome`` did (same verdict and name):
    faults removed one at a time while it still fails, then settings simplified one at a time.
    Returns it with its outcome."""

    def fails(candidate: Schedule) -> Outcome | None:
        got = run(candidate)
        return got if got.key == outcome.key else None

    best, best_outcome = schedule, outcome
    changed = True
    while changed:
        changed = False
        for i in range(len(best.faults)):
            candidate = dataclasses.replace(best, faults=best.faults[:i] + best.faults[i + 1 :])
            got = fails(candidate)
            if got is not None:
                best, best_outcome, changed = candidate, got, True
                break
    for change in _SIMPLER:
        if all(getattr(best.settings, k) == v for k, v in change.items()):
            continue
        try:
            simpler = dataclasses.replace(best.settings, **change)
        except ValueError:
            continue
        candidate = dataclasses.replace(best, settings=simpler)
        got = fails(candidate)
        if got is not None:
            best, best_outcome = candidate, got
    return dataclasses.replace(best, seed=schedule.seed), best_outcome


#: Simpler settings, one change at a time (kept while the schedule still fails the same way).
_SIMPLER: tuple[dict[str, Any], ...] = (
    {"data": "synthetic"},
    {"grow": False, "max_gangs": None},
    {"spare_nodes": 0},
    {"checkpoint_every": None},
    {"min_gangs": 1},
    {"layout": "replicas_across_hosts"},
    {"levels": ()},
    {"sync_every": 4},
    {"log_every": 2},
    {"num_steps": 8},
    {"gang_size": 1},
)
