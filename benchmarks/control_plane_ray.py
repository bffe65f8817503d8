"""How the control plane's cost grows with the number of gangs, on a local Ray cluster.

    .venv/bin/python -m benchmarks.control_plane_ray [--gangs 2,4,8,16] [--write docs/benchmarks.md]

Per number of gangs G (one rank each, a tiny model, synthetic data): one elastic job whose last
rank dies at a step, and whose replacement gang is placed, healed and joined while the survivors
train on; the job stops a few intervals after the join. What each column counts:
docs/benchmarks.md, "Control plane on Ray".
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import statistics
import sys
import threading
from collections.abc import Sequence

from benchmarks.common import ROOT, dlrm, md_table, parse, parser, publish
from benchmarks.recovery import elastic_timings
from raytrec import fit
from raytrec.cluster import connect
from raytrec.config import DataConfig, ScalingConfig, SyncConfig, TestingConfig, TrainConfig
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.drain_policy import request_stop
from raytrec.elastic.faults import FaultKind, FaultSpec
from raytrec.observability.metrics import IntervalMetrics
from raytrec.result import Result, TrainingStopped

FAIL_STEP, SYNC_EVERY, BATCH_SIZE = 24, 4, 64
MAX_STEPS = 4000  # an upper bound: the job is stopped a few intervals after the join
AFTER_JOIN = 4  # intervals with every gang back before the stop is asked for
CPUS_PER_RANK = 0.25  # logical: 16 ranks share the machine's cores
STORAGE = ROOT / "runs" / "control_plane_ray"
HEADING = "## Control plane on Ray"


def steady_share(rows: Sequence[IntervalMetrics], *, first: int, last: int) -> tuple[float, float]:
    """(the coordinator's share of the loop's wall-clock time, the share of the intervals' time
    the ranks sat idle waiting for the coordinator) over the rows of steps ``first..last``:
    ratios of sums, so a long interval weighs as much as its length."""
    mine = [r for r in rows if first <= r.step <= last]
    loop = sum(r.loop_s or 0.0 for r in mine)
    wall = sum(r.seconds for r in mine)
    if not mine or loop <= 0 or wall <= 0:
        raise ValueError(f"no timed rows in steps {first}..{last}: {[r.step for r in rows]}")
    busy = sum(r.coordinator_s or 0.0 for r in mine)
    idle = sum(r.idle_s or 0.0 for r in mine)
    return busy / loop, idle / wall


def boundary_rows(
    rows: Sequence[IntervalMetrics], gangs: int
) -> tuple[IntervalMetrics, IntervalMetrics | None]:
    """The first row with fewer than ``gangs`` gangs (its interval holds the recovery from the
    loss), and the first row with all ``gangs`` after it (the join's), None if none came."""
    loss = next((i for i, r in enumerate(rows) if r.gangs < gangs), None)
    if loss is None:
        raise ValueError(f"no row with fewer than {gangs} gangs: no loss")
    join = next((r for r in rows[loss:] if r.gangs == gangs), None)
    return rows[loss], join


@dataclasses.dataclass(frozen=True)
class Measurement:
    gangs: int
    step_s: float  # median interval (one step) before the failure
    coordinator_ms: str  # the coordinator's own work per interval, median, same rows
    coordinator_cpu_ms: str  # its loop thread's CPU time per interval, median, same rows
    coordinator_share: float  # steady state, before the failure
    idle_share: float  # the ranks' wait for the coordinator, same rows
    loss_stall_s: float  # last step before the failure -> the survivors' next completed step
    join_stall_s: float | None  # gang_placed -> gang_joined: the survivors stop for it
    join_gap_s: float | None  # the survivors' longest gap between two steps around the join
    # The coordinator loop thread's CPU in the interval that re-formed after the loss, and in
    # the one the new gang joined at (ms):
    loss_cpu_ms: str
    join_cpu_ms: str
    peak_gib: float  # every process of the job (driver, Ray, coordinator, ranks)
    load: tuple[float, float]  # 1-minute load average at the start and the end of the run


class PeakMemory:
    """Samples the memory of this process and every process under it (Ray's and the actors')
    in the background; ``peak``: the largest sum seen, in GiB. Each process counts its
    proportional set size (PSS: pages shared with others, such as torch's libraries, are split
    among them), so the sum is what the job holds of the machine's memory."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)

    def _run(self, every_s: float) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(every_s):
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_full_info().pss
                except psutil.Error:
                    continue  # it ended while we looked
            self.peak = max(self.peak, total / 2**30)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()


class StopAfterJoin:
    """An ``on_progress`` callback that asks the job in ``storage`` to stop once ``gangs`` gangs
    have trained ``after`` intervals after a row with fewer (the lost gang replaced)."""

    def __init__(self, storage: str, gangs: int, after: int = AFTER_JOIN) -> None:
        self.storage, self.gangs, self.after = storage, gangs, after
        self.shrank, self.full_after, self.asked = False, 0, False

    def __call__(self, row: IntervalMetrics) -> None:
        self.shrank = self.shrank or row.gangs < self.gangs
        if self.shrank and row.gangs == self.gangs:
            self.full_after += 1
        if self.full_after >= self.after and not self.asked:
            (run_dir,) = glob.glob(os.path.join(self.storage, "scale-*"))
            request_stop(run_dir)
            self.asked = True


def build_config(gangs: int, storage: str) -> TrainConfig:
    kill = FaultSpec(kind=FaultKind.KILL_RANK, step=FAIL_STEP, rank=gangs - 1)
    return TrainConfig(
        model=dlrm(4, 1000, 8, width=16), sync=SyncConfig(sync_every=SYNC_EVERY),
        scaling=ScalingConfig(num_workers=gangs, gang_size=1, cpus_per_rank=CPUS_PER_RANK),
        data=DataConfig(batch_size=BATCH_SIZE), num_steps=MAX_STEPS, log_every=1,
        elastic=ElasticConfig(
            min_gangs=1, max_gangs=gangs, grow=True, collective_timeout_s=10.0,
            step_timeout_s=600.0, poll_s=0.2,
        ),
        testing=TestingConfig(faults=(kill,)), storage_path=storage, name="scale",
    )  # fmt: skip


def run_one(gangs: int) -> Measurement:
    storage = str(STORAGE / f"g{gangs}")
    shutil.rmtree(storage, ignore_errors=True)
    load0 = os.getloadavg()[0]
    watcher = StopAfterJoin(storage, gangs)
    with PeakMemory() as memory:
        try:
            config = build_config(gangs, storage)
            result: Result = fit(config, shutdown_ray=False, on_progress=watcher)
        except TrainingStopped as e:  # the stop asked for after the join
            result = e.result
    if result.lost_batches:
        raise RuntimeError(f"{gangs} gangs: {result.lost_batches} lost batches: {result.events}")
    rows, last_done = result.history, FAIL_STEP - 1
    t = elastic_timings(result.events, rows, last_done=last_done, full_gangs=gangs)
    busy, idle = steady_share(rows, first=3, last=last_done)
    steady = [r for r in rows if 3 <= r.step <= last_done]
    loss, join = boundary_rows(rows, gangs)
    return Measurement(
        gangs=gangs,
        step_s=statistics.median(r.seconds for r in steady),
        coordinator_ms=ms([r.coordinator_s for r in steady]),
        coordinator_cpu_ms=ms([r.coordinator_cpu_s for r in steady]),
        coordinator_share=busy, idle_share=idle, loss_stall_s=t.resume_s,
        join_stall_s=t.heal_transfer_s, join_gap_s=t.survivors_gap_s,
        loss_cpu_ms=ms([loss.coordinator_cpu_s]),
        join_cpu_ms=ms([None if join is None else join.coordinator_cpu_s]),
        peak_gib=memory.peak, load=(load0, os.getloadavg()[0]),
    )  # fmt: skip


def ms(values: Sequence[float | None]) -> str:
    xs = [x for x in values if x is not None]
    return f"{1e3 * statistics.median(xs):.1f}" if xs else "-"


def seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(ms_: Sequence[Measurement]) -> str:
    heads = (
        "gangs x ranks | interval (ms) | coordinator per interval, wall / CPU (ms) | "
        "coordinator share | ranks idle for it | stall at a loss (s) | stall at a join (s) | "
        "longest gap at the join (s) | coordinator CPU at the loss / at the join (ms) | "
        "peak memory | load average, start / end"
    )
    rows = [
        [
            f"{m.gangs} x 1", f"{1e3 * m.step_s:.0f}",
            f"{m.coordinator_ms} / {m.coordinator_cpu_ms}", f"{m.coordinator_share:.0%}",
            f"{m.idle_share:.0%}", seconds(m.loss_stall_s),
            seconds(m.join_stall_s), seconds(m.join_gap_s), f"{m.loss_cpu_ms} / {m.join_cpu_ms}",
            f"{m.peak_gib:.1f} GiB",
            f"{m.load[0]:.1f} / {m.load[1]:.1f}",
        ]
        for m in ms_
    ]  # fmt: skip
    out = md_table(heads, rows)
    if len(ms_) >= 2:
        a, b = ms_[0], ms_[-1]
        out += f"\n\nFrom {a.gangs} to {b.gangs} gangs ({b.gangs / a.gangs:g}x): "
        if a.coordinator_cpu_ms != "-" and b.coordinator_cpu_ms != "-":
            grew = float(b.coordinator_cpu_ms) / float(a.coordinator_cpu_ms)
            out += f"the coordinator's CPU per interval grew {grew:.1f}x, "
        out += f"the stall at a loss {b.loss_stall_s / a.loss_stall_s:.1f}x"
        if a.join_stall_s and b.join_stall_s:
            out += f", at a join {b.join_stall_s / a.join_stall_s:.1f}x"
        out += "."
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "control_plane_ray", "docs/benchmarks.md")
    p.add_argument(
        "--gangs", type=lambda s: [int(x) for x in s.split(",")], default="2,4,8,16",
        help="numbers of gangs (one rank each), at least 2",
    )  # fmt: skip
    a = parse(p, argv)
    if min(a.gangs) < 2:
        p.error("--gangs: at least 2, so that one survives the loss")
    connect(num_cpus=(max(a.gangs) + 1) * CPUS_PER_RANK + 2)
    out: list[Measurement] = []
    for g in a.gangs:
        try:
            out.append(m := run_one(g))
            print(m, file=sys.stderr, flush=True)
        except Exception as e:  # reported; the other sizes go on
            print(f"FAILED at {g} gangs: {type(e).__name__}: {e}"[:500], file=sys.stderr)
    if not out:
        return 1
    publish(a, table(out), name="control-plane-ray", heading=HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
