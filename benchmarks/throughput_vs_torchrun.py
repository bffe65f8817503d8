"""Training throughput: raytrec ``fit()`` against plain TorchRec DMP under ``torchrun``.

    ./dev.sh bench throughput_vs_torchrun [--world-size T] [--steps N] [--batch-size B] ...

Measures rows trained per wall-clock second of the step loop, warmup excluded, for

* **torchrun + DMP**: ``torchrun --standalone --nproc-per-node T benchmarks/_torchrun_dmp.py``,
  TorchRec's ``DistributedModelParallel`` over all T ranks (DDP for the dense part, no
  replica plane): the normal TorchRec setup. Timed inside the workers, between barriers.
* **raytrec 1 x T**: ``raytrec.fit`` with one gang of T ranks, the same shape as the baseline
  (the replica plane has one member, so it adds no collective): the apples-to-apples case.
* **same worker in Ray actors** (``--dmp-in-ray``): the baseline's worker code, unchanged, in T
  Ray actors shaped like raytrec's rank actors: what hosting a rank in a Ray worker process
  costs, with none of raytrec's code in the step.
* **raytrec G x L**: 2D, G gangs of L ranks (2 x 1 for T=2, 2 x 2 for T=4), dense gradients
  also averaged over the replica group every step, embeddings synced every ``--sync-every``.

Both sides build the same :class:`~raytrec.config.TrainConfig` (``_torchrun_dmp.build_config``),
the same DLRM (``build_dlrm`` + the fused embedding optimizer), a plan from ``make_plan``, the
same per-rank batch size and the same :class:`~raytrec.data.synthetic.SyntheticCriteo` shards,
with one torch thread per rank. raytrec's throughput comes from its metrics history: the
coordinator's wall-clock time from the start of the first interval after warmup to the end of
the last one (rows = steps x T x batch size), so per-interval RPC round trips count against it.

Each repeat runs the baseline (no Ray cluster up) and, on a local Ray cluster on 127.0.0.1
started for them and stopped after, the raytrec layouts. Even repeats run the baseline first
and odd ones last, the layouts in mirrored order, so a machine that drifts faster or slower
over minutes favours neither side. The machine may be shared, so a
:class:`CpuMonitor` follows how much CPU processes outside the benchmark (and the hypervisor,
as steal) take: every run waits for a quiet machine first and is run again when others took
more than ``--max-foreign-cpu`` meanwhile. The summary table (medians over repeats and the
raytrec / torchrun ratio) is printed and written to ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import platform
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _docs import replace_section
from _torchrun_dmp import add_model_args, add_rank_niceness_arg, build_config, model_argv

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "_torchrun_dmp.py"
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Throughput: raytrec vs torchrun + DistributedModelParallel"
GPU_SECTION = "## Throughput on GPU: raytrec vs torchrun + DistributedModelParallel"
BASELINE = "torchrun + DMP"
IN_RAY = "same worker in Ray actors"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GangShape:
    """A raytrec job shape: ``gangs`` model copies of ``gang_size`` ranks each."""

    gangs: int
    gang_size: int

    @property
    def label(self) -> str:
        return f"raytrec {self.gangs}x{self.gang_size}"

    @classmethod
    def parse(cls, text: str) -> GangShape:
        g, _, l_ = text.lower().partition("x")
        try:
            return cls(gangs=int(g), gang_size=int(l_))
        except ValueError:
            raise argparse.ArgumentTypeError(f"layout {text!r} is not GxL, e.g. 2x1") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measurement:
    """One timed run of one configuration."""

    label: str
    repeat: int
    rows: int
    seconds: float
    extra: dict[str, Any]

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds

    @property
    def interval_rows_per_s(self) -> float:
        """Median over the timed ``log_every``-step intervals: robust to short bursts of load."""
        per = self.rows / len(self.extra["interval_seconds"])
        return statistics.median(per / s for s in self.extra["interval_seconds"])

    def line(self) -> str:
        control = self.extra.get("control_fraction")
        return (
            f"  {self.label:<16} {self.rows_per_s:>8,.0f} rows/s (median interval "
            f"{self.interval_rows_per_s:>6,.0f}; other processes took "
            f"{self.extra['foreign_cpu']:.0%} of the CPU, hypervisor steal "
            f"{self.extra['steal_cpu']:.0%}"
            + (
                ""
                if control is None
                else f"; ranks idle between intervals {control:.2%} of the time"
            )
            + ")"
        )


# -- command line ----------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="throughput_vs_torchrun.py",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--world-size", type=int, default=2, help="T: ranks on both sides")
    p.add_argument("--steps", type=int, default=400, help="steps per run, warmup included")
    p.add_argument("--warmup-steps", type=int, default=50, help="steps excluded from timing")
    p.add_argument(
        "--log-every",
        type=int,
        default=25,
        help="raytrec's metrics interval (steps); must divide --warmup-steps",
    )
    p.add_argument("--sync-every", type=int, default=4, help="raytrec's embedding sync period")
    p.add_argument(
        "--layouts",
        type=GangShape.parse,
        nargs="+",
        default=None,
        help="raytrec shapes GxL with G*L == T (default: 1xT, and 2x(T/2) when T is even)",
    )
    add_rank_niceness_arg(p)
    p.add_argument(
        "--dmp-in-ray",
        action="store_true",
        help="also run the baseline's worker code, unchanged, in T Ray actors (CPU only): "
        "what hosting a rank in a Ray worker process costs, with no raytrec code in the step",
    )
    p.add_argument(
        "--read-ahead",
        choices=["auto", "background", "inline"],
        default="auto",
        help="raytrec's data.read_ahead (where a rank makes its batches)",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs of every configuration")
    add_model_args(p)
    p.add_argument("--doc", type=Path, default=DOC, help="markdown file to update")
    p.add_argument("--no-doc", action="store_true", help="do not touch the markdown file")
    p.add_argument("--json", type=Path, default=None, help="also write raw results here")
    p.add_argument(
        "--max-foreign-cpu",
        type=float,
        default=0.05,
        help="run again when other processes (or the hypervisor: steal) took more than this "
        "share of the machine's CPU",
    )
    p.add_argument("--retries", type=int, default=2, help="reruns per run on a busy machine")
    p.add_argument(
        "--max-wait-s",
        type=float,
        default=120.0,
        help="before each run, wait up to this long for other processes to go quiet",
    )
    p.add_argument("--timeout-s", type=float, default=900.0, help="per torchrun launch")
    p.add_argument("--verbose", action="store_true", help="print raytrec's progress rows")
    a = p.parse_args(argv)
    t = a.world_size
    if t < 1:
        p.error("--world-size must be >= 1")
    if a.layouts is None:
        a.layouts = [GangShape(gangs=1, gang_size=t)]
        if t % 2 == 0:
            a.layouts.append(GangShape(gangs=2, gang_size=t // 2))
    for lay in a.layouts:
        if lay.gangs * lay.gang_size != t:
            p.error(f"layout {lay.gangs}x{lay.gang_size} does not have --world-size={t} ranks")
    if a.log_every < 1 or a.warmup_steps < a.log_every or a.warmup_steps % a.log_every:
        p.error("--warmup-steps must be a positive multiple of --log-every")
    if a.steps <= a.warmup_steps or (a.steps - a.warmup_steps) % a.log_every:
        p.error("--steps - --warmup-steps must be a positive multiple of --log-every")
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    if a.dmp_in_ray and a.gpu:
        p.error("--dmp-in-ray runs on CPU only")
    return a


# -- who else used the CPU ------------------------------------------------------------------


class CpuMonitor:
    """Samples ``/proc`` once a second to tell how much CPU other processes took meanwhile.

    The machine may be shared; a run during which other processes were busy is slower for
    reasons that have nothing to do with what is measured. "Mine" is this process and its
    descendants (torchrun and its workers; the local Ray cluster and its workers), followed
    per pid while they live; everything else busy on the machine (``/proc/stat``) is foreign.
    """

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self._first: dict[int, int] = {}  # pid -> ticks when first seen (0: started later)
        self._last: dict[int, int] = {}
        self._mine: set[int] = set()
        self._names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._started = False

    def __enter__(self) -> CpuMonitor:
        self._wall0, self._busy0, self._steal0 = time.perf_counter(), *_machine_ticks()
        self._sample(initial=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self._wall1, self._busy1, self._steal1 = time.perf_counter(), *_machine_ticks()

    def result(self) -> dict[str, float]:
        """``foreign_cpu`` and ``steal_cpu`` as shares of the machine's capacity."""
        capacity = (self._wall1 - self._wall0) * (os.cpu_count() or 1) * os.sysconf("SC_CLK_TCK")
        mine = sum(self._last[p] - self._first[p] for p in self._mine)
        return {
            "foreign_cpu": max(0.0, (self._busy1 - self._busy0 - mine) / capacity),
            "steal_cpu": (self._steal1 - self._steal0) / capacity,
        }

    def cpu_s_by_process(self) -> dict[str, float]:
        """CPU seconds of this benchmark's own processes meanwhile, by process name."""
        hz = os.sysconf("SC_CLK_TCK")
        out: dict[str, float] = {}
        for p in self._mine:
            name = self._names.get(p, "?")
            out[name] = out.get(name, 0.0) + (self._last[p] - self._first[p]) / hz
        return dict(sorted(((k, round(v, 2)) for k, v in out.items() if v), key=lambda x: -x[1]))

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def _sample(self, *, initial: bool = False) -> None:
        table: dict[int, tuple[int, int]] = {}  # pid -> (ppid, utime + stime)
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = (d / "stat").read_text()
                    rest = stat[stat.rfind(")") + 2 :].split()
                    table[int(d.name)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
                    self._names[int(d.name)] = stat[stat.find("(") + 1 : stat.rfind(")")]
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        todo = [os.getpid()]
        while todo:
            pid = todo.pop()
            self._mine.add(pid)
            todo.extend(children.get(pid, ()))
        for pid, (_, ticks) in table.items():
            self._first.setdefault(pid, ticks if initial else 0)
            self._last[pid] = ticks


def _machine_ticks() -> tuple[int, int]:
    """(busy, steal) clock ticks of all cores since boot, from ``/proc/stat``."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return user + nice + system + irq + softirq, steal


# -- the baseline ------------------------------------------------------------------------


def torchrun_command(a: argparse.Namespace, out: Path) -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [
        *launcher,
        "--standalone",
        f"--nproc-per-node={a.world_size}",
        str(WORKER),
        f"--steps={a.steps}",
        f"--warmup-steps={a.warmup_steps}",
        f"--log-every={a.log_every}",
        f"--out={out}",
        *model_argv(a),
    ]


def run_torchrun(a: argparse.Namespace, repeat: int, tmp: Path) -> Measurement:
    out = tmp / f"torchrun-{repeat}.json"
    log = tmp / f"torchrun-{repeat}.log"
    cmd = torchrun_command(a, out)
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    # Workers import raytrec from the checkout (as the Ray actors do).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with CpuMonitor() as monitor, open(log, "w") as f:
        # A session of its own, so that everything torchrun started can be stopped at once.
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=a.timeout_s)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            raise
    if rc != 0 or not out.exists():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise RuntimeError(f"torchrun exited {rc}: {shlex.join(cmd)}\n{tail}")
    return worker_measurement(BASELINE, repeat, out, monitor)


def worker_measurement(label: str, repeat: int, out: Path, monitor: CpuMonitor) -> Measurement:
    """A run of the baseline worker, from the JSON its rank 0 wrote to ``out``."""
    res = json.loads(out.read_text())
    return Measurement(
        label=label,
        repeat=repeat,
        rows=int(res["rows"]),
        seconds=float(res["seconds"]),
        extra={
            "interval_seconds": res["interval_seconds"],
            "final_loss": res["final_loss"],
            "omp_num_threads": res["omp_num_threads"],
            "cpu_s_by_process": monitor.cpu_s_by_process(),
            **monitor.result(),
        },
    )


# -- raytrec -------------------------------------------------------------------------------


def run_raytrec(a: argparse.Namespace, lay: GangShape, repeat: int, tmp: Path) -> Measurement:
    from raytrec.api import fit
    from raytrec.metrics import IntervalMetrics

    storage = tmp / f"raytrec-{lay.gangs}x{lay.gang_size}-{repeat}"
    cfg = build_config(
        a,
        num_workers=a.world_size,
        gang_size=lay.gang_size,
        steps=a.steps,
        log_every=a.log_every,
        sync_every=a.sync_every,
        storage_path=str(storage),
        name=f"bench-{lay.gangs}x{lay.gang_size}",
    )

    def progress(m: IntervalMetrics) -> None:
        if a.verbose:
            print(
                f"    [{lay.label}] step {m.step:>5} | {m.samples_per_s:>8,.0f} rows/s | "
                f"{m.seconds:.3f}s | sync {100 * m.sync_fraction:.1f}%",
                flush=True,
            )

    try:
        with CpuMonitor() as monitor:
            result = fit(cfg, on_progress=progress, shutdown_ray=False)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    contention = monitor.result()
    skip = a.warmup_steps // a.log_every
    history = result.history
    timed = history[skip:]
    if history[skip - 1].step != a.warmup_steps or sum(m.steps for m in timed) != (
        a.steps - a.warmup_steps
    ):
        raise RuntimeError(f"unexpected metrics history: {[m.step for m in history]}")
    rows = sum(m.steps for m in timed) * a.world_size * a.batch_size
    # Wall clock from the end of the last warmup interval to the end of the last interval, as
    # the coordinator saw it: the intervals plus the (tiny) gaps between them.
    seconds = history[-1].elapsed_s - history[skip - 1].elapsed_s
    return Measurement(
        label=lay.label,
        repeat=repeat,
        rows=rows,
        seconds=seconds,
        extra={
            "interval_seconds": [m.seconds for m in timed],
            "sum_interval_seconds": sum(m.seconds for m in timed),
            "rows_from_metrics": sum(m.samples_per_s * m.seconds for m in timed),
            "sync_fraction": statistics.fmean(m.sync_fraction for m in timed),
            # Interval time the ranks sat idle waiting for the coordinator (Ray's dispatch and
            # results, the bookkeeping) instead of going on with a queued interval.
            "control_fraction": sum(m.idle_s or 0.0 for m in timed) / sum(m.seconds for m in timed),
            "data_wait_fraction": statistics.fmean(m.data_wait_fraction for m in timed),
            "final_loss": history[-1].loss,
            "cpu_s_by_process": monitor.cpu_s_by_process(),
            **contention,
        },
    )


def run_dmp_in_ray(a: argparse.Namespace, repeat: int, tmp: Path) -> Measurement:
    """The baseline worker's ``main`` in ``T`` Ray actors shaped like raytrec's rank actors
    (one CPU each, two threads), rendezvous by env:// on 127.0.0.1 as under torchrun."""
    import socket

    import ray

    out = tmp / f"in-ray-{repeat}.json"
    argv = [
        f"--steps={a.steps}",
        f"--warmup-steps={a.warmup_steps}",
        f"--log-every={a.log_every}",
        f"--out={out}",
        *model_argv(a),
    ]

    @ray.remote(num_cpus=1, max_concurrency=2)
    class InRayWorker:
        def run(self, rank: int, world: int, port: int) -> int:
            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
            )
            sys.path.insert(0, str(HERE))
            import _torchrun_dmp

            return int(_torchrun_dmp.main(argv))

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with CpuMonitor() as monitor:
        workers = [InRayWorker.remote() for _ in range(a.world_size)]
        try:
            codes = ray.get([w.run.remote(r, a.world_size, port) for r, w in enumerate(workers)])
        finally:
            for w in workers:
                ray.kill(w)
    if any(codes) or not out.exists():
        raise RuntimeError(f"the baseline worker in Ray actors failed: exit codes {codes}")
    return worker_measurement(IN_RAY, repeat, out, monitor)


