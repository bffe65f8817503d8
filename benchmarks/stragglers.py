"""Straggler tolerance: synchronous against local and hierarchical SGD, simulated at scale
(``sim``: :mod:`raytrec.sync.simulate`'s clock model) and measured on a local Ray cluster (``ray``).

    .venv/bin/python -m benchmarks.stragglers sim --write docs/stragglers.md
    .venv/bin/python -m benchmarks.stragglers ray [--rate 0] --straggler-seed 0 [--write PAGE]

Schedules in workers: ``2-8,4-32,8-64`` is groups of 8 every 2 steps, 32 every 4, all 64 every
8. ``ray`` builds its table from every run saved to ``--results`` with the same settings:
another ``--straggler-seed`` adds a repeat, ``--rate 0`` the time without stalls.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import ROOT, command, dlrm, md_table, parse, parser, publish, spread
from raytrec.config import SyncConfig
from raytrec.sync.schedule import plan_sync
from raytrec.sync.simulate import CostModel, gang_stalls, simulate
from raytrec.sync.stragglers import StragglerSpec

# (workers, stall rate, hierarchical configurations, the seed's HSGD speedup range)
SCALES = (
    (64, 0.02, ("2-8,4-32,8-64", "4-32,8-64"), (2.08, 2.45)),
    (128, 0.01, ("2-8,4-32,8-128", "4-32,8-128"), (2.57, 2.68)),
    (256, 0.01, ("1-4,2-16,4-64,8-256", "2-8,4-64,8-256", "4-16,8-256"), (2.63, 3.25)),
    (1024, 0.01, ("2-8,4-32,8-1024", "4-32,8-1024", "2-16,4-256,8-1024"), None),
    (4096, 0.01, ("2-8,4-32,8-4096", "4-32,8-4096", "2-16,4-256,8-4096"), None),
)
# The clock model with no compute and free all-reduces: what remains is stall waiting.
STALLS_ONLY = CostModel(step_s=1e-12, model_bytes=1e-12, hop_latency_s=0.0)


def to_sync_config(spec: str, *, gang_size: int) -> SyncConfig:
    """Seed notation in workers -> a schedule in gangs of ``gang_size``; levels no larger than a
    gang are dropped (it averages every step); the last level (all workers) is ``sync_every``."""
    *lower, (top_period, _) = [tuple(int(x) for x in p.split("-")) for p in spec.split(",")]
    levels = tuple((p, s // gang_size) for p, s in lower if s > gang_size)
    return SyncConfig(sync_every=top_period, levels=levels)


def seed_figure(label: str, seed_range: tuple[float, float] | None) -> str:
    if seed_range is None:
        return "not published"
    lo, hi = seed_range
    return {
        "local SGD every 2": f"lower bound of HSGD (<= {lo:.2f}x)",
        "local SGD every 8": f"upper bound of HSGD (>= {hi:.2f}x)",
    }.get(label, f"{lo:.2f}-{hi:.2f}x (HSGD range)" if label.startswith("HSGD") else "-")


def simulated(a: argparse.Namespace) -> str:
    rows: list[list[str]] = []
    cost = CostModel()
    for workers, rate, hsgd, seed_range in SCALES:
        labels = [(f"local SGD every {n}", f"{n}-{workers}") for n in (2, 4, 8)]
        labels += [(f"HSGD {h}", h) for h in hsgd]
        speed: dict[tuple[int, str], list[float]] = {}
        step4 = []
        for g in (4, 1):
            gangs = workers // g
            for seed in range(a.seeds):
                spec = StragglerSpec(rate=rate, stall_s=1.0, seed=seed)
                stalls = gang_stalls(spec, steps=a.steps, num_gangs=gangs, gang_size=g)

                def seconds(cfg: SyncConfig, stalls: np.ndarray = stalls, g: int = g) -> float:
                    plan = plan_sync(cfg, generation=0, live_gangs=range(stalls.shape[1]))
                    return simulate(plan, stalls, cost, gang_size=g).seconds

                base = seconds(SyncConfig(sync_every=1))
                step4 += [base / a.steps] if g == 4 else []
                for label, spec_ in labels:
                    cfg = to_sync_config(spec_, gang_size=g)
                    speed.setdefault((g, label), []).append(base / seconds(cfg))
        for i, (label, _) in enumerate(labels):
            lead = [f"{workers}", f"{100 * rate:.0f}%", f"{1e3 * np.mean(step4):.0f} ms"]
            h, w = speed[(4, label)], speed[(1, label)]
            hosts = f"{np.mean(h):.2f}x ({min(h):.2f}-{max(h):.2f})"
            rows.append([*(lead if i == 0 else [""] * 3), label, hosts, f"{np.mean(w):.2f}x"])
            rows[-1].append(seed_figure(label, seed_range))
    heads = "workers | stall rate | sync SGD step | schedule | speedup, hosts of 4 | speedup, per "
    heads += "worker | published (Cruise and Meta)"
    return (
        f"{a.steps} steps, mean over {a.seeds} straggler seeds; the range is the min-max over "
        f"seeds.\n\n{md_table(heads, rows, left=0)}"
    )


def schedules() -> list[tuple[str, SyncConfig]]:
    """Synchronous SGD (the reference), local SGD every 2, 4 and 8 steps, and the hierarchy of
    pairs of gangs every 2 steps, fours every 4 and all 8 every 8 (dense parts with them)."""
    lazy = functools.partial(SyncConfig, dense="with_schedule")
    return [
        ("synchronous", SyncConfig(sync_every=1)),
        *((f"local SGD every {n}", lazy(sync_every=n)) for n in (2, 4, 8)),
        ("HSGD 2-2,4-4,8-8", lazy(sync_every=8, levels=((2, 2), (4, 4)))),
    ]


#: The job every schedule trains: 8 single-rank gangs of a tiny DLRM, so that the stalls, not
#: the compute, dominate; the AUC is the mean of the last 3 intervals.
GANGS, LOG_EVERY, BATCH_SIZE, AUC_INTERVALS, CPUS_PER_RANK = 8, 32, 128, 3, 0.25


def setup_of(a: argparse.Namespace, *, stalls: bool = True) -> dict[str, Any]:
    """The settings a run's numbers depend on, apart from the schedule and straggler seed."""
    on = stalls and a.rate > 0 and a.stall_s > 0
    return {"steps": a.steps, "rate": a.rate if on else 0.0, "stall_s": a.stall_s if on else 0.0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One schedule's measurement under one straggler seed."""

    setup: dict[str, Any]
    label: str
    straggler_seed: int
    train_s: float  # first step to last, summed over the coordinator's intervals
    rows: int
    auc: float  # mean AUC of the last intervals
    charged_s: float  # the clock model's stall waiting for this seed's stalls


def load_runs(path: Path) -> list[Run]:
    """The runs saved to ``path`` (what an older version saved besides, left out)."""
    names = {f.name for f in dataclasses.fields(Run)}
    saved = json.loads(path.read_text()) if path.exists() else []
    return [Run(**{k: v for k, v in r.items() if k in names}) for r in saved]


def measure(a: argparse.Namespace) -> None:
    """Trains the job under each schedule with this invocation's straggler seed, and saves
    each run to ``--results`` (replacing a saved run of the same settings, schedule and seed)."""
    from raytrec import fit
    from raytrec.cluster import connect
    from raytrec.config import DataConfig, ScalingConfig, TestingConfig, TrainConfig

    connect(num_cpus=GANGS * CPUS_PER_RANK + (os.cpu_count() or 2))
    setup, seed = setup_of(a), a.straggler_seed
    stragglers = StragglerSpec(rate=setup["rate"], stall_s=setup["stall_s"], seed=seed)
    stalls = gang_stalls(stragglers, steps=a.steps, num_gangs=GANGS, gang_size=1)
    for label, sync in schedules():
        # LOG_EVERY: interval ends are job-wide barriers, so they fall on job-wide syncs.
        config = TrainConfig(
            model=dlrm(8, 500, 8, width=32), sync=sync, data=DataConfig(batch_size=BATCH_SIZE),
            scaling=ScalingConfig(num_workers=GANGS, gang_size=1, cpus_per_rank=CPUS_PER_RANK),
            testing=TestingConfig(stragglers=stragglers), num_steps=a.steps, log_every=LOG_EVERY,
            storage_path=str(a.results.parent), name="stragglers",
        )  # fmt: skip
        h = fit(config, shutdown_ray=False, on_progress=lambda _m: None).history
        rows = round(sum(m.samples_per_s * m.seconds for m in h))
        aucs = [m.auc for m in h[-AUC_INTERVALS:]]
        if rows != a.steps * GANGS * BATCH_SIZE or None in aucs:
            raise RuntimeError(f"{label}: trained {rows} rows, AUCs {aucs}")
        plan = plan_sync(sync, generation=0, live_gangs=range(GANGS))
        run = Run(
            setup=setup, label=label, straggler_seed=seed, rows=rows,
            train_s=sum(m.seconds for m in h),
            auc=statistics.fmean(x for x in aucs if x is not None),
            charged_s=simulate(plan, stalls, STALLS_ONLY, gang_size=1).seconds,
        )  # fmt: skip
        key = (setup, label, seed)
        runs = [r for r in load_runs(a.results) if (r.setup, r.label, r.straggler_seed) != key]
        a.results.parent.mkdir(parents=True, exist_ok=True)
        a.results.write_text(json.dumps([dataclasses.asdict(r) for r in [*runs, run]], indent=1))
        print(f"seed {seed} | {label:<22} | {run.train_s:7.1f} s | AUC {run.auc:.4f}")


def on_ray(a: argparse.Namespace) -> str:
    measure(a)
    saved = load_runs(a.results)
    runs = [r for r in saved if r.setup == setup_of(a)]
    quiet = [r for r in saved if r.setup == setup_of(a, stalls=False)]
    ref = {r.straggler_seed: r for r in runs if r.label == "synchronous"}
    rows = []
    for label, _ in schedules():
        mine = [r for r in runs if r.label == label and r.straggler_seed in ref]
        if not mine:
            continue
        t = [r.train_s for r in mine]
        base = [r.train_s for r in quiet if r.label == label]
        cost = statistics.median(t) - statistics.median(base) if base else None
        first = label == "synchronous"
        rates = [r.rows / r.train_s for r in mine]
        speedup = spread([ref[r.straggler_seed].train_s / r.train_s for r in mine], unit="x")
        gap = spread([100 * (r.auc / ref[r.straggler_seed].auc - 1) for r in mine], "+.2f", "%")
        charged = spread([r.charged_s for r in mine], ".1f", " s")
        rows.append([label, spread(t, ".1f", " s"), spread(rates, ",.0f")])
        rows[-1] += ["reference" if first else speedup, charged, spread(base, ".1f", " s")]
        rows[-1] += [spread([cost], ".1f", " s"), spread([r.auc for r in mine], ".4f")]
        rows[-1].append("reference" if first else gap)
    heads = "schedule | training time | rows/s | speedup | stall charged (clock model) | training "
    heads += "time without stalls | stall cost measured | AUC, last intervals | AUC vs synchronous"
    seeds = sorted({r.straggler_seed for r in runs})
    cmd = command(a, "--straggler-seed", "--rate")
    each = " ".join(map(str, seeds))
    return (
        "Reproduce with:\n\n```bash\n"
        f"for s in {each}; do {cmd} --rate 0 --straggler-seed $s; done\n"
        f"for s in {each}; do {cmd} --straggler-seed $s --write docs/stragglers.md; done\n```\n\n"
        f"Straggler seeds {', '.join(map(str, seeds))}: "
        "median (min to max); speedups and AUC gaps paired per seed.\n\n" + md_table(heads, rows)
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "stragglers", "docs/stragglers.md")
    p.add_argument("what", choices=("sim", "ray"), help="the clock model, or a local Ray cluster")
    p.add_argument("--steps", type=int, help="steps per run (sim: 1000, ray: 256)")
    p.add_argument("--seeds", type=int, default=5, help="sim: straggler draws averaged")
    p.add_argument("--rate", type=float, default=0.05, help="ray: stall probability per rank, step")
    p.add_argument("--stall-s", type=float, default=1.0, help="ray: a stall's length")
    p.add_argument("--straggler-seed", type=int, default=0, help="ray: the stalls' draw")
    p.add_argument("--results", type=Path, default=ROOT / "runs" / "stragglers" / "results.json")
    a = parse(p, argv)
    a.steps = a.steps or (1000 if a.what == "sim" else 256)
    sim = a.what == "sim"
    body, name = (simulated(a), "straggler_sim") if sim else (on_ray(a), "stragglers_ray")
    publish(a, body, name=name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
