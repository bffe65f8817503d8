"""Recovery time after a lost rank: elastic survivors against restart from a checkpoint.

    .venv/bin/python -m benchmarks.recovery [--write docs/fault_tolerance.md]
    .venv/bin/python -m benchmarks.recovery --stall-only

Per size, shape and repeat: the survivors alone, a restart from the checkpoint before the
failure, and the survivors while a new gang joins (``--stall-only``: the first and the last, the
survivors' stalls). What each column counts: docs/fault_tolerance.md, "Recovery time".
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import operator
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from typing import TypeVar

from benchmarks.common import ROOT, dims_list, dlrm, md_table, parse, parser, publish, spread
from raytrec import fit
from raytrec.checkpoint.config import CheckpointConfig, checkpoint_root
from raytrec.checkpoint.layout import CheckpointStore
from raytrec.cluster import connect
from raytrec.config import DataConfig, ScalingConfig, SyncConfig, TestingConfig, TrainConfig
from raytrec.elastic import events as ev
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.faults import FaultKind, FaultSpec
from raytrec.observability.metrics import IntervalMetrics

E = TypeVar("E", bound=ev.Event)

HEADING = "## Recovery time: survivors against restart from checkpoint"
FAIL_STEP, CHECKPOINT_EVERY, SYNC_EVERY = 16, 10, 4
STEPS_AFTER = 400  # run 3: room for the new gang to join
COLLECTIVE_TIMEOUT_S, CPUS_PER_RANK, BATCH_SIZE = 10.0, 0.5, 256  # rows per rank per step
STORAGE = ROOT / "runs" / "recovery"


def label(dims: Sequence[int]) -> str:
    return " x ".join(f"{d:,}" for d in dims)


def _first(events: Sequence[ev.Event], kind: type[E], *, after: float = -1.0) -> E:
    if found := [e for e in events if isinstance(e, kind) and e.at >= after]:
        return found[0]
    raise ValueError(f"no {kind.kind!r} event at or after t={after:g}: {[e.kind for e in events]}")


def _row(rows: Sequence[IntervalMetrics], step: int) -> IntervalMetrics:
    if found := [r for r in rows if r.step == step]:
        return found[0]
    raise ValueError(f"no history row for step {step}: rows {[r.step for r in rows]}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElasticTimings:
    """The elastic run's recovery, in seconds from the failure (the row of ``last_done``)."""

    step_s: float  # one step before the failure (median of steps 2.., the first starts data)
    resume_s: float  # -> the survivors' next completed step
    # None where no new gang joined within the run:
    heal_start_s: float | None = None  # gang_requested -> gang_placed (placement, actors, build)
    heal_transfer_s: float | None = None  # gang_placed -> gang_joined (sync, generation, broadcast)
    heal_join_s: float | None = None  # gang_requested -> gang_joined
    heal_step_s: float | None = None  # gang_requested -> first completed step with every gang
    survivors_gap_s: float | None = None  # last step before the join -> first with every gang


def elastic_timings(
    events: Sequence[ev.Event], rows: Sequence[IntervalMetrics], *, last_done: int, full_gangs: int
) -> ElasticTimings:
    """The recovery and heal of one elastic run; ``last_done``: the last step before the failure."""
    failed = _row(rows, last_done)
    died = _first(events, ev.RankDied, after=failed.at)
    resumed = next((r for r in rows if r.at > died.at), None)
    if resumed is None:
        raise ValueError(f"no completed step after the rank died at t={died.at:g}")
    timings = ElasticTimings(
        step_s=statistics.median(r.seconds / r.steps for r in rows if 2 <= r.step <= last_done),
        resume_s=resumed.at - failed.at,
    )
    try:
        requested = _first(events, ev.GangRequested, after=died.at)
        placed = _first(events, ev.GangPlaced, after=requested.at)
        joined = _first(events, ev.GangJoined, after=placed.at)
    except ValueError:
        return timings  # no new gang joined within the run: reported as not observed
    full = next((r for r in rows if r.at > joined.at and r.gangs == full_gangs), None)
    before = [r for r in rows if r.at < joined.at]  # at least the failure's row
    return dataclasses.replace(
        timings, heal_start_s=placed.at - requested.at, heal_transfer_s=joined.at - placed.at,
        heal_join_s=joined.at - requested.at,
        heal_step_s=None if full is None else full.at - requested.at,
        survivors_gap_s=None if full is None else full.at - before[-1].at,
    )  # fmt: skip