def run_raytrec_all(
    a: argparse.Namespace, repeat: int, tmp: Path, *, reverse: bool = False
) -> list[Measurement]:
    import ray

    from raytrec.cluster import connect

    # Always an embedded cluster on 127.0.0.1 beside the baseline, never a RAY_ADDRESS cluster.
    os.environ.pop("RAY_ADDRESS", None)
    connect(None, num_cpus=a.world_size, log_to_driver=a.verbose)
    try:
        runs: list[Callable[[], Measurement]] = [
            functools.partial(run_raytrec, a, lay, repeat, tmp) for lay in a.layouts
        ]
        if a.dmp_in_ray:
            runs.insert(0, functools.partial(run_dmp_in_ray, a, repeat, tmp))
        return [measure(a, run) for run in (reversed(runs) if reverse else runs)]
    finally:
        ray.shutdown()


def busy(contention: dict[str, Any]) -> float:
    """Share of the machine's CPU that others took: other processes, and the hypervisor."""
    return float(contention["foreign_cpu"] + contention["steal_cpu"])


def wait_for_quiet(a: argparse.Namespace) -> None:
    """Waits (up to ``--max-wait-s``) until other processes leave the CPU to this benchmark."""
    deadline = time.monotonic() + a.max_wait_s
    told = False
    while True:
        with CpuMonitor(period_s=0.5) as monitor:
            time.sleep(2.0)
        foreign = busy(monitor.result())
        if foreign <= a.max_foreign_cpu:
            return
        if time.monotonic() > deadline:
            print(f"  (others still take {foreign:.0%} of the CPU; going ahead)")
            return
        if not told:
            print(f"  (others take {foreign:.0%} of the CPU; waiting for a quiet machine)")
            told = True


