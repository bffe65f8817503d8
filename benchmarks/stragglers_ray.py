"""Straggler tolerance measured on a local Ray cluster: synchronous vs local vs hierarchical SGD.

    .venv/bin/python benchmarks/stragglers_ray.py --write docs/stragglers.md

Trains the same job once per schedule and straggler seed with :func:`raytrec.fit`: ``--gangs``
single-rank gangs, the same model seed, steps and rows per rank, on rows of the synthetic
teacher model that are each trained once, so every interval's progressive-validation AUC is
measured on rows the model has not seen. ``--data synthetic`` (the default) makes the rows in
the ranks: batch ``s`` of rank ``r`` is the same in every run, so two schedules differ only in
how they sync. ``--data generated`` writes them to Parquet once and streams them with Ray
Data, whose ``streaming_split`` hands blocks to whichever rank asks first: which rows a rank
trains and is evaluated on then changes from run to run.

Each rank sleeps ``--stall-s`` seconds before a step with probability ``--rate`` (transient
stragglers, :class:`~raytrec.sync.stragglers.StragglerSpec`); repeat ``i`` draws its stalls
with seed ``--straggler-seed + i``, and every schedule meets exactly the same stalls under one
seed, so speedups are paired per seed.

Every run is saved to ``--results`` (JSON, one record per schedule and straggler seed, the
job's settings included), and the table is built from every saved run of the same settings:
invocations with different ``--straggler-seed`` add repeats, and one with ``--rate 0`` adds the
time each schedule takes without stalls. One invocation per seed keeps each under about a
quarter of an hour on a 2-core machine::

    .venv/bin/python benchmarks/stragglers_ray.py --rate 0
    for s in 0 1; do
        .venv/bin/python benchmarks/stragglers_ray.py --straggler-seed $s --write docs/stragglers.md
    done

Schedules (``--schedules``), group sizes counted in gangs:

- ``sync``: synchronous SGD, a job-wide sync after every step (dense gradients averaged over
  every gang with ``--sync-dense every_step``, the default);
- ``local-N``: local SGD, all gangs average every N steps;
- ``2-2,4-4,8-8``: hierarchical SGD in seed 002's notation: groups of 2 gangs every 2 steps,
  4 every 4, all 8 every 8 (the last pair must hold every gang).

Local and hierarchical runs average dense parameters with the schedule
(``sync.dense="with_schedule"``): with the default ``"every_step"`` a job-wide dense all-reduce
every step would hold every gang back at every stall.

Reported per schedule: training time (the coordinator's intervals, from the first step to
the last, start-up excluded), rows per second, speedup over synchronous SGD under the same
stalls, the stall time a strict-barrier clock model (:mod:`raytrec.sync.simulate`, zero
compute) charges for those stalls, the training time without stalls and the measured cost of
the stalls (the difference), and the AUC: the mean progressive-validation AUC of the last
``--auc-intervals`` logging intervals, with its gap to synchronous SGD's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shlex
import statistics
import sys
import time

from _docs import replace_block  # benchmarks/, the script's own folder

from raytrec import fit
from raytrec.cluster import connect
from raytrec.config import (
    DataConfig,
    DenseSync,
    ModelConfig,
    ScalingConfig,
    SyncConfig,
    TableConfig,
    TestingConfig,
    TrainConfig,
)
from raytrec.metrics import IntervalMetrics
from raytrec.sync.schedule import plan_sync
from raytrec.sync.simulate import CostModel, gang_stalls, simulate
from raytrec.sync.stragglers import StragglerSpec

ROOT = pathlib.Path(__file__).resolve().parent.parent
BEGIN = "<!-- stragglers_ray:begin -->"
END = "<!-- stragglers_ray:end -->"
DEFAULT_SCHEDULES = "sync,local-2,local-4,local-8,2-2,4-4,8-8"
# The clock model with no compute and free all-reduces: what remains is stall waiting.
STALLS_ONLY = CostModel(step_s=1e-12, model_bytes=1e-12, hop_latency_s=0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """A named sync schedule of the comparison."""

    label: str
    sync: SyncConfig


def parse_schedules(text: str, *, gangs: int, sync_dense: DenseSync) -> list[Schedule]:
    """``sync``, ``local-N`` and hierarchical ``P-S,...,P-gangs`` items, comma-separated.

    A hierarchical item is a run of ``period-size`` pairs; it ends with the pair whose size is
    ``gangs`` (the job-wide level). ``sync`` must come first: it is the reference.
    """
    out: list[Schedule] = []
    pending: list[tuple[int, int]] = []
    for item in (x.strip() for x in text.split(",")):
        if item == "sync" and not pending:
            out.append(
                Schedule(label="synchronous", sync=SyncConfig(sync_every=1, dense=sync_dense))
            )
        elif item.startswith("local-") and not pending:
            n = int(item.removeprefix("local-"))
            out.append(
                Schedule(
                    label=f"local SGD every {n}",
                    sync=SyncConfig(sync_every=n, dense="with_schedule"),
                )
            )
        else:
            try:
                period, size = (int(x) for x in item.split("-"))
            except ValueError:
                raise SystemExit(
                    f"--schedules: {item!r} is not 'sync', 'local-N' or 'period-gangs'"
                ) from None
            pending.append((period, size))
            if size == gangs:
                notation = ",".join(f"{p}-{s}" for p, s in pending)
                out.append(
                    Schedule(
                        label=f"HSGD {notation}",
                        sync=SyncConfig(
                            sync_every=period, levels=tuple(pending[:-1]), dense="with_schedule"
                        ),
                    )
                )
                pending = []
    if pending:
        raise SystemExit(f"--schedules: hierarchy {pending} does not end with a level of {gangs}")
    if not out or out[0].sync != SyncConfig(sync_every=1, dense=sync_dense):
        raise SystemExit("--schedules must start with 'sync', the reference schedule")
    return out


def build_config(
    a: argparse.Namespace, schedule: Schedule, stragglers: StragglerSpec
) -> TrainConfig:
    """The job every schedule trains: only ``sync`` and the straggler seed vary."""
    tables = tuple(
        TableConfig(
            name=f"t_cat_{i}",
            num_embeddings=a.rows_per_table,
            embedding_dim=a.dim,
            features=(f"cat_{i}",),
        )
        for i in range(a.tables)
    )
    return TrainConfig(
        model=ModelConfig(tables=tables, dense_arch_layers=(32, a.dim), over_arch_layers=(32, 1)),
        scaling=ScalingConfig(num_workers=a.gangs, gang_size=1, cpus_per_rank=a.cpus_per_rank),
        sync=schedule.sync,
        data=DataConfig(batch_size=a.batch_size, source=a.data),
        testing=TestingConfig(stragglers=stragglers),
        num_steps=a.steps,
        log_every=a.log_every,
        seed=a.seed,
        storage_path=str(a.storage_path),
        name="stragglers",
    )


def charged_stall_s(
    sync: SyncConfig, stragglers: StragglerSpec, *, steps: int, gangs: int
) -> float:
    """Seconds of stall a strict-barrier clock model charges ``sync`` for these stalls.

    Synchronous SGD pays every step that holds any stall; a schedule that syncs every N steps
    pays, per window, the largest stall total of a gang in each group that syncs.
    """
    plan = plan_sync(sync, generation=0, live_gangs=range(gangs))
    stalls = gang_stalls(stragglers, steps=steps, num_gangs=gangs, gang_size=1)
    return simulate(plan, stalls, STALLS_ONLY, gang_size=1).seconds


def tail_auc(history: list[IntervalMetrics], intervals: int) -> float:
    """Mean progressive-validation AUC of the last ``intervals`` rows of the history."""
    aucs = [m.auc for m in history[-intervals:]]
    if len(aucs) < intervals or any(x is None for x in aucs):
        raise ValueError(f"the history has no AUC for its last {intervals} intervals: {aucs}")
    return statistics.fmean(x for x in aucs if x is not None)


SETUP_FIELDS = (
    "data",
    "gangs",
    "steps",
    "log_every",
    "auc_intervals",
    "batch_size",
    "tables",
    "rows_per_table",
    "dim",
    "sync_dense",
    "seed",
    "cpus_per_rank",
)


def stall_settings(a: argparse.Namespace, *, stalls: bool = True) -> tuple[float, float]:
    """(rate, stall seconds) of the run; (0, 0) for the job without stalls."""
    if stalls and a.rate > 0 and a.stall_s > 0:
        return float(a.rate), float(a.stall_s)
    return 0.0, 0.0


def setup_of(a: argparse.Namespace, *, stalls: bool = True) -> dict[str, object]:
    """The settings a run's numbers depend on, apart from the schedule and the straggler seed.

    ``stalls=False``: the same job without stalls.
    """
    setup: dict[str, object] = {f: getattr(a, f) for f in SETUP_FIELDS}
    setup["rate"], setup["stall_s"] = stall_settings(a, stalls=stalls)
    return setup


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One schedule's measurement under one straggler seed."""

    setup: dict[str, object]
    label: str
    straggler_seed: int
    train_s: float  # first step to last, summed over the coordinator's intervals
    fit_s: float  # the whole fit() call, start-up and shutdown included
    rows: int
    auc: float  # mean AUC of the last intervals
    oracle_auc: float | None
    charged_s: float  # the clock model's stall waiting for this seed's stalls

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.train_s

    @property
    def key(self) -> tuple[str, str, int]:
        return (json.dumps(self.setup, sort_keys=True), self.label, self.straggler_seed)


