"""Recovery time after a lost rank: elastic survivors against restart from a checkpoint.

    .venv/bin/python -m benchmarks.recovery --write docs/fault_tolerance.md

For each model size, job shape and repeat, three runs on one embedded Ray cluster; the last
gang's last rank dies as it starts step S = ``--fail-step`` (``kill_rank@S``), with a checkpoint
every ``--checkpoint-every`` steps and ``log_every=1``:

1. **survivors**: the others re-form, replay its uncommitted batches and go on alone;
2. **restart from checkpoint**: a new job of the original shape resumes from the last checkpoint
   before S, redoes the lost steps and trains step S;
3. **survivors and a new gang**: run 1 with ``elastic.grow=True``; a new gang is placed at once
   on the freed resources, heals from a live peer and joins.

Survivors are timed from the failure (the row of step S-1) to their next completed step; the
restart from calling ``fit`` to its row of step S (detection and stopping counted as 0, so a
lower bound); the new gang from ``gang_requested`` to ``gang_joined`` and its first step.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import operator
import os
import pathlib
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from typing import TypeVar

from benchmarks.common import ROOT, dims_list, dlrm, header, parse, parser, replace_block, spread
from raytrec import fit
from raytrec.checkpoint.config import CheckpointConfig, checkpoint_root
from raytrec.checkpoint.layout import CheckpointStore
from raytrec.cluster import connect
from raytrec.config import DataConfig, ScalingConfig, SyncConfig, TestingConfig, TrainConfig
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import (
    CheckpointRestored,
    Event,
    GangJoined,
    GangPlaced,
    GangRequested,
    GenerationStarted,
    RankDied,
)
from raytrec.elastic.faults import FaultKind, FaultSpec
from raytrec.observability.metrics import IntervalMetrics

E = TypeVar("E", bound=Event)

HEADING = "## Recovery time: survivors against restart from checkpoint"


def label(dims: Sequence[int]) -> str:
    return " x ".join(f"{d:,}" for d in dims)


def _first(events: Sequence[Event], kind: type[E], *, after: float = -1.0) -> E:
    for e in events:
        if isinstance(e, kind) and e.at >= after:
            return e
    raise ValueError(f"no {kind.kind!r} event at or after t={after:g}: {[e.kind for e in events]}")


def _row(rows: Sequence[IntervalMetrics], step: int) -> IntervalMetrics:
    for r in rows:
        if r.step == step:
            return r
    raise ValueError(f"no history row for step {step}: rows {[r.step for r in rows]}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElasticTimings:
    """The elastic run's recovery, in seconds from the failure (the row of ``last_done``)."""

    step_s: float  # one step before the failure (median of steps 2.., the first starts data)
    detect_s: float  # -> rank_died
    reform_s: float  # rank_died -> the survivors' generation_started
    resume_s: float  # -> the survivors' next completed step
    resumed_step: int
    # None where no new gang joined within the run:
    heal_start_s: float | None = None  # gang_requested -> gang_placed (placement, actors, build)
    heal_transfer_s: float | None = None  # gang_placed -> gang_joined (sync, generation, broadcast)
    heal_join_s: float | None = None  # gang_requested -> gang_joined
    heal_step_s: float | None = None  # gang_requested -> first completed step with every gang
    survivors_gap_s: float | None = None  # last step before the join -> first with every gang