def measure(a: argparse.Namespace, run: Callable[[], Measurement]) -> Measurement:
    """Runs again (up to ``--retries`` times) when other processes were busy meanwhile."""
    for attempt in range(a.retries + 1):
        wait_for_quiet(a)
        m = run()
        print(m.line(), flush=True)
        if busy(m.extra) <= a.max_foreign_cpu or attempt == a.retries:
            return dataclasses.replace(m, extra={**m.extra, "attempts": attempt + 1})
        print(
            f"  (others took over {a.max_foreign_cpu:.0%} of the CPU: running it again)", flush=True
        )
    raise AssertionError("unreachable")


# -- report ----------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 2**20
    import ray
    import torch
    import torchrec

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "gpu": gpu,
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "mem_gib": round(mem_gib, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrec": getattr(torchrec, "__version__", "?"),
        "ray": ray.__version__,
    }


def model_size(a: argparse.Namespace) -> dict[str, int]:
    import torch

    from raytrec.api import default_source
    from raytrec.model import build_dlrm

    cfg = build_config(a, num_workers=1, gang_size=1, steps=1, log_every=1)
    num_dense = default_source(cfg).dense_features
    model = build_dlrm(cfg.model, num_dense, torch.device("cpu"), cfg.seed)
    dense = sum(p.numel() for p in model.parameters() if not p.is_meta)
    emb = sum(t.num_embeddings * t.embedding_dim for t in cfg.model.tables)
    return {"embedding_params": emb, "dense_params": dense}