def load_runs(path: pathlib.Path) -> list[Run]:
    if not path.exists():
        return []
    return [Run(**r) for r in json.loads(path.read_text())]


def save_run(path: pathlib.Path, run: Run) -> None:
    """Adds ``run`` to the results file, replacing an earlier run with the same key."""
    runs = [r for r in load_runs(path) if r.key != run.key] + [run]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([dataclasses.asdict(r) for r in runs], indent=1))
    tmp.replace(path)


def measure(a: argparse.Namespace, schedules: list[Schedule]) -> None:
    setup = setup_of(a)
    rate, stall_s = stall_settings(a)
    for repeat in range(a.repeats):
        seed = a.straggler_seed + repeat
        stragglers = StragglerSpec(rate=rate, stall_s=stall_s, mode="transient", seed=seed)
        # Rotate the order each repeat so that drift in the machine's load spreads over schedules.
        order = schedules[repeat % len(schedules) :] + schedules[: repeat % len(schedules)]
        for schedule in order:
            config = build_config(a, schedule, stragglers)
            started = time.perf_counter()
            result = fit(config, shutdown_ray=False, on_progress=lambda _m: None)
            rows = round(sum(m.samples_per_s * m.seconds for m in result.history))
            if rows != a.steps * a.gangs * a.batch_size:
                raise RuntimeError(f"{schedule.label}: trained {rows} rows, not the same data")
            run = Run(
                setup=setup,
                label=schedule.label,
                straggler_seed=seed,
                train_s=sum(m.seconds for m in result.history),
                fit_s=time.perf_counter() - started,
                rows=rows,
                auc=tail_auc(result.history, a.auc_intervals),
                oracle_auc=result.oracle_auc,
                charged_s=charged_stall_s(schedule.sync, stragglers, steps=a.steps, gangs=a.gangs),
            )
            save_run(a.results, run)
            print(
                f"straggler seed {seed} | {run.label:<22} | {run.train_s:7.1f} s | "
                f"{run.rows_per_s:8,.0f} rows/s | stall charged {run.charged_s:6.1f} s | "
                f"AUC {run.auc:.4f} | fit {run.fit_s:5.1f} s",
                file=sys.stderr,
                flush=True,
            )


