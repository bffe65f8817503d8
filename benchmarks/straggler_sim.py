"""Seed 002's straggler experiment, replayed on the clock model of :mod:`raytrec.sync.simulate`.

64, 128 and 256 workers at about 55 ms per step, 1 s stalls at 2% (64) and 1%
(128, 256) per worker and step; synchronous SGD against local SGD every 2,
4 and 8 steps and the seed's hierarchical configurations; then the same at
1024 and 4096 workers. Speedup = simulated time of synchronous SGD / time of
the schedule, for the same number of steps, averaged over ``--seeds`` straggler
draws. Two readings of the seed's setup:

- hosts of 4: the seed's machines hold 4 GPUs that average gradients every
  step (PyTorch's post-local-SGD default), so a stall holds back its host;
  a host is one raytrec gang (``sync.dense="with_schedule"``);
- per worker: no per-step averaging inside a host; every worker is its own gang.

Schedules use the seed's notation in workers: ``2-8,4-32,8-64`` = groups of 8
every 2 steps, 32 every 4, all 64 every 8. Run::

    .venv/bin/python benchmarks/straggler_sim.py --write docs/stragglers.md
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import numpy as np
from _docs import replace_block  # benchmarks/, the script's own folder

from raytrec.config import SyncConfig
from raytrec.sync.schedule import plan_sync
from raytrec.sync.simulate import CostModel, gang_stalls, simulate
from raytrec.sync.stragglers import StragglerSpec

BEGIN = "<!-- straggler_sim:begin -->"
END = "<!-- straggler_sim:end -->"
COMMAND = ".venv/bin/python benchmarks/straggler_sim.py --write docs/stragglers.md"


@dataclasses.dataclass(frozen=True)
class Scale:
    workers: int
    rate: float
    hsgd: tuple[str, ...]  # hierarchical configurations, seed notation
    seed_range: tuple[float, float] | None  # the seed's HSGD speedups at this scale


SCALES = (
    Scale(64, 0.02, ("2-8,4-32,8-64", "4-32,8-64"), (2.08, 2.45)),
    Scale(128, 0.01, ("2-8,4-32,8-128", "4-32,8-128"), (2.57, 2.68)),
    Scale(256, 0.01, ("1-4,2-16,4-64,8-256", "2-8,4-64,8-256", "4-16,8-256"), (2.63, 3.25)),
    Scale(1024, 0.01, ("2-8,4-32,8-1024", "4-32,8-1024", "2-16,4-256,8-1024"), None),
    Scale(4096, 0.01, ("2-8,4-32,8-4096", "4-32,8-4096", "2-16,4-256,8-4096"), None),
)


def to_sync_config(spec: str, *, workers: int, gang_size: int) -> SyncConfig:
    """Seed notation in workers -> a raytrec schedule in gangs of ``gang_size`` workers.

    Levels whose groups are no larger than a gang are dropped: the gang already
    averages every step. The last level must span all workers: it is ``sync_every``.
    """
    pairs = [tuple(int(x) for x in part.split("-")) for part in spec.split(",")]
    *lower, (top_period, top_size) = pairs
    if top_size != workers:
        raise ValueError(f"{spec}: the last level must hold all {workers} workers")
    for _, s in lower:
        if s % gang_size:
            raise ValueError(f"{spec}: group of {s} workers is not whole gangs of {gang_size}")
    levels = tuple((p, s // gang_size) for p, s in lower if s > gang_size)
    return SyncConfig(sync_every=top_period, levels=levels)


def schedules(scale: Scale) -> list[tuple[str, str | None]]:
    """(label, seed notation or None for synchronous SGD)."""
    w = scale.workers
    rows: list[tuple[str, str | None]] = [("local SGD every 2", f"2-{w}")]
    rows += [("local SGD every 4", f"4-{w}"), ("local SGD every 8", f"8-{w}")]
    rows += [(f"HSGD {h}", h) for h in scale.hsgd]
    return rows


def seed_figure(scale: Scale, label: str) -> str:
    if scale.seed_range is None:
        return "not published"
    lo, hi = scale.seed_range
    if label.startswith("HSGD"):
        return f"{lo:.2f}-{hi:.2f}x (HSGD range)"
    if label == "local SGD every 2":
        return f"lower bound of HSGD (<= {lo:.2f}x)"
    if label == "local SGD every 8":
        return f"upper bound of HSGD (>= {hi:.2f}x)"
    return "-"


def speedups(
    scale: Scale, *, gang_size: int, steps: int, seeds: int, cost: CostModel
) -> tuple[float, dict[str, list[float]]]:
    """Mean synchronous step time, and each schedule's speedup per straggler seed."""
    gangs = scale.workers // gang_size
    out: dict[str, list[float]] = {label: [] for label, _ in schedules(scale)}
    sync_step = []
    for seed in range(seeds):
        spec = StragglerSpec(rate=scale.rate, stall_s=1.0, seed=seed)
        stalls = gang_stalls(spec, steps=steps, num_gangs=gangs, gang_size=gang_size)

        def seconds(cfg: SyncConfig, stalls: np.ndarray = stalls) -> float:
            plan = plan_sync(cfg, generation=0, live_gangs=range(gangs))
            return simulate(plan, stalls, cost, gang_size=gang_size).seconds

        base = seconds(SyncConfig(sync_every=1))
        sync_step.append(base / steps)
        for label, notation in schedules(scale):
            assert notation is not None
            cfg = to_sync_config(notation, workers=scale.workers, gang_size=gang_size)
            out[label].append(base / seconds(cfg))
    return float(np.mean(sync_step)), out


def table(*, steps: int, seeds: int, cost: CostModel) -> str:
    lines = [
        "| workers | stall rate | sync SGD step | schedule | speedup, hosts of 4 "
        "| speedup, per worker | published (Cruise and Meta) |",
        "| ---: | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for scale in SCALES:
        step4, host = speedups(scale, gang_size=4, steps=steps, seeds=seeds, cost=cost)
        _, worker = speedups(scale, gang_size=1, steps=steps, seeds=seeds, cost=cost)
        for i, (label, _) in enumerate(schedules(scale)):
            lead = (
                f"| {scale.workers} | {100 * scale.rate:.0f}% | {1000 * step4:.0f} ms"
                if i == 0
                else "| | | "
            )
            h, w = host[label], worker[label]
            lines.append(
                f"{lead} | {label} | {np.mean(h):.2f}x ({min(h):.2f}-{max(h):.2f}) "
                f"| {np.mean(w):.2f}x | {seed_figure(scale, label)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=1000, help="steps per run (the seed ran 1000)")
    p.add_argument("--seeds", type=int, default=5, help="straggler draws averaged per row")
    p.add_argument("--write", type=pathlib.Path, help="replace the table block in this file")
    a = p.parse_args(argv)
    cost = CostModel()
    started = time.perf_counter()
    body = table(steps=a.steps, seeds=a.seeds, cost=cost)
    block = "\n".join(
        [
            f"Reproduce with `{COMMAND}` ({a.steps} steps, mean over {a.seeds} straggler "
            f"seeds; the range is the min-max over seeds).",
            "",
            body,
        ]
    )
    print(block)
    print(f"\n({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    if a.write is not None:
        replace_block(a.write, block, begin=BEGIN, end=END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