def summarize(a: argparse.Namespace, runs: list[Measurement]) -> list[dict[str, Any]]:
    labels = [BASELINE] + ([IN_RAY] if a.dmp_in_ray else []) + [lay.label for lay in a.layouts]
    base = {m.repeat: m.rows_per_s for m in runs if m.label == BASELINE}
    rows = []
    for label in labels:
        mine = [m for m in runs if m.label == label]
        rates = [m.rows_per_s for m in mine]
        rows.append(
            {
                "config": label,
                "rows_per_s": statistics.median(rates),
                "min": min(rates),
                "max": max(rates),
                "interval_rows_per_s": statistics.median(m.interval_rows_per_s for m in mine),
                "ratio": statistics.median(rates) / statistics.median(base.values()),
                "paired_ratios": (paired := [m.rows_per_s / base[m.repeat] for m in mine]),
                "paired_median": statistics.median(paired),
                "paired_ci": bootstrap_median_ci(paired),
                "max_busy": max(busy(m.extra) for m in mine),
                "attempts": sum(m.extra["attempts"] for m in mine),
            }
        )
    return rows


def bootstrap_median_ci(
    values: Sequence[float], *, level: float = 0.95, resamples: int = 5000, seed: int = 0
) -> tuple[float, float]:
    """A percentile-bootstrap confidence interval for the median of ``values``: the repeats
    resampled with replacement, the median of each resample, the middle ``level`` of those."""
    rng = random.Random(seed)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[min(resamples - 1, int((1 - tail) * resamples))]


