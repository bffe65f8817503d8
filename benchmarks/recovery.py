"""Recovery time after a lost rank: elastic survivors against restart from a checkpoint.

    .venv/bin/python benchmarks/recovery.py --write docs/fault_tolerance.md

For each model size, job shape and repeat, one invocation runs the same job three times on one
embedded Ray cluster (127.0.0.1):

1. **Survivors.** G gangs of L ranks, a checkpoint every ``--checkpoint-every`` steps, and job
   rank G*L-1 (the last gang's last rank) killed as it starts step S = ``--fail-step``
   (``kill_rank@S``: the process exits before training step S, so steps 1..S-1 are done). The
   coordinator drops that gang, re-forms the survivors and replays the lost gang's uncommitted
   batches; ``elastic.grow=False``, so the survivors go on alone. ``log_every=1``: every step
   is a history row stamped with the coordinator's clock, the clock of the events.
2. **Restart from checkpoint**, the usual way to recover the same job: every worker stopped, a
   new job of the original shape started with ``resume_from_checkpoint`` = the last checkpoint
   before the failure (step c, saved by run 1), which loads it, trains steps c+1..S-1 again and
   then step S. The Ray cluster stays up, as it does when Ray Train restarts a worker group.
3. **Survivors and a new gang.** Run 1 with ``elastic.grow=True``: the dropped gang's
   resources are free at once, so the coordinator also places a new gang, which heals from a
   live peer and joins at an interval boundary.

What is counted, in seconds from the failure. The history row of step S-1 stands for the
moment of failure (the kill follows it by the few milliseconds it takes to start the next
interval), so the survivors' figures are upper bounds by that much.

- **survivors resume** (runs 1 and 3): -> the survivors' next completed step (the first
  history row after the ``rank_died`` event). Parts: detection (-> ``rank_died``, logged once
  every live rank has answered or given up), re-forming (-> the survivors'
  ``generation_started``), the rest (a sync, the dense broadcast, the replay queue, the next
  interval's batches, the step; in run 3 also whatever the new gang holds up).
- **restart from checkpoint**: detection and stopping the old workers counted as 0, so this is
  a lower bound; then the new job from calling ``fit`` to its history row of step S. ``fit``
  runs on the driver, the rows carry the new coordinator's clock: that clock's zero on the
  driver's clock is taken as the smallest (arrival - row time) over the rows, which overstates
  it by the smallest delay of ``fit``'s once-a-second progress polling. Parts: driver set-up
  (checkpoint check, sharding plan, coordinator start), rank start (placement groups, actors,
  imports, DMP build, first generation), checkpoint load, redo (first batches and steps
  c+1..S-1), step S.
- **new gang** (run 3): ``gang_requested`` (right after re-forming; the dropped gang's
  resources are free) -> ``gang_placed`` (logged once its actors are started and built) ->
  ``gang_joined`` (a job-wide sync, a new generation, the state broadcast from the peer) -> the
  first completed step with every gang. The new gang is built in the background while the
  survivors train and joins at the first interval boundary after; the survivors' longest gap
  between two steps meanwhile is reported too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from _docs import replace_block  # benchmarks/, the script's own folder

from raytrec import fit
from raytrec.checkpoint.config import CheckpointConfig, checkpoint_root
from raytrec.checkpoint.layout import CheckpointStore
from raytrec.cluster import connect
from raytrec.config import (
    DataConfig,
    ModelConfig,
    ScalingConfig,
    SyncConfig,
    TableConfig,
    TestingConfig,
    TrainConfig,
)
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.faults import FaultKind, FaultSpec
from raytrec.metrics import IntervalMetrics

ROOT = pathlib.Path(__file__).resolve().parent.parent
BEGIN = "<!-- recovery:begin -->"
END = "<!-- recovery:end -->"
HEADING = "## Recovery time: survivors against restart from checkpoint"
# With ``--source parquet`` the results go into a section of their own.
PARQUET_BEGIN = "<!-- recovery-parquet:begin -->"
PARQUET_END = "<!-- recovery-parquet:end -->"
PARQUET_HEADING = "## Recovery time with Parquet data read by index"
TARGET_RATIO = 10.0


def _ints(text: str, what: str, n: int) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        values = ()
    if len(values) != n or min(values) < 1:
        raise SystemExit(f"{text!r} is not {what}")
    return values


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSize:
    """``tables`` embedding tables of ``rows`` rows and dimension ``dim``."""

    tables: int
    rows: int
    dim: int

    @classmethod
    def parse(cls, text: str) -> ModelSize:
        """``"26x100000x32"``: tables x rows x dim."""
        tables, rows, dim = _ints(text, "TABLESxROWSxDIM, e.g. 26x10000x16", 3)
        return cls(tables=tables, rows=rows, dim=dim)

    @property
    def label(self) -> str:
        return f"{self.tables} x {self.rows:,} x {self.dim}"

    @property
    def weight_mib(self) -> float:
        return self.tables * self.rows * self.dim * 4 / 2**20


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    """``gangs`` gangs of ``gang_size`` ranks."""

    gangs: int
    gang_size: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        """``"2x2"``: gangs x ranks per gang; at least 2 gangs, so that one survives."""
        gangs, gang_size = _ints(text, "GANGSxRANKS with at least 2 gangs, e.g. 2x2", 2)
        if gangs < 2:
            raise SystemExit(f"{text!r}: at least 2 gangs, so that a gang survives")
        return cls(gangs=gangs, gang_size=gang_size)

    @property
    def label(self) -> str:
        return f"{self.gangs} x {self.gang_size}"

    @property
    def world(self) -> int:
        return self.gangs * self.gang_size


# -- what the events and rows say (pure) ------------------------------------------------------


def _first(events: Sequence[dict[str, Any]], kind: str, *, after: float = -1.0) -> dict[str, Any]:
    for e in events:
        if e["kind"] == kind and e["at"] >= after:
            return e
    raise ValueError(f"no {kind!r} event at or after t={after:g}: {[e['kind'] for e in events]}")


def _row(rows: Sequence[IntervalMetrics], step: int) -> IntervalMetrics:
    for r in rows:
        if r.step == step:
            return r
    raise ValueError(f"no history row for step {step}: rows {[r.step for r in rows]}")


def steady_step_s(rows: Sequence[IntervalMetrics], *, through: int) -> float:
    """Median seconds of one step over the rows of steps 2..``through`` (the first carries the
    data pipeline's start)."""
    times = [r.seconds / r.steps for r in rows if 2 <= r.step <= through]
    if not times:
        raise ValueError(f"no rows between steps 2 and {through}")
    return statistics.median(times)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElasticTimings:
    """The elastic run's recovery, in seconds from the failure (the row of ``last_done``)."""

    step_s: float  # one step before the failure (median)
    detect_s: float  # -> rank_died
    reform_s: float  # rank_died -> the survivors' generation_started
    resume_s: float  # -> the survivors' next completed step
    resumed_step: int
    heal_start_s: float | None  # gang_requested -> gang_placed (placement, actors, DMP build)
    heal_transfer_s: float | None  # gang_placed -> gang_joined (sync, generation, broadcast)
    heal_join_s: float | None  # gang_requested -> gang_joined
    heal_step_s: float | None  # gang_requested -> first completed step with every gang
    survivors_gap_s: float | None  # last step before the join -> first step with every gang


def elastic_timings(
    events: Sequence[dict[str, Any]],
    rows: Sequence[IntervalMetrics],
    *,
    last_done: int,
    full_gangs: int,
) -> ElasticTimings:
    """Reads the recovery and the heal out of one elastic run's events and history rows;
    ``last_done`` is the last step completed before the failure."""
    failed = _row(rows, last_done)
    died = _first(events, "rank_died", after=failed.at)
    reformed = _first(events, "generation_started", after=died["at"])
    resumed = next((r for r in rows if r.at > died["at"]), None)
    if resumed is None:
        raise ValueError(f"no completed step after the rank died at t={died['at']:g}")
    heal: dict[str, float | None] = dict.fromkeys(("start", "transfer", "join", "step", "gap"))
    try:
        requested = _first(events, "gang_requested", after=died["at"])
        placed = _first(events, "gang_placed", after=requested["at"])
        joined = _first(events, "gang_joined", after=placed["at"])
    except ValueError:
        pass  # no new gang joined within the run: reported as not observed
    else:
        heal.update(
            start=placed["at"] - requested["at"],
            transfer=joined["at"] - placed["at"],
            join=joined["at"] - requested["at"],
        )
        full = next((r for r in rows if r.at > joined["at"] and r.gangs == full_gangs), None)
        before = [r for r in rows if r.at < joined["at"]]  # at least the failure's row
        if full is not None:
            heal["step"] = full.at - requested["at"]
            heal["gap"] = full.at - before[-1].at
    return ElasticTimings(
        step_s=steady_step_s(rows, through=last_done),
        detect_s=died["at"] - failed.at,
        reform_s=reformed["at"] - died["at"],
        resume_s=resumed.at - failed.at,
        resumed_step=resumed.step,
        heal_start_s=heal["start"],
        heal_transfer_s=heal["transfer"],
        heal_join_s=heal["join"],
        heal_step_s=heal["step"],
        survivors_gap_s=heal["gap"],
    )


def clock_zero(arrivals: Sequence[tuple[float, float]]) -> float:
    """The coordinator clock's zero on the driver's clock, from (driver arrival, row ``at``)
    pairs: a row arrives no sooner than it is made, so the smallest difference is an upper
    bound, off by that row's polling delay."""
    if not arrivals:
        raise ValueError("no rows arrived")
    return min(arrival - at for arrival, at in arrivals)


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
    events: Sequence[dict[str, Any]],
    rows: Sequence[IntervalMetrics],
    arrivals: Sequence[tuple[float, float]],
    *,
    last_done: int,
) -> RestartTimings:
    """Reads the restarted job's parts out of its events, rows and the rows' arrival times
    (seconds after calling ``fit``); ``last_done`` as in :func:`elastic_timings`."""
    started = _first(events, "generation_started")
    restored = _first(events, "checkpoint_restored", after=started["at"])
    last_lost, beyond = _row(rows, last_done), _row(rows, last_done + 1)
    return RestartTimings(
        setup_s=clock_zero(arrivals),
        start_s=started["at"],
        load_s=restored["at"] - started["at"],
        redo_s=last_lost.at - restored["at"],
        step_s=beyond.at - last_lost.at,
        redone_steps=last_done - int(restored["saved_step"]),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measurement:
    """One size, shape and repeat: the three runs."""

    size: str
    shape: str
    repeat: int
    survivors: ElasticTimings  # the survivors alone (no growth)
    restart: RestartTimings
    growing: ElasticTimings  # the survivors while a new gang is placed, healed and joined

    @property
    def ratio(self) -> float:
        """How many times sooner the survivors resumed than the restarted job."""
        return self.restart.total_s / self.survivors.resume_s

    @property
    def ratio_growing(self) -> float:
        """The same, with a new gang placed at once."""
        return self.restart.total_s / self.growing.resume_s


def last_checkpoint_before(last_done: int, every: int) -> int:
    """The step of the last checkpoint saved every ``every`` steps, by step ``last_done``."""
    return (last_done // every) * every


# -- the runs ----------------------------------------------------------------------------------


def build_config(
    a: argparse.Namespace,
    size: ModelSize,
    shape: Shape,
    *,
    faults: bool,
    steps: int,
    grow: bool = False,
) -> TrainConfig:
    """The job every run recovers; ``faults`` adds the killed rank, ``grow`` the new gang.
    With ``--source parquet`` it reads the shape's Parquet data (:func:`parquet_dir`) by
    index."""
    data = DataConfig(batch_size=a.batch_size)
    if a.source == "parquet":
        data = DataConfig(
            batch_size=a.batch_size, source="parquet", path=str(parquet_dir(a, shape))
        )
    tables = tuple(
        TableConfig(
            name=f"t_cat_{i}",
            num_embeddings=size.rows,
            embedding_dim=size.dim,
            features=(f"cat_{i}",),
        )
        for i in range(size.tables)
    )
    kill = FaultSpec(kind=FaultKind.KILL_RANK, step=a.fail_step, rank=shape.world - 1)
    return TrainConfig(
        model=ModelConfig(tables=tables, dense_arch_layers=(64, size.dim)),
        scaling=ScalingConfig(
            num_workers=shape.world, gang_size=shape.gang_size, cpus_per_rank=a.cpus_per_rank
        ),
        sync=SyncConfig(sync_every=a.sync_every),
        data=data,
        elastic=ElasticConfig(
            min_gangs=1,
            max_gangs=shape.gangs,
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
        storage_path=str(a.storage_path),
        name=f"recovery-{size.tables}x{size.rows}x{size.dim}-{shape.gangs}x{shape.gang_size}",
    )


def _quiet(_row: IntervalMetrics) -> None:
    pass


def run_elastic(
    a: argparse.Namespace, size: ModelSize, shape: Shape, *, grow: bool
) -> tuple[ElasticTimings, str, str]:
    """An elastic run; returns its timings, the checkpoint before the failure and its run dir."""
    # Alone, the survivors need up to sync_every steps to replay the lost gang's batches.
    steps = a.fail_step + (a.steps_after if grow else 2 * a.sync_every + 1)
    config = build_config(a, size, shape, faults=True, steps=steps, grow=grow)
    result = fit(config, shutdown_ray=False, on_progress=_quiet)
    # Parquet: the survivors also train the lost gang's rows, in more steps than num_steps.
    short = result.steps < config.num_steps if a.source == "parquet" else None
    if (short if short is not None else result.steps != config.num_steps) or result.lost_batches:
        raise RuntimeError(
            f"elastic run ended at step {result.steps} of {config.num_steps} with "
            f"{result.lost_batches} lost batches: {result.events}"
        )
    timings = elastic_timings(
        result.events, result.history, last_done=a.fail_step - 1, full_gangs=shape.gangs
    )
    wanted = last_checkpoint_before(a.fail_step - 1, a.checkpoint_every)
    store = CheckpointStore(checkpoint_root(result.run_dir))
    ref = next((c for c in store.committed() if c.step == wanted), None)
    if ref is None:
        raise RuntimeError(f"no checkpoint of step {wanted} in {store.root}")
    return timings, ref.uri, result.run_dir


def parquet_dir(a: argparse.Namespace, shape: Shape) -> pathlib.Path:
    """Where the Parquet data of ``shape``'s jobs is (``--source parquet``)."""
    return a.storage_path / f"data-{shape.label}"


def write_parquet(a: argparse.Namespace, shape: Shape, vocab: int) -> None:
    """One epoch for the longest run of ``shape`` (every rank's batches of its steps), ids
    below ``vocab``; written once per invocation and read by every run of that shape."""
    from raytrec.data.generate import write_synthetic_parquet

    out = parquet_dir(a, shape)
    shutil.rmtree(out, ignore_errors=True)
    rows = (a.fail_step + a.steps_after) * shape.world * a.batch_size
    write_synthetic_parquet(
        out, rows=rows, files=8, row_groups_per_file=4, seed=a.seed, num_embeddings=vocab
    )


def run_restart(
    a: argparse.Namespace, size: ModelSize, shape: Shape, checkpoint: str
) -> tuple[RestartTimings, str]:
    """A fresh job of the original shape resumes from ``checkpoint`` and trains through the
    step the failure interrupted."""
    config = build_config(a, size, shape, faults=False, steps=a.fail_step)
    arrivals: list[tuple[float, float]] = []
    called = time.perf_counter()

    def arrived(row: IntervalMetrics) -> None:
        arrivals.append((time.perf_counter() - called, row.at))

    result = fit(config, shutdown_ray=False, on_progress=arrived, resume_from_checkpoint=checkpoint)
    timings = restart_timings(result.events, result.history, arrivals, last_done=a.fail_step - 1)
    return timings, result.run_dir


def measure(
    a: argparse.Namespace,
    sizes: Sequence[ModelSize],
    shapes: Sequence[Shape],
    say: Callable[[str], None],
    save: Callable[[list[Measurement], list[str]], None],
) -> tuple[list[Measurement], list[str]]:
    """Both ways of recovering for every size, shape and repeat; a run that fails is reported
    and the others go on."""
    out: list[Measurement] = []
    failures: list[str] = []
    if a.source == "parquet":
        for shape in shapes:
            write_parquet(a, shape, vocab=max(s.rows for s in sizes))
    for repeat in range(a.repeats):
        for size in sizes:
            for shape in shapes:
                where = f"repeat {repeat} | {size.label:<18} | {shape.label}"
                dirs: list[str] = []
                try:
                    survivors, checkpoint, run_dir = run_elastic(a, size, shape, grow=False)
                    dirs.append(run_dir)
                    restart, run_dir = run_restart(a, size, shape, checkpoint)
                    dirs.append(run_dir)
                    growing, _, run_dir = run_elastic(a, size, shape, grow=True)
                    dirs.append(run_dir)
                except Exception as e:  # reported, counted, and the next run goes on
                    failures.append(f"{where}: {type(e).__name__}: {str(e)[:300]}")
                    say(f"{where} | FAILED: {failures[-1]}")
                    continue
                finally:
                    if not a.keep_runs:
                        for d in dirs:
                            shutil.rmtree(d, ignore_errors=True)
                m = Measurement(
                    size=size.label,
                    shape=shape.label,
                    repeat=repeat,
                    survivors=survivors,
                    restart=restart,
                    growing=growing,
                )
                out.append(m)
                save(out, failures)
                say(
                    f"{where} | survivors resume {survivors.resume_s:6.2f} s (detection "
                    f"{survivors.detect_s:.2f}), {growing.resume_s:6.2f} s with a new gang | "
                    f"restart {restart.total_s:6.2f} s | {m.ratio:5.1f}x, {m.ratio_growing:5.1f}x "
                    f"| new gang joined {_fmt(growing.heal_join_s)} s"
                )
    return out, failures


# -- the report --------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def spread(values: Sequence[float | None], spec: str = ".2f") -> str:
    """Median, with (min to max) when there are several; ``-`` when none was observed."""
    xs = [x for x in values if x is not None]
    if not xs:
        return "-"
    mid = format(statistics.median(xs), spec)
    if len(xs) == 1:
        return mid
    return f"{mid} ({format(min(xs), spec)} to {format(max(xs), spec)})"


def _groups(
    ms: Sequence[Measurement], sizes: Sequence[ModelSize], shapes: Sequence[Shape]
) -> list[tuple[ModelSize, Shape, list[Measurement]]]:
    groups = [
        (s, g, [m for m in ms if m.size == s.label and m.shape == g.label])
        for s in sizes
        for g in shapes
    ]
    return [x for x in groups if x[2]]


def tables(ms: Sequence[Measurement], sizes: Sequence[ModelSize], shapes: Sequence[Shape]) -> str:
    groups = _groups(ms, sizes, shapes)
    lines = [
        "| model: tables x rows x dim | gangs x ranks | step | survivors resume "
        "| restart from checkpoint | restart / survivors | survivors resume, new gang placed "
        "at once | restart / survivors, new gang | new gang joined | first step with every gang |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s, g, mine in groups:
        lines.append(
            f"| {s.label} ({s.weight_mib:,.0f} MiB of weights) | {g.label} "
            f"| {spread([m.survivors.step_s for m in mine], '.3f')} s "
            f"| {spread([m.survivors.resume_s for m in mine])} s "
            f"| {spread([m.restart.total_s for m in mine])} s "
            f"| **{spread([m.ratio for m in mine], '.1f')}x** "
            f"| {spread([m.growing.resume_s for m in mine])} s "
            f"| **{spread([m.ratio_growing for m in mine], '.1f')}x** "
            f"| {spread([m.growing.heal_join_s for m in mine])} s "
            f"| {spread([m.growing.heal_step_s for m in mine])} s |"
        )
    lines += [
        "",
        "Survivors, from the failure (seconds):",
        "",
        "| model | gangs x ranks | run | detection | re-forming | rest, to the next step "
        "| survivors resume |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for s, g, mine in groups:
        for run, e in (
            ("alone", [m.survivors for m in mine]),
            ("new gang placed at once", [m.growing for m in mine]),
        ):
            lines.append(
                f"| {s.label} | {g.label} | {run} | {spread([x.detect_s for x in e])} "
                f"| {spread([x.reform_s for x in e])} "
                f"| {spread([x.resume_s - x.detect_s - x.reform_s for x in e])} "
                f"| {spread([x.resume_s for x in e])} |"
            )
    lines += [
        "",
        "The new gang, from its request (seconds):",
        "",
        "| model | gangs x ranks | start and build | sync and state broadcast | joined "
        "| first step with every gang | survivors' longest gap between steps |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s, g, mine in groups:
        e = [m.growing for m in mine]
        lines.append(
            f"| {s.label} | {g.label} | {spread([x.heal_start_s for x in e])} "
            f"| {spread([x.heal_transfer_s for x in e])} "
            f"| {spread([x.heal_join_s for x in e])} "
            f"| {spread([x.heal_step_s for x in e])} "
            f"| {spread([x.survivors_gap_s for x in e])} |"
        )
    lines += [
        "",
        "Restart from checkpoint (seconds from calling `fit`; detection and stopping counted "
        "as 0):",
        "",
        "| model | gangs x ranks | driver set-up | rank start and build | checkpoint load "
        "| redo lost steps | step S | total |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s, g, mine in groups:
        r = [m.restart for m in mine]
        redone = "/".join(str(n) for n in sorted({x.redone_steps for x in r}))
        lines.append(
            f"| {s.label} | {g.label} | {spread([x.setup_s for x in r])} "
            f"| {spread([x.start_s for x in r])} "
            f"| {spread([x.load_s for x in r])} "
            f"| {spread([x.redo_s for x in r])} ({redone} steps) "
            f"| {spread([x.step_s for x in r])} "
            f"| {spread([x.total_s for x in r])} |"
        )
    return "\n".join(lines)


def findings(
    ms: Sequence[Measurement],
    sizes: Sequence[ModelSize],
    shapes: Sequence[Shape],
    collective_timeout_s: float,
) -> str:
    """The verdict on the target and what dominates each way of recovering, from the medians."""
    lines = [f"**Target: survivors resume at least {TARGET_RATIO:g}x sooner.**", ""]
    for s, g, mine in _groups(ms, sizes, shapes):
        ratios = [m.ratio for m in mine]
        low = min(ratios)
        verdict = "met" if low >= TARGET_RATIO else "**not met**"
        resume = statistics.median(m.survivors.resume_s for m in mine)
        detect = statistics.median(m.survivors.detect_s for m in mine)
        parts = {
            "rank start and build": statistics.median(m.restart.start_s for m in mine),
            "driver set-up": statistics.median(m.restart.setup_s for m in mine),
            "checkpoint load": statistics.median(m.restart.load_s for m in mine),
            "redoing lost steps": statistics.median(m.restart.redo_s for m in mine),
        }
        biggest = max(parts, key=lambda k: parts[k])
        total = statistics.median(m.restart.total_s for m in mine)
        waited = (
            f"{detect:.2f} s of it detection: the dead rank's gang peers wait out "
            f"`collective_timeout_s={collective_timeout_s:g}` before the coordinator logs the "
            "death"
            if detect >= 0.8 * collective_timeout_s
            else f"{detect:.2f} s of it detection"
        )
        growing = statistics.median(m.growing.resume_s for m in mine)
        lines.append(
            f"- {s.label}, {g.label}: {statistics.median(ratios):.1f}x (lowest {low:.1f}x over "
            f"{len(ratios)} repeats), target {verdict}. Survivors resume after {resume:.2f} s, "
            f"{waited}. With a new gang placed at once they resume after {growing:.2f} s "
            f"({statistics.median(m.ratio_growing for m in mine):.1f}x). Restart from "
            f"checkpoint takes {total:.1f} s, most of it {biggest} ({parts[biggest]:.1f} s)."
        )
    return "\n".join([*lines, *limits(ms, sizes, shapes, collective_timeout_s)])


def limits(
    ms: Sequence[Measurement],
    sizes: Sequence[ModelSize],
    shapes: Sequence[Shape],
    collective_timeout_s: float,
) -> list[str]:
    """What holds the survivors back, where the measurements show it."""
    groups = _groups(ms, sizes, shapes)
    out: list[str] = []
    ganged = [
        t.detect_s
        for _, g, mine in groups
        if g.gang_size > 1
        for m in mine
        for t in (m.survivors, m.growing)
    ]
    waited = [d for d in ganged if d >= 0.8 * collective_timeout_s]
    quick = [
        t.detect_s
        for _, g, mine in groups
        if g.gang_size == 1
        for m in mine
        for t in (m.survivors, m.growing)
    ]
    if waited:
        shown = ", ".join(sorted({g.label for _, g, _ in groups if g.gang_size > 1}))
        out += [
            "",
            f"**Detection in gangs of more than one rank ({shown}).** In {len(waited)} of "
            f"{len(ganged)} such runs detection took `elastic.collective_timeout_s` "
            f"({collective_timeout_s:g} s here): the dead rank's gang peers stay blocked in a "
            "collective of their own gang after the peer's process exits, and the coordinator "
            "waits for every rank of the interval to answer or time out before it logs the "
            "death and re-forms"
            + (
                f" (in the other {len(ganged) - len(waited)} the peers' collective failed at "
                f"once: {', '.join(f'{d:.2f} s' for d in ganged if d not in waited)})"
                if len(waited) < len(ganged)
                else ""
            )
            + ". Single-rank gangs detected in a median "
            + (f"{statistics.median(quick):.2f} s." if quick else "(not measured)."),
        ]
    gaps = [
        (m.growing.survivors_gap_s, m.growing.heal_start_s, m.growing.heal_transfer_s)
        for _, _, mine in groups
        for m in mine
        if m.growing.survivors_gap_s is not None
        and m.growing.heal_start_s is not None
        and m.growing.heal_transfer_s is not None
    ]
    if gaps:
        gap = statistics.median(x[0] for x in gaps)
        start = statistics.median(x[1] for x in gaps)
        transfer = statistics.median(x[2] for x in gaps)
        out += [
            "",
            "**What a joining gang costs the survivors.** The new gang's actors start and "
            f"build in the background (median {start:.2f} s) while the survivors train; the "
            "survivors stop only for the join, a sync and the state broadcast (median "
            f"{transfer:.2f} s). Their longest gap between two steps while the new gang came in "
            f"was {gap:.2f} s (median), on a machine where the new gang's start competes with "
            "them for the same cores.",
        ]
    return out


def base_command(argv: Sequence[str]) -> str:
    kept: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        if token.split("=", 1)[0] == "--write":
            skip = "=" not in token
            continue
        kept.append(token)
    return shlex.join([".venv/bin/python", "benchmarks/recovery.py", *kept])


def describe(
    a: argparse.Namespace,
    argv: Sequence[str],
    minutes: float,
    load: tuple[float, float],
    failures: Sequence[str],
) -> str:
    c = last_checkpoint_before(a.fail_step - 1, a.checkpoint_every)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"Measured by `benchmarks/recovery.py` on {stamp} (whole run {minutes:.0f} minutes):",
        "",
        "```bash",
        f"{base_command(argv)} --write docs/fault_tolerance.md",
        "```",
        "",
        f"- Machine: {os.cpu_count()} CPU cores ({platform.machine()}), shared with other jobs "
        f"while it ran (1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the "
        "end); one embedded Ray cluster on 127.0.0.1 for every run; CPU ranks, gloo.",
        f"- Job: DLRM, table-wise sharding inside each gang, Adagrad (fused for the "
        f"embeddings), {a.batch_size} rows per rank per step, replica sync every "
        f"{a.sync_every} steps, dense gradients averaged every step, a checkpoint every "
        f"{a.checkpoint_every} steps, `collective_timeout_s={a.collective_timeout_s:g}`, one "
        "history row per step.",
        "- Data: "
        + (
            "synthetic batches made in the ranks (`data.source=synthetic`)."
            if a.source == "synthetic"
            else "Parquet files read by index (`--source parquet`: one epoch per shape, "
            f"{a.fail_step + a.steps_after} steps of every rank, written once), each rank "
            "its own Ray Data pipeline. After the loss the survivors re-share the rows left, "
            "which restarts their pipelines: the survivors' figures include that."
        ),
        f"- Failure: the last gang's last rank exits as it starts step {a.fail_step} "
        f"(`kill_rank@{a.fail_step}`). The elastic job goes on with the other gangs and grows "
        f"back; the restarted job resumes from the checkpoint of step {c}, redoes steps "
        f"{c + 1}..{a.fail_step - 1} ({a.fail_step - 1 - c} steps; a failure at a random time "
        f"loses {a.checkpoint_every / 2:g} on average) and trains step {a.fail_step}.",
        f"- {a.repeats} repeats, both ways of recovering in each: median (min to max); the ratio "
        "is paired per repeat. Every figure starts at the failure. The survivors' include "
        "detecting it; restart from checkpoint counts 0 s for detection, stopping the old "
        "workers and the Ray cluster (which stays up), so its figures are lower bounds. The "
        "module docstring of `benchmarks/recovery.py` says exactly what each column counts.",
    ]
    if failures:
        lines.append(f"- {len(failures)} run(s) failed and are not in the tables:")
        lines += [f"  - {f}" for f in failures]
    return "\n".join(lines)


def write_into(path: pathlib.Path, block: str, *, source: str = "synthetic") -> None:
    """Replaces the benchmark's block (of ``source``'s runs) in ``path``, or appends it as a new
    last section."""
    if source == "parquet":
        replace_block(path, block, begin=PARQUET_BEGIN, end=PARQUET_END, heading=PARQUET_HEADING)
    else:
        replace_block(path, block, begin=BEGIN, end=END, heading=HEADING)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="26x10000x16,26x100000x32", help="TABLESxROWSxDIM,...")
    p.add_argument("--shapes", default="2x2,3x1", help="GANGSxRANKS,... (at least 2 gangs)")
    p.add_argument("--batch-size", type=int, default=256, help="rows per rank per step")
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--fail-step", type=int, default=16, help="the rank dies starting this step")
    p.add_argument(
        "--steps-after",
        type=int,
        default=400,
        help="run 3: steps from the failure on (room for the new gang, built in the background "
        "while the survivors train, to join)",
    )
    p.add_argument(
        "--source",
        choices=("synthetic", "parquet"),
        default="synthetic",
        help="the jobs' data: generated in the ranks, or Parquet files read by index (written "
        "once per shape under --storage-path)",
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpus-per-rank", type=float, default=0.5)
    p.add_argument("--collective-timeout-s", type=float, default=10.0)
    p.add_argument("--step-timeout-s", type=float, default=120.0)
    p.add_argument("--storage-path", type=pathlib.Path, default=ROOT / "runs" / "recovery")
    p.add_argument("--keep-runs", action="store_true", help="keep the jobs' run directories")
    p.add_argument("--write", type=pathlib.Path, help="write the results section into this file")
    a = p.parse_args(argv)
    c = last_checkpoint_before(a.fail_step - 1, a.checkpoint_every)
    if c < 1 or c == a.fail_step - 1:
        p.error(
            f"--fail-step={a.fail_step} must come at least two steps after a checkpoint "
            f"(--checkpoint-every={a.checkpoint_every}), so that completed steps are lost"
        )
    if a.steps_after < 2 * a.sync_every + 1:
        p.error(
            f"--steps-after={a.steps_after} must be at least 2 x --sync-every + 1: room to "
            "resume, replay the lost gang's batches, heal and step with every gang"
        )
    return a


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    sizes = [ModelSize.parse(x) for x in a.sizes.split(",")]
    shapes = [Shape.parse(x) for x in a.shapes.split(",")]
    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    most = max((g.gangs + 1) * g.gang_size for g in shapes)  # room for the new gang
    connect(num_cpus=most * a.cpus_per_rank + (os.cpu_count() or 2))
    a.storage_path.mkdir(parents=True, exist_ok=True)
    raw = a.storage_path / f"results-{time.strftime('%Y%m%d-%H%M%S')}.json"

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def save(ms: list[Measurement], failures: list[str]) -> None:
        record = {
            "argv": argv,
            "measurements": [dataclasses.asdict(m) for m in ms],
            "failures": failures,
        }
        raw.write_text(json.dumps(record, indent=1))

    ms, failures = measure(a, sizes, shapes, say, save)
    save(ms, failures)
    if not ms:
        say(f"every run failed: {failures}")
        return 1
    minutes = (time.perf_counter() - started) / 60
    block = "\n\n".join(
        [
            describe(a, argv, minutes, (load_start, os.getloadavg()[0]), failures),
            tables(ms, sizes, shapes),
            findings(ms, sizes, shapes, a.collective_timeout_s),
        ]
    )
    print(block)
    say(f"raw measurements: {raw}")
    if a.write is not None:
        write_into(a.write, block, source=a.source)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