def restart_seconds(
    events: Sequence[ev.Event], rows: Sequence[IntervalMetrics],
    arrivals: Sequence[tuple[float, float]], *, last_done: int,
) -> float:  # fmt: skip
    """Seconds from calling ``fit`` to the restarted job's row of step ``last_done + 1``, from
    its rows' (arrival time on the driver's clock, in seconds after calling ``fit``; ``at``).
    The coordinator clock's zero on the driver's clock is the smallest arrival - ``at`` (a row
    arrives no sooner than it is made): an upper bound by its polling."""
    _first(events, ev.CheckpointRestored)  # it did resume from the checkpoint
    return min(arrival - at for arrival, at in arrivals) + _row(rows, last_done + 1).at


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One size, shape and repeat: the three runs."""

    size: str
    shape: str
    repeat: int
    survivors: ElasticTimings  # the survivors alone (no growth)
    restart_s: float
    growing: ElasticTimings  # the survivors while a new gang is placed, healed and joined

    @property
    def ratio(self) -> float:  # how many times sooner the survivors resumed than the restart
        return self.restart_s / self.survivors.resume_s

    @property
    def ratio_growing(self) -> float:  # the same, with a new gang placed at once
        return self.restart_s / self.growing.resume_s


def last_checkpoint_before(last_done: int, every: int) -> int:
    """The step of the last checkpoint saved every ``every`` steps, by step ``last_done``."""
    return (last_done // every) * every


Dims = tuple[int, ...]


def build_config(
    size: Dims, shape: Dims, *, faults: bool, steps: int, grow: bool = False
) -> TrainConfig:
    """The job every run recovers; ``faults`` adds the killed rank, ``grow`` the new gang."""
    gangs, ranks = shape
    kill = FaultSpec(kind=FaultKind.KILL_RANK, step=FAIL_STEP, rank=gangs * ranks - 1)
    return TrainConfig(
        model=dlrm(*size), sync=SyncConfig(sync_every=SYNC_EVERY), scaling=ScalingConfig(
            num_workers=gangs * ranks, gang_size=ranks, cpus_per_rank=CPUS_PER_RANK
        ),
        data=DataConfig(batch_size=BATCH_SIZE), num_steps=steps, log_every=1,
        elastic=ElasticConfig(
            min_gangs=1, max_gangs=gangs, grow=grow, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
            step_timeout_s=120.0, poll_s=0.2,
        ),
        checkpoint=CheckpointConfig(every_n_steps=CHECKPOINT_EVERY, num_to_keep=None),
        testing=TestingConfig(faults=(kill,) if faults else ()),
        storage_path=str(STORAGE / "jobs"), name="recovery",
    )  # fmt: skip


def run_elastic(size: Dims, shape: Dims, *, grow: bool) -> tuple[ElasticTimings, str]:
    """An elastic run; returns its timings and the checkpoint before the failure."""
    # Alone, the survivors need up to sync_every steps to replay the lost gang's batches.
    steps = FAIL_STEP + (STEPS_AFTER if grow else 2 * SYNC_EVERY + 1)
    config = build_config(size, shape, faults=True, steps=steps, grow=grow)
    result = fit(config, shutdown_ray=False, on_progress=lambda _row: None)
    if result.steps != steps or result.lost_batches:
        raise RuntimeError(
            f"elastic run ended at step {result.steps} of {config.num_steps} with "
            f"{result.lost_batches} lost batches: {result.events}"
        )
    done = FAIL_STEP - 1
    timings = elastic_timings(result.events, result.history, last_done=done, full_gangs=shape[0])
    wanted = last_checkpoint_before(FAIL_STEP - 1, CHECKPOINT_EVERY)
    store = CheckpointStore(checkpoint_root(result.run_dir))
    ref = next((c for c in store.committed() if c.step == wanted), None)
    if ref is None:
        raise RuntimeError(f"no checkpoint of step {wanted} in {store.root}")
    return timings, ref.uri


def run_restart(size: Dims, shape: Dims, checkpoint: str) -> float:
    """A fresh job of the original shape resumes from ``checkpoint`` and trains through step S."""
    config = build_config(size, shape, faults=False, steps=FAIL_STEP)
    arrivals: list[tuple[float, float]] = []
    called = time.perf_counter()

    def arrived(row: IntervalMetrics) -> None:
        arrivals.append((time.perf_counter() - called, row.at))

    result = fit(config, shutdown_ray=False, on_progress=arrived, resume_from_checkpoint=checkpoint)
    return restart_seconds(result.events, result.history, arrivals, last_done=FAIL_STEP - 1)


def measure(a: argparse.Namespace) -> tuple[list[Measurement], list[str]]:
    """Every size, shape and repeat, both ways; a failed run is reported and the others go on."""
    out: list[Measurement] = []
    failures: list[str] = []
    for repeat, size, shape in itertools.product(range(a.repeats), a.sizes, a.shapes):
        where = f"repeat {repeat} | {label(size)} | {label(shape)}"
        try:
            survivors, checkpoint = run_elastic(size, shape, grow=False)
            restart = run_restart(size, shape, checkpoint)
            growing, _ = run_elastic(size, shape, grow=True)
            m = Measurement(label(size), label(shape), repeat, survivors, restart, growing)
            out.append(m)
            took = f"survivors {survivors.resume_s:.2f} s, restart {restart:.2f} s"
            print(f"{where} | {took}: {m.ratio:.1f}x", file=sys.stderr, flush=True)
        except Exception as e:  # reported, counted, and the next run goes on
            failures.append(f"{where}: {type(e).__name__}: {str(e)[:300]}")
            print(f"FAILED: {failures[-1]}", file=sys.stderr, flush=True)
        finally:  # the three jobs' run directories
            shutil.rmtree(STORAGE / "jobs", ignore_errors=True)
    return out, failures


#: The table's columns: (heading, attribute of a Measurement, format).
COLUMNS = (
    ("step", "survivors.step_s", ".3f"),
    ("survivors resume", "survivors.resume_s", ".2f"),
    ("restart from checkpoint", "restart_s", ".2f"),
    ("restart / survivors", "ratio", ".1f"),
    ("survivors resume, new gang placed at once", "growing.resume_s", ".2f"),
    ("restart / survivors, new gang", "ratio_growing", ".1f"),
    ("new gang joined", "growing.heal_join_s", ".2f"),
    ("first step with every gang", "growing.heal_step_s", ".2f"),
)


def table(ms: Sequence[Measurement], a: argparse.Namespace) -> str:
    """Seconds from the failure per size and shape, median (min to max), and what a join costs."""
    rows = []
    for s, g in itertools.product(a.sizes, a.shapes):
        if mine := [m for m in ms if (m.size, m.shape) == (label(s), label(g))]:
            get = [(operator.attrgetter(path), spec) for _, path, spec in COLUMNS]
            mib = s[0] * s[1] * s[2] * 4 / 2**20
            rows.append([f"{label(s)} ({mib:,.0f} MiB of weights)", label(g)])
            rows[-1] += [spread([value(m) for m in mine], spec) for value, spec in get]
    heads = " | ".join(["model: tables x rows x dim", "gangs x ranks", *(c[0] for c in COLUMNS)])

    def median(name: str) -> str:
        xs = [x for m in ms if (x := getattr(m.growing, name)) is not None]
        return f"{statistics.median(xs):.2f} s" if xs else "-"

    return md_table(heads, rows, left=2) + (
        "\n\n**What a joining gang costs the survivors.** The new gang's actors start and build in "
        f"the background (median {median('heal_start_s')}) while the survivors train; the "
        "survivors stop only for the join, a sync and the state broadcast (median "
        f"{median('heal_transfer_s')}). Their longest gap between two steps while the new gang "
        f"came in was {median('survivors_gap_s')} (median), on a machine where the new gang's "
        "start competes with them for the same cores."
    )


def stall_only(a: argparse.Namespace) -> int:
    """``--stall-only`` (module doc): runs 1 and 3 for the first size and shape, printed."""
    loss: list[float | None] = []
    join: list[float | None] = []
    gap: list[float | None] = []
    for repeat, grow in itertools.product(range(a.repeats), (False, True)):
        try:
            t, _ = run_elastic(a.sizes[0], a.shapes[0], grow=grow)
        except Exception as e:  # a failed run is reported; the others go on
            print(f"repeat {repeat}, grow={grow}: failed: {e}"[:300], file=sys.stderr, flush=True)
            continue
        loss.append(t.resume_s)
        join.append(t.heal_transfer_s)
        gap.append(t.survivors_gap_s)
        print(f"repeat {repeat}, grow={grow}: {t}", file=sys.stderr, flush=True)
    heads = "survivors' stall at a loss | at a join | longest gap while a gang joins"
    print(md_table(heads, [[spread(x, ".3f", " s") for x in (loss, join, gap)]], left=0))
    return 0 if loss else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "recovery", "docs/fault_tolerance.md")
    p.add_argument("--sizes", type=dims_list(3), default="26x10000x16,26x100000x32")
    p.add_argument("--shapes", type=dims_list(2), default="2x2,3x1", help="at least 2 gangs")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--stall-only", action="store_true", help="the survivors' stall alone")
    a = parse(p, argv)
    if min(gangs for gangs, _ in a.shapes) < 2:
        p.error("--shapes: at least 2 gangs, so that one survives")
    load_start = os.getloadavg()[0]
    most = max((g[0] + 1) * g[1] for g in a.shapes)  # room for the new gang
    connect(num_cpus=most * CPUS_PER_RANK + (os.cpu_count() or 2))
    STORAGE.mkdir(parents=True, exist_ok=True)
    if a.stall_only:
        return stall_only(a)
    ms, failures = measure(a)
    if not ms:
        return 1
    c = last_checkpoint_before(FAIL_STEP - 1, CHECKPOINT_EVERY)  # 10
    setup = (
        f"- {a.repeats} repeats, median (min to max); synthetic data; `kill_rank@{FAIL_STEP}` "
        f"(the last gang's last rank), a checkpoint every {CHECKPOINT_EVERY} steps, so the "
        f"restart redoes steps {c + 1}..{FAIL_STEP - 1}; {BATCH_SIZE} rows per rank per "
        f"step, `collective_timeout_s={COLLECTIVE_TIMEOUT_S:g}`; 1-minute load average "
        f"{load_start:.1f} at the start."
        + "".join(f"\n- failed, not in the table: {f}" for f in failures)
    )
    publish(a, f"{setup}\n\n{table(ms, a)}", name="recovery", heading=HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