def describe(label: str, a: argparse.Namespace) -> str:
    t = a.world_size
    if label == BASELINE:
        return f"DMP over {t} ranks, DDP over {t}"
    if label == IN_RAY:
        return f"the baseline's code in {t} Ray actors (no raytrec)"
    g, l_ = (int(x) for x in label.split()[-1].split("x"))
    if g == 1:
        return f"1 gang of {l_} (no replica plane)"
    return f"{g} gangs of {l_}, sync every {a.sync_every}"


def table(a: argparse.Namespace, summary: list[dict[str, Any]]) -> str:
    lines = [
        "| config | shape | rows/s (median) | min - max | median interval rows/s "
        "| raytrec / torchrun | median per-repeat ratio | 95% CI | per-repeat ratios "
        "| others' CPU (max) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in summary:
        ratio = "1 (baseline)" if r["config"] == BASELINE else f"**{r['ratio']:.3f}**"
        paired = ", ".join(f"{x:.3f}" for x in r["paired_ratios"])
        paired_median = f"**{r['paired_median']:.3f}**"
        low, high = r["paired_ci"]
        ci = f"{low:.3f} - {high:.3f}"
        if r["config"] == BASELINE:
            paired = paired_median = ci = "-"
        lines.append(
            f"| {r['config']} | {describe(r['config'], a)} | {r['rows_per_s']:,.0f} | "
            f"{r['min']:,.0f} - {r['max']:,.0f} | {r['interval_rows_per_s']:,.0f} | {ratio} | "
            f"{paired_median} | {ci} | {paired} | {r['max_busy']:.0%} |"
        )
    return "\n".join(lines)


def section(
    a: argparse.Namespace,
    argv: Sequence[str],
    runs: list[Measurement],
    info: dict[str, Any],
    size: dict[str, int],
    wall_s: float,
) -> str:
    cmd = shlex.join(["./dev.sh", "bench", "throughput_vs_torchrun", *argv])
    measured = a.steps - a.warmup_steps
    emb_mb = size["embedding_params"] * 4 / 2**20
    niceness = (
        "raytrec's ranks at Ray's nice value for workers, 15 (`--rank-niceness ray`)"
        if a.rank_niceness is None
        else f"raytrec's ranks at nice {a.rank_niceness} (`scaling.rank_niceness`; Ray's "
        "other workers, the coordinator among them, at Ray's 15)"
    )
    run_lines = "\n".join(
        f"  - repeat {m.repeat + 1}, {m.label}: {m.rows_per_s:,.0f} rows/s, median interval "
        f"{m.interval_rows_per_s:,.0f}; others took {m.extra['foreign_cpu']:.0%} of the CPU, "
        f"steal {m.extra['steal_cpu']:.0%} (attempt {m.extra['attempts']})"
        for m in runs  # in the order they ran
    )
    in_ray = (
        f"- {IN_RAY}: `_torchrun_dmp.py`'s `main`, unchanged, called in {a.world_size} Ray actors "
        "(one CPU, two threads each, as raytrec's rank actors) that rendezvous by env:// on "
        "127.0.0.1; timed inside the workers as under torchrun.\n"
        if a.dmp_in_ray
        else ""
    )
    heading = GPU_SECTION if a.gpu else SECTION
    hardware = f"GPU: {info['gpu']} (one per rank)" if a.gpu else "no GPU"
    backend = "NCCL" if a.gpu else "gloo"
    return f"""{heading}

Generated by `benchmarks/throughput_vs_torchrun.py` on {info["date"]}
(whole benchmark: {wall_s / 60:.1f} min):

    {cmd}

- Machine: {info["nproc"]} CPU cores (`nproc`), {info["cpu"]}, {info["mem_gib"]} GiB RAM,
  {hardware}; Python {info["python"]}, torch {info["torch"]}, torchrec {info["torchrec"]},
  ray {info["ray"]}.
- T = {a.world_size} ranks on both sides, one torch thread each (`OMP_NUM_THREADS=1`), {backend};
  {niceness}.
- Per-rank batch size {a.batch_size} ({a.batch_size * a.world_size} rows per step over all
  ranks); {a.steps} steps per run, the first {a.warmup_steps} excluded as warmup, so
  {measured} timed steps ({measured * a.batch_size * a.world_size:,} rows); {a.repeats} repeat(s)
  of every configuration; raytrec `log_every={a.log_every}`, `data.read_ahead={a.read_ahead}`
  (`auto`: batches made inline on CPU ranks, on a read-ahead thread on GPU ranks).
- Model: DLRM, {a.num_tables} tables x {a.num_embeddings:,} rows x dim {a.embedding_dim}
  ({size["embedding_params"]:,} embedding parameters, {emb_mb:.1f} MiB fp32, sharded
  `{a.sharding_type}`), dense and over arch {size["dense_params"]:,} parameters; fused
  `{a.embedding_optimizer}` for embeddings, `{a.dense_optimizer}` for dense; SyntheticCriteo
  data (rank r reads shard r of `source.split(T)`).

{table(a, summarize(a, runs))}

What the columns mean:

- rows/s: rows trained by all ranks per wall-clock second of the step loop, setup and warmup
  excluded; median over the repeats (min - max beside it). The median interval column is the
  median over every `log_every`-step interval of the timed steps, which shrugs off short bursts
  of load from other processes.
- raytrec / torchrun: median over median. The per-repeat ratios pair each raytrec run with the
  torchrun run of the same repeat (run just before it in even repeats, just after it in odd
  ones); their median is less sensitive to the machine's drift between repeats. 95% CI: a
  percentile bootstrap of that median over the repeats (5,000 resamples), how far the median
  could move with other repeats on a machine this noisy.
- others' CPU: the largest share of the machine's CPU that processes outside the benchmark, or
  the hypervisor (steal), took during a kept run. Before every run the benchmark waits (up to
  {a.max_wait_s:.0f} s) for the machine to be quiet, and it runs a configuration again (up to
  {a.retries} times) when others took more than {a.max_foreign_cpu:.0%}; the last attempt is
  kept either way.

How each side is timed:

- torchrun + DMP: inside the workers: `dist.barrier()`, clock, {measured} steps (next batch,
  forward, backward with the fused embedding update, dense optimizer step, read the loss),
  `dist.barrier()`, clock. The process group, model and plan are built before the clock, and
  no Ray cluster is up meanwhile.
{in_ray}- raytrec: from `Result.history` (one row per `log_every` steps): the coordinator's wall
  time from the end of the last warmup interval to the end of the last interval (the `elapsed_s`
  difference, which equals the sum of `IntervalMetrics.seconds` up to the microseconds between
  intervals). It includes one Ray round trip per interval (dispatch `train` to every rank,
  wait for all results; the coordinator's bookkeeping runs while the next interval trains
  when nothing happens at the boundary), and the Ray driver, raylet, GCS and coordinator actor
  share the cores with the ranks, as they do in a real job.
- The 2D rows are not the same computation as the baseline: every step also all-reduces the
  dense gradients over the replica group, and every {a.sync_every} steps each rank all-reduces
  its embedding shards and their optimizer state with its replicas (local SGD); in exchange
  each gang holds a whole model copy on fewer ranks, so it needs fewer all-to-alls.

Every run:

{run_lines}
"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    started = time.perf_counter()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    info = {**machine(), "date": date}
    size = model_size(a)
    print(
        f"throughput_vs_torchrun: T={a.world_size}, batch {a.batch_size}/rank, {a.steps} steps "
        f"({a.warmup_steps} warmup), {a.repeats} repeat(s), {info['nproc']} CPU cores; "
        f"raytrec layouts {', '.join(lay.label.split()[-1] for lay in a.layouts)}",
        flush=True,
    )
    runs: list[Measurement] = []
    with tempfile.TemporaryDirectory(prefix="raytrec-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        for repeat in range(a.repeats):
            baseline_first = repeat % 2 == 0  # mirrored order (module doc)
            turn = "first" if baseline_first else "last"
            print(f"repeat {repeat + 1}/{a.repeats} (torchrun {turn})", flush=True)
            if baseline_first:
                runs.append(measure(a, functools.partial(run_torchrun, a, repeat, tmp)))
            runs.extend(run_raytrec_all(a, repeat, tmp, reverse=not baseline_first))
            if not baseline_first:
                runs.append(measure(a, functools.partial(run_torchrun, a, repeat, tmp)))
    wall_s = time.perf_counter() - started
    summary = summarize(a, runs)
    print()
    print(table(a, summary))
    if a.json is not None:
        raw = [{**dataclasses.asdict(m), "rows_per_s": m.rows_per_s} for m in runs]
        a.json.write_text(
            json.dumps({"machine": info, "model": size, "summary": summary, "runs": raw}, indent=1)
        )
    if not a.no_doc:
        heading = GPU_SECTION if a.gpu else SECTION
        replace_section(a.doc, section(a, argv, runs, info, size, wall_s), heading=heading)
        print(f"\nwrote {a.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