def elastic_timings(
    events: Sequence[Event],
    rows: Sequence[IntervalMetrics],
    *,
    last_done: int,
    full_gangs: int,
) -> ElasticTimings:
    """Reads the recovery and the heal out of one elastic run's events and history rows;
    ``last_done`` is the last step completed before the failure."""
    failed = _row(rows, last_done)
    died = _first(events, RankDied, after=failed.at)
    reformed = _first(events, GenerationStarted, after=died.at)
    resumed = next((r for r in rows if r.at > died.at), None)
    if resumed is None:
        raise ValueError(f"no completed step after the rank died at t={died.at:g}")
    timings = ElasticTimings(
        step_s=statistics.median(r.seconds / r.steps for r in rows if 2 <= r.step <= last_done),
        detect_s=died.at - failed.at,
        reform_s=reformed.at - died.at,
        resume_s=resumed.at - failed.at,
        resumed_step=resumed.step,
    )
    try:
        requested = _first(events, GangRequested, after=died.at)
        placed = _first(events, GangPlaced, after=requested.at)
        joined = _first(events, GangJoined, after=placed.at)
    except ValueError:
        return timings  # no new gang joined within the run: reported as not observed
    full = next((r for r in rows if r.at > joined.at and r.gangs == full_gangs), None)
    before = [r for r in rows if r.at < joined.at]  # at least the failure's row
    return dataclasses.replace(
        timings,
        heal_start_s=placed.at - requested.at,
        heal_transfer_s=joined.at - placed.at,
        heal_join_s=joined.at - requested.at,
        heal_step_s=None if full is None else full.at - requested.at,
        survivors_gap_s=None if full is None else full.at - before[-1].at,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RestartTimings:
    """The restarted job, in seconds from calling ``fit``."""

    setup_s: float  # driver: checkpoint check, plan, coordinator start
    start_s: float  # placement, actors, imports, DMP build, first generation
    load_s: float  # checkpoint load
    redo_s: float  # first batches and the lost steps c+1 .. last_done
    step_s: float  # step last_done + 1, the first one past the failure
    redone_steps: int

    @property
    def total_s(self) -> float:
        return self.setup_s + self.start_s + self.load_s + self.redo_s + self.step_s


def restart_timings(
    events: Sequence[Event],
    rows: Sequence[IntervalMetrics],
    arrivals: Sequence[tuple[float, float]],
    *,
    last_done: int,
) -> RestartTimings:
    """Reads the restarted job's parts out of its events, rows and the rows' (arrival time on the
    driver's clock, in seconds after calling ``fit``; ``at``); ``last_done`` as in
    :func:`elastic_timings`. The coordinator clock's zero on the driver's clock is the smallest
    arrival - ``at`` (a row arrives no sooner than it is made): an upper bound by its polling."""
    started = _first(events, GenerationStarted)
    restored = _first(events, CheckpointRestored, after=started.at)
    last_lost, beyond = _row(rows, last_done), _row(rows, last_done + 1)
    return RestartTimings(
        setup_s=min(arrival - at for arrival, at in arrivals),
        start_s=started.at,
        load_s=restored.at - started.at,
        redo_s=last_lost.at - restored.at,
        step_s=beyond.at - last_lost.at,
        redone_steps=last_done - restored.saved_step,
    )


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One size, shape and repeat: the three runs."""

    size: str
    shape: str
    repeat: int
    survivors: ElasticTimings  # the survivors alone (no growth)
    restart: RestartTimings
    growing: ElasticTimings  # the survivors while a new gang is placed, healed and joined

    @property
    def ratio(self) -> float:  # how many times sooner the survivors resumed than the restart
        return self.restart.total_s / self.survivors.resume_s

    @property
    def ratio_growing(self) -> float:  # the same, with a new gang placed at once
        return self.restart.total_s / self.growing.resume_s


def last_checkpoint_before(last_done: int, every: int) -> int:
    """The step of the last checkpoint saved every ``every`` steps, by step ``last_done``."""
    return (last_done // every) * every


def build_config(
    a: argparse.Namespace,
    size: tuple[int, ...],
    shape: tuple[int, ...],
    *,
    faults: bool,
    steps: int,
    grow: bool = False,
) -> TrainConfig:
    """The job every run recovers; ``faults`` adds the killed rank, ``grow`` the new gang; with
    ``--source parquet`` it reads the shape's Parquet data by index."""
    path = str(parquet_dir(a, shape)) if a.source == "parquet" else None
    kill = FaultSpec(kind=FaultKind.KILL_RANK, step=a.fail_step, rank=shape[0] * shape[1] - 1)
    return TrainConfig(
        model=dlrm(*size),
        scaling=ScalingConfig(
            num_workers=shape[0] * shape[1], gang_size=shape[1], cpus_per_rank=a.cpus_per_rank
        ),
        sync=SyncConfig(sync_every=a.sync_every),
        data=DataConfig(batch_size=a.batch_size, source=a.source, path=path),
        elastic=ElasticConfig(
            min_gangs=1,
            max_gangs=shape[0],
            grow=grow,
            collective_timeout_s=a.collective_timeout_s,
            step_timeout_s=a.step_timeout_s,
            poll_s=0.2,
        ),
        checkpoint=CheckpointConfig(every_n_steps=a.checkpoint_every, num_to_keep=None),
        testing=TestingConfig(faults=(kill,) if faults else ()),
        num_steps=steps,
        log_every=1,
        seed=a.seed,
        storage_path=str(a.storage_path / "jobs"),
        name="recovery",
    )


def run_elastic(
    a: argparse.Namespace, size: tuple[int, ...], shape: tuple[int, ...], *, grow: bool
) -> tuple[ElasticTimings, str]:
    """An elastic run; returns its timings and the checkpoint before the failure."""
    # Alone, the survivors need up to sync_every steps to replay the lost gang's batches.
    steps = a.fail_step + (a.steps_after if grow else 2 * a.sync_every + 1)
    config = build_config(a, size, shape, faults=True, steps=steps, grow=grow)
    result = fit(config, shutdown_ray=False, on_progress=lambda _row: None)
    # Parquet: the survivors also train the lost gang's rows, in more steps than num_steps.
    short = result.steps < steps if a.source == "parquet" else result.steps != steps
    if short or result.lost_batches:
        raise RuntimeError(
            f"elastic run ended at step {result.steps} of {config.num_steps} with "
            f"{result.lost_batches} lost batches: {result.events}"
        )
    timings = elastic_timings(
        result.events, result.history, last_done=a.fail_step - 1, full_gangs=shape[0]
    )
    wanted = last_checkpoint_before(a.fail_step - 1, a.checkpoint_every)
    store = CheckpointStore(checkpoint_root(result.run_dir))
    ref = next((c for c in store.committed() if c.step == wanted), None)
    if ref is None:
        raise RuntimeError(f"no checkpoint of step {wanted} in {store.root}")
    return timings, ref.uri


def parquet_dir(a: argparse.Namespace, shape: tuple[int, ...]) -> pathlib.Path:
    """Where the Parquet data of ``shape``'s jobs is (``--source parquet``)."""
    return a.storage_path / f"data-{label(shape)}"


def write_parquet(a: argparse.Namespace, shape: tuple[int, ...], vocab: int) -> None:
    """One epoch for the longest run of ``shape`` (every rank's batches of its steps), ids
    below ``vocab``; written once per invocation and read by every run of that shape."""
    from raytrec.data.generate import write_synthetic_parquet

    out = parquet_dir(a, shape)
    shutil.rmtree(out, ignore_errors=True)
    rows = (a.fail_step + a.steps_after) * shape[0] * shape[1] * a.batch_size
    write_synthetic_parquet(
        out, rows=rows, files=8, row_groups_per_file=4, seed=a.seed, num_embeddings=vocab
    )


def run_restart(
    a: argparse.Namespace, size: tuple[int, ...], shape: tuple[int, ...], checkpoint: str
) -> RestartTimings:
    """A fresh job of the original shape resumes from ``checkpoint`` and trains through step S."""
    config = build_config(a, size, shape, faults=False, steps=a.fail_step)
    arrivals: list[tuple[float, float]] = []
    called = time.perf_counter()

    def arrived(row: IntervalMetrics) -> None:
        arrivals.append((time.perf_counter() - called, row.at))

    result = fit(config, shutdown_ray=False, on_progress=arrived, resume_from_checkpoint=checkpoint)
    return restart_timings(result.events, result.history, arrivals, last_done=a.fail_step - 1)


def measure(a: argparse.Namespace) -> tuple[list[Measurement], list[str]]:
    """Both ways of recovering for every size, shape and repeat; a run that fails is reported
    and the others go on."""
    out: list[Measurement] = []
    failures: list[str] = []
    if a.source == "parquet":
        for shape in a.shapes:
            write_parquet(a, shape, vocab=max(s[1] for s in a.sizes))
    for repeat, size, shape in itertools.product(range(a.repeats), a.sizes, a.shapes):
        where = f"repeat {repeat} | {label(size)} | {label(shape)}"
        try:
            survivors, checkpoint = run_elastic(a, size, shape, grow=False)
            restart = run_restart(a, size, shape, checkpoint)
            growing, _ = run_elastic(a, size, shape, grow=True)
            m = Measurement(label(size), label(shape), repeat, survivors, restart, growing)
            out.append(m)
            took = f"survivors {survivors.resume_s:.2f} s, restart {restart.total_s:.2f} s"
            print(f"{where} | {took}: {m.ratio:.1f}x", file=sys.stderr, flush=True)
        except Exception as e:  # reported, counted, and the next run goes on
            failures.append(f"{where}: {type(e).__name__}: {str(e)[:300]}")
            print(f"FAILED: {failures[-1]}", file=sys.stderr, flush=True)
        finally:  # the three jobs' run directories
            shutil.rmtree(a.storage_path / "jobs", ignore_errors=True)
    return out, failures


def tables(ms: Sequence[Measurement], a: argparse.Namespace) -> str:
    """:data:`TABLES`, median (min to max) per size and shape."""
    groups = [
        (s, g, [m for m in ms if (m.size, m.shape) == (label(s), label(g))])
        for s, g in itertools.product(a.sizes, a.shapes)
    ]
    out = []
    for title, columns in TABLES:
        heads = " | ".join(
            ["model: tables x rows x dim", "gangs x ranks", *(c[0] for c in columns)]
        )
        lines = [title, "", f"| {heads} |", "| --- | --- |" + " ---: |" * len(columns)]
        for s, g, mine in groups:
            get = [(operator.attrgetter(path), spec) for _, path, spec in columns]
            cells = [spread([value(m) for m in mine], spec) for value, spec in get]
            if mine:
                lines.append(f"| {label(s)} | {label(g)} | " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


# (title, [(column, attribute of a Measurement, format)]) of each table
TABLES = [
    (
        "Survivors against restart from checkpoint (seconds from the failure):",
        [
            ("step", "survivors.step_s", ".3f"),
            ("survivors resume", "survivors.resume_s", ".2f"),
            ("restart from checkpoint", "restart.total_s", ".2f"),
            ("restart / survivors", "ratio", ".1f"),
            ("survivors resume, new gang placed at once", "growing.resume_s", ".2f"),
            ("restart / survivors, new gang", "ratio_growing", ".1f"),
            ("new gang joined", "growing.heal_join_s", ".2f"),
            ("first step with every gang", "growing.heal_step_s", ".2f"),
        ],
    ),
    (
        "Survivors, alone and with a new gang placed at once (seconds from the failure):",
        [
            ("detection", "survivors.detect_s", ".2f"),
            ("re-forming", "survivors.reform_s", ".2f"),
            ("detection, new gang", "growing.detect_s", ".2f"),
            ("re-forming, new gang", "growing.reform_s", ".2f"),
            ("survivors' longest gap while the new gang joins", "growing.survivors_gap_s", ".2f"),
            ("new gang: start and build", "growing.heal_start_s", ".2f"),
            ("new gang: sync and state broadcast", "growing.heal_transfer_s", ".2f"),
        ],
    ),
    (
        "Restart from checkpoint (seconds from calling `fit`):",
        [
            ("driver set-up", "restart.setup_s", ".2f"),
            ("rank start and build", "restart.start_s", ".2f"),
            ("checkpoint load", "restart.load_s", ".2f"),
            ("redo lost steps", "restart.redo_s", ".2f"),
            ("step S", "restart.step_s", ".2f"),
        ],
    ),
]


def write_into(path: pathlib.Path, block: str, *, source: str = "synthetic") -> None:
    """Replaces the block of ``source``'s runs in ``path``, or appends it as a new section."""
    name = "recovery" if source == "synthetic" else f"recovery-{source}"
    replace_block(path, block, name=name, heading=f"{HEADING} ({source} data)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = parser(__doc__, "recovery", "docs/fault_tolerance.md")
    p.add_argument("--sizes", type=dims_list(3), default="26x10000x16,26x100000x32")
    p.add_argument("--shapes", type=dims_list(2), default="2x2,3x1", help="at least 2 gangs")
    p.add_argument("--batch-size", type=int, default=256, help="rows per rank per step")
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--fail-step", type=int, default=16, help="the rank dies starting this step")
    p.add_argument("--steps-after", type=int, default=400, help="run 3: room to heal")
    p.add_argument("--source", choices=("synthetic", "parquet"), default="synthetic")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpus-per-rank", type=float, default=0.5)
    p.add_argument("--collective-timeout-s", type=float, default=10.0)
    p.add_argument("--step-timeout-s", type=float, default=120.0)
    p.add_argument("--storage-path", type=pathlib.Path, default=ROOT / "runs" / "recovery")
    a = parse(p, argv)
    c = last_checkpoint_before(a.fail_step - 1, a.checkpoint_every)
    if min(gangs for gangs, _ in a.shapes) < 2:
        p.error("--shapes: at least 2 gangs, so that one survives")
    if c < 1 or c == a.fail_step - 1 or a.steps_after < 2 * a.sync_every + 1:
        p.error(
            "--fail-step must come at least two steps after a checkpoint (so that completed "
            "steps are lost), and --steps-after be at least 2 x --sync-every + 1"
        )
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    load_start = os.getloadavg()[0]
    most = max((g[0] + 1) * g[1] for g in a.shapes)  # room for the new gang
    connect(num_cpus=most * a.cpus_per_rank + (os.cpu_count() or 2))
    a.storage_path.mkdir(parents=True, exist_ok=True)
    ms, failures = measure(a)
    if not ms:
        return 1
    c = last_checkpoint_before(a.fail_step - 1, a.checkpoint_every)
    setup = (
        f"- {a.repeats} repeats, median (min to max); {a.source} data; `kill_rank@{a.fail_step}` "
        f"(the last gang's last rank), a checkpoint every {a.checkpoint_every} steps, so the "
        f"restart redoes steps {c + 1}..{a.fail_step - 1}; {a.batch_size} rows per rank per "
        f"step, `collective_timeout_s={a.collective_timeout_s:g}`; 1-minute load average "
        f"{load_start:.1f} at the start."
        + "".join(f"\n- failed, not in the tables: {f}" for f in failures)
    )
    block = f"{header(a)}\n{setup}\n\n{tables(ms, a)}"
    print(block)
    if a.write is not None:
        write_into(a.write, block, source=a.source)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