def _spread(values: list[float], fmt: str, unit: str = "") -> str:
    """Median and, for several values, (min to max); "-" for none."""
    if not values:
        return "-"
    mid = format(statistics.median(values), fmt) + unit
    if len(values) == 1:
        return mid
    return f"{mid} ({format(min(values), fmt)} to {format(max(values), fmt)})"


def table(runs: list[Run], no_stalls: list[Run], labels: list[str]) -> str:
    """Medians over straggler seeds, (min to max) where there are several; speedups and AUC
    gaps are paired with synchronous SGD under the same seed. ``no_stalls``: the same job
    without stalls, for the measured cost of the stalls."""
    reference = {r.straggler_seed: r for r in runs if r.label == labels[0]}
    lines = [
        "| schedule | training time | rows/s | speedup | stall charged (clock model) "
        "| training time without stalls | stall cost measured | AUC, last intervals "
        "| AUC vs synchronous |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label in labels:
        mine = sorted(
            (r for r in runs if r.label == label and r.straggler_seed in reference),
            key=lambda r: r.straggler_seed,
        )
        if not mine:
            continue
        base = [r.train_s for r in no_stalls if r.label == label]
        cost = (
            [statistics.median([r.train_s for r in mine]) - statistics.median(base)] if base else []
        )
        speedup = [reference[r.straggler_seed].train_s / r.train_s for r in mine]
        gap = [100.0 * (r.auc / reference[r.straggler_seed].auc - 1.0) for r in mine]
        paired = (
            f"{_spread(speedup, '.2f', 'x')} | {_spread([r.charged_s for r in mine], '.1f', ' s')}"
            if label != labels[0]
            else f"reference | {_spread([r.charged_s for r in mine], '.1f', ' s')}"
        )
        lines.append(
            f"| {label} | {_spread([r.train_s for r in mine], '.1f', ' s')} "
            f"| {_spread([r.rows_per_s for r in mine], ',.0f')} "
            f"| {paired} "
            f"| {_spread(base, '.1f', ' s')} "
            f"| {_spread(cost, '.1f', ' s')} "
            f"| {_spread([r.auc for r in mine], '.4f')} "
            f"| {_spread(gap, '+.2f', '%') if label != labels[0] else 'reference'} |"
        )
    return "\n".join(lines)


def base_command(argv: list[str]) -> str:
    """This invocation's command line without the options that vary between invocations."""
    drop = {"--straggler-seed", "--repeats", "--write", "--rate"}
    kept: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in drop:
            skip = "=" not in token
            continue
        kept.append(token)
    return shlex.join([".venv/bin/python", "benchmarks/stragglers_ray.py", *kept])


def describe(a: argparse.Namespace, runs: list[Run], no_stalls: list[Run], argv: list[str]) -> str:
    """The paragraph above the table: how to reproduce it and what was run."""
    seeds = sorted({r.straggler_seed for r in runs})
    cmd = base_command(argv)
    rate = "" if a.rate == 0.05 else f" --rate {a.rate:g}"
    minutes = statistics.median(
        sum(r.fit_s for r in runs if r.straggler_seed == s) / 60 for s in seeds
    )
    lines = [
        "Reproduce with (one invocation per straggler seed, about "
        f"{minutes:.0f} minutes each on {os.cpu_count()} cores):",
        "",
        "```bash",
    ]
    if no_stalls:
        quiet = sorted({r.straggler_seed for r in no_stalls})
        lines.append(
            f"for s in {' '.join(map(str, quiet))}; do {cmd} --rate 0 --straggler-seed $s; done"
        )
    lines += [
        f"for s in {' '.join(map(str, seeds))}; do",
        f"    {cmd}{rate} --straggler-seed $s --write docs/stragglers.md",
        "done",
        "```",
        "",
        f"{a.gangs} gangs of 1 rank, {a.steps} steps of {a.batch_size} rows per rank "
        f"({a.steps * a.gangs * a.batch_size:,} rows, each trained once; data={a.data!r}), "
        f"{a.tables} tables x {a.rows_per_table} rows x dim {a.dim}; every rank stalls "
        f"{a.stall_s:g} s before a step with probability {a.rate:g}; synchronous SGD with "
        f"dense={a.sync_dense!r}, the others with dense='with_schedule'. Straggler seeds "
        f"{', '.join(map(str, seeds))}: median (min to max); speedup and AUC gap paired per "
        f"seed; AUC: mean of the last {a.auc_intervals} intervals of {a.log_every} steps"
        + (
            f" (the teacher's own AUC on this data: {runs[0].oracle_auc:.4f})."
            if runs[0].oracle_auc is not None
            else "."
        ),
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gangs", type=int, default=8, help="single-rank gangs")
    p.add_argument(
        "--data",
        choices=("synthetic", "generated"),
        default="synthetic",
        help="teacher-model rows made in each rank (the same rows in every run), or the "
        "generated Parquet through Ray Data (which rank reads which rows depends on timing)",
    )
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--log-every", type=int, default=32, help="a multiple of every sync period")
    p.add_argument("--auc-intervals", type=int, default=3, help="AUC: mean of the last K intervals")
    p.add_argument("--batch-size", type=int, default=128, help="rows per rank per step")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows-per-table", type=int, default=500)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--rate", type=float, default=0.05, help="stall probability per rank and step")
    p.add_argument("--stall-s", type=float, default=1.0)
    p.add_argument("--schedules", default=DEFAULT_SCHEDULES)
    p.add_argument("--sync-dense", choices=("every_step", "with_schedule"), default="every_step")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="straggler seeds in this invocation (0: only rebuild the table from --results)",
    )
    p.add_argument("--seed", type=int, default=0, help="model and data seed")
    p.add_argument("--straggler-seed", type=int, default=0)
    p.add_argument("--cpus-per-rank", type=float, default=0.25)
    p.add_argument("--storage-path", type=pathlib.Path, default=ROOT / "runs" / "stragglers_ray")
    p.add_argument(
        "--results",
        type=pathlib.Path,
        default=ROOT / "runs" / "stragglers_ray" / "results.json",
        help="runs saved so far (the table uses every run with the same settings)",
    )
    p.add_argument("--write", type=pathlib.Path, help="replace the table block in this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    schedules = parse_schedules(a.schedules, gangs=a.gangs, sync_dense=a.sync_dense)
    for s in schedules:
        if a.log_every % s.sync.sync_every:
            # The coordinator's interval ends are job-wide barriers; off a job-wide sync they
            # would add waiting that the schedule itself does not have.
            raise SystemExit(f"--log-every={a.log_every} is not a multiple of {s.label}'s period")
    if a.repeats:
        connect(num_cpus=a.gangs * a.cpus_per_rank + (os.cpu_count() or 2))
        measure(a, schedules)
    saved = load_runs(a.results)
    runs = [r for r in saved if r.setup == setup_of(a)]
    no_stalls = [r for r in saved if r.setup == setup_of(a, stalls=False)]
    block = "\n".join(
        [
            describe(a, runs, no_stalls, argv),
            "",
            table(runs, no_stalls, [s.label for s in schedules]),
        ]
    )
    print(block)
    if a.write is not None:
        replace_block(a.write, block, begin=BEGIN, end=END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
