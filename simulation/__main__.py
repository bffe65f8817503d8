"""Runs seeded random fault schedules through the real control plane, or replays one.

    python -m simulation --schedules 100000 --workers 2
    python -m simulation --schedules 100000 --seed 0 --workers 2
    python -m simulation --replay '<schedule json>'

A campaign runs the schedules of ``--schedules`` consecutive seeds from ``--seed``, by default
from a fresh random seed (so that each campaign tries schedules no earlier one tried); it
prints its seed range as it starts and in its summary. It prints the outcomes by class, the
phases its faults landed in, and for each distinct defect a shrunk schedule as a one-line
reproducer; it exits 1 when it found a defect. A replay prints the schedule's outcome and
exits 1 when it is a defect. (simulation.fault_space)

Run from a checkout: the simulation and its doubles are not part of the installed package.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from simulation.fault_campaign import CampaignResult


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulation", description=__doc__)
    parser.add_argument("--schedules", type=int, default=2000, help="how many schedules")
    parser.add_argument(
        "--seed", type=int, default=None, help="the first schedule's seed (default: a fresh one)"
    )
    parser.add_argument("--workers", type=int, default=1, help="processes running schedules")
    parser.add_argument("--no-shrink", action="store_true", help="do not shrink the defects")
    parser.add_argument("--replay", metavar="JSON", help="run this one schedule and say how")
    args = parser.parse_args(argv)

    from raytrec._quiet import quiet_known_warnings

    quiet_known_warnings()  # before torch.fx's notice, which TorchRec's imports trigger
    from simulation.fault_campaign import campaign, fresh_seed, seed_range
    from simulation.fault_schedule import Schedule
    from simulation.fault_space import run_schedule

    if args.replay is not None:
        try:
            schedule = Schedule.from_json(args.replay)
        except (ValueError, KeyError, TypeError) as e:
            print(f"fault_space: --replay is not a schedule: {e}", file=sys.stderr)
            return 2
        outcome = run_schedule(schedule)
        print(f"{outcome.verdict} {outcome.name} {outcome.detail}".rstrip())
        print(f"phases: {list(outcome.phases)}; steps: {outcome.steps}")
        return 1 if outcome.verdict == "defect" else 0
    if args.schedules < 1 or args.workers < 1:
        print("fault_space: --schedules and --workers must be at least 1", file=sys.stderr)
        return 2

    seed = fresh_seed() if args.seed is None else args.seed
    print(f"fault_space: {seed_range(seed, args.schedules)}", flush=True)

    def progress(done: int, result: CampaignResult) -> None:
        found = f", {len(result.defects)} defect(s)" if result.defects else ""
        print(f"... {done} schedules{found}", file=sys.stderr, flush=True)

    result = campaign(
        args.schedules,
        seed=seed,
        workers=args.workers,
        shrink_defects=not args.no_shrink,
        progress=progress,
    )
    for line in result.lines():
        print(line)
    return 1 if result.defects else 0


if __name__ == "__main__":
    sys.exit(main())
