"""raytrec against torchrun + DMP with both jobs up at once, taking turns on the machine.

    ./dev.sh bench throughput_turns [--layout 1x2] [--rounds 30] [--window-s 8] ...

``throughput_vs_torchrun.py`` runs the two systems one after the other, a minute or more apart.
On a machine whose speed drifts by 10-20% over minutes, a few percent between them is lost in
that drift. Here both whole systems run at the same time and take turns instead: a torchrun
job (``benchmarks/_torchrun_dmp.py``, TorchRec's DMP over T ranks, as in that benchmark) and a
raytrec job (``raytrec.fit`` on its own embedded local Ray cluster, the driver, GCS, raylet,
coordinator and rank actors included). They take turns of ``--window-s`` seconds, torchrun
first and last: one job runs while every process of the other is stopped (SIGSTOP). A stopped
process takes no CPU, so each side runs alone on the machine, as in
the one-after-the-other benchmark, but the two sides' windows are seconds apart.

What counts: each side's own progress records. torchrun's rank 0 writes (step, time) every
``--log-every`` steps (``--marks-file``); raytrec's driver writes each metrics row's step and the
coordinator's ``elapsed_s``. The record gaps that contain a pause (and so the interval during
which a side was stopped or resumed) are cut out; a window's rows/s is the steps between its
first and last record over the time between them. So a side is measured on whole intervals
inside its windows, with its own per-interval control work (for raytrec: the coordinator's
round trips) counted, and the time to come back from a pause not.

Per round: a raytrec window's rows/s over the mean of the two torchrun windows around it, which
takes out a drift that is steady over the three windows. Reported: the median of
those ratios with a bootstrap 95% interval, and each side's rows/s over all windows.

Variants: ``--arm nice=0 --arm nice=ray,log_every=100`` (repeatable) starts one raytrec job per
arm, each on its own Ray cluster, and rotates them (torchrun, arm 1, torchrun, arm 2, ...,
torchrun). Each arm is compared with torchrun as above and, per round, with the first arm,
which measures a change to raytrec against the same torchrun job in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
from _docs import replace_section
from _torchrun_dmp import add_model_args, build_config, model_argv, rank_niceness
from throughput_vs_torchrun import WORKER, GangShape, bootstrap_median_ci

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Throughput, both systems up at once and taking turns"
FOREVER = 10**8  # steps: both jobs are stopped by this script, not by running out
CLUSTER = "its own local Ray cluster: driver, GCS, raylet, coordinator, rank actors"


@dataclasses.dataclass(frozen=True)
class Arm:
    """A raytrec variant: its ranks' nice value as given to ``--rank-niceness`` (an integer, or
    ``ray`` for Ray's 15) and its interval length; ``None``: raytrec's default and
    ``--log-every``."""

    nice: str | None = None
    log_every: int | None = None

    @classmethod
    def parse(cls, text: str) -> Arm:
        known = {"nice", "log_every"}
        values: dict[str, Any] = {}
        for item in filter(None, text.split(",")):
            key, sep, value = item.partition("=")
            if not sep or key not in known:
                raise argparse.ArgumentTypeError(
                    f"{item!r}: expected KEY=VALUE with KEY one of {sorted(known)}"
                )
            if key == "nice":
                rank_niceness(value)  # checks it
                values[key] = value
                continue
            try:
                values[key] = int(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{item!r}: {key} must be an integer") from None
        if values.get("log_every", 1) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: log_every must be >= 1")
        return cls(**values)

    @property
    def label(self) -> str:
        nice = ""
        if self.nice is not None:
            value = rank_niceness(self.nice)
            nice = "ranks at Ray's nice 15" if value is None else f"ranks at nice {value}"
        every = f"log_every {self.log_every}" if self.log_every is not None else ""
        return ", ".join(x for x in (nice, every) if x) or "defaults"

    def driver_argv(self) -> list[str]:
        out = [f"--rank-niceness={self.nice}"] if self.nice is not None else []
        return out + ([f"--log-every={self.log_every}"] if self.log_every is not None else [])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="throughput_turns.py",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--world-size", type=int, default=2, help="T: ranks on both sides")
    p.add_argument("--layout", type=GangShape.parse, default=None, help="raytrec GxL (default 1xT)")
    p.add_argument(
        "--rounds", type=int, default=40, help="raytrec windows (torchrun gets one more)"
    )
    p.add_argument("--window-s", type=float, default=12.0, help="seconds per turn")
    p.add_argument(
        "--settle-s",
        type=float,
        default=3.0,
        help="seconds of each window, after its first record, left out of the timing",
    )
    p.add_argument("--warmup-steps", type=int, default=200, help="steps before the first turn")
    p.add_argument("--log-every", type=int, default=25, help="steps per progress record")
    p.add_argument("--sync-every", type=int, default=4, help="raytrec's embedding sync period")
    add_model_args(p)
    p.add_argument(
        "--arm",
        dest="arms",
        action="append",
        type=Arm.parse,
        default=None,
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="a raytrec variant to take turns (repeatable; default: one with raytrec's "
        "defaults). Keys: nice (its ranks' nice value, scaling.rank_niceness, or 'ray' for Ray's "
        "15), log_every (its steps per interval). Several arms take turns with torchrun in "
        "rotation, each compared with the torchrun windows around it and, per round, with the "
        "first arm",
    )
    p.add_argument("--doc", type=Path, default=DOC, help="markdown file to update")
    p.add_argument("--no-doc", action="store_true", help="do not touch the markdown file")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--driver", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank-niceness", type=rank_niceness, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.layout is None:
        a.layout = GangShape(gangs=1, gang_size=a.world_size)
    a.arms = a.arms or [Arm()]
    if len({arm.label for arm in a.arms}) < len(a.arms):
        p.error("--arm: the same arm twice")
    if a.layout.gangs * a.layout.gang_size != a.world_size:
        p.error(f"--layout {a.layout.label} does not make --world-size {a.world_size} ranks")
    if a.window_s < 2 or a.rounds < 1 or not 0 <= a.settle_s < a.window_s / 2:
        p.error("--window-s must be >= 2, --rounds >= 1 and --settle-s in [0, window-s / 2)")
    return a


# -- the raytrec side: a driver process of its own ----------------------------------------------


def run_driver(a: argparse.Namespace) -> int:
    """The raytrec job (runs in a process of its own, ``--driver FILE``): writes 'step
    elapsed_s perf_counter' per metrics row to FILE until this process is killed."""
    from raytrec.api import fit
    from raytrec.metrics import IntervalMetrics

    # Its checkpoints and metrics go beside the records, in the folder the parent removes.
    tmp = str(a.driver.parent / "raytrec-storage")
    cfg = build_config(
        a,
        num_workers=a.world_size,
        gang_size=a.layout.gang_size,
        steps=FOREVER,
        log_every=a.log_every,
        sync_every=a.sync_every,
        storage_path=tmp,
        name=f"turns-{a.layout.label}",
    )
    with open(a.driver, "a") as out:

        def progress(m: IntervalMetrics) -> None:
            out.write(f"{m.step} {m.elapsed_s} {time.perf_counter()}\n")
            out.flush()

        fit(cfg, on_progress=progress)
    return 0


# -- stopping and resuming whole process trees --------------------------------------------------


class Side:
    """One system: a process started in a session of its own, and everything it starts."""

    def __init__(self, name: str, cmd: list[str], records: Path, log: Path) -> None:
        self.name, self.records = name, records
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("RAY_ADDRESS", None)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
            )
        self.log = log
        self._seen: dict[int, psutil.Process] = {}

    def processes(self) -> list[psutil.Process]:
        """The root and all its descendants now, plus any seen before that still live (a
        stopped parent no longer lists a child that re-parented)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.proc.pid)
            for q in [root, *root.children(recursive=True)]:
                self._seen.setdefault(q.pid, q)
        return [q for q in self._seen.values() if q.is_running()]

    def signal(self, sig: int) -> None:
        for q in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                q.send_signal(sig)

    def steps(self) -> int:
        lines = self.records.read_text().split("\n") if self.records.exists() else []
        return max((int(x.split()[0]) for x in lines if x.strip()), default=0)

    def wait_for_step(self, step: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.steps() < step:
            if self.proc.poll() is not None:
                tail = "".join(self.log.read_text(errors="replace").splitlines(True)[-30:])
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not reach step {step} in {timeout_s:.0f} s")
            time.sleep(0.2)

    def stop_all(self) -> None:
        """Ends every process of this side (they were all started by this script)."""
        procs = self.processes()
        for q in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                q.send_signal(signal.SIGCONT)
                q.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=15)
        for q in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                q.kill()
        psutil.wait_procs(alive, timeout=15)


# -- analysis -----------------------------------------------------------------------------------


def window_rates(
    records: list[tuple[int, float, float]],
    windows: list[tuple[float, float]],
    rows_per_step: int,
    *,
    gap_s: float,
    settle_s: float,
) -> list[float | None]:
    """rows/s of each window (``windows``: (start, end) in ``time.perf_counter``) from the
    records (step, t, perf_counter at which the record was written or seen). ``t`` differences
    time the work; records closer than ``gap_s`` in ``t`` belong to one stretch of running.
    Each stretch is assigned to the window its records were written in. Its records in the
    first ``settle_s`` after its first one are left out (a side coming back from a pause)."""
    out: list[float | None] = [None] * len(windows)
    stretch: list[tuple[int, float, float]] = []

    def close(run: list[tuple[int, float, float]]) -> None:
        run = [r for r in run if r[1] >= run[0][1] + settle_s]
        if len(run) < 3:  # too few whole intervals to time
            return
        seen_at = statistics.median(r[2] for r in run)
        for i, (start, end) in enumerate(windows):
            if start <= seen_at <= end + gap_s:
                steps = run[-1][0] - run[0][0]
                out[i] = steps * rows_per_step / (run[-1][1] - run[0][1])
                return

    for rec in records:
        if stretch and rec[1] - stretch[-1][1] > gap_s:
            close(stretch)
            stretch = []
        stretch.append(rec)
    close(stretch)
    return out


def read_records(path: Path, *, driver: bool) -> list[tuple[int, float, float]]:
    out = []
    for line in path.read_text().split("\n"):
        parts = line.split()
        if not parts:
            continue
        step, t = int(parts[0]), float(parts[1])
        out.append((step, t, float(parts[2]) if driver else t))
    return out


def arm_summary(ratios: list[float], rates: list[float]) -> dict[str, Any]:
    lo, hi = bootstrap_median_ci(ratios)
    return {
        "ratios": ratios,
        "median": statistics.median(ratios),
        "ci": (lo, hi),
        "ahead": sum(x > 1 for x in ratios),
        "mean": statistics.fmean(rates),
        "median_rate": statistics.median(rates),
    }


def section(a: argparse.Namespace, summary: dict[str, Any], argv: Sequence[str]) -> str:
    cmd = " ".join(["./dev.sh bench throughput_turns", *argv])
    arms: list[dict[str, Any]] = summary["arms"]
    several = len(arms) > 1
    names = [f"{a.layout.label}" + (f" ({arm['label']})" if several else "") for arm in arms]
    rows = "\n".join(
        f"| {name} | {arm['mean']:,.0f} | {arm['median_rate']:,.0f} |"
        for name, arm in zip(names, arms, strict=True)
    )
    if several:
        order = (
            f"in rotation: torchrun, {names[0]}, torchrun, {names[1]}"
            + (", ..." if len(arms) > 2 else "")
            + f", torchrun first and last ({a.rounds} windows per raytrec job, "
            f"{a.rounds * len(arms) + 1} torchrun windows)"
        )
        jobs = f"{len(arms)} {a.layout.label} jobs (each {CLUSTER})"
    else:
        order = (
            f"torchrun first and last ({a.rounds} raytrec windows, {a.rounds + 1} torchrun windows)"
        )
        jobs = f"a {a.layout.label} job ({CLUSTER})"
    unless = " unless an arm says otherwise" if several else ""
    default_nice = "Ray's 15" if a.rank_niceness is None else f"nice {a.rank_niceness}"
    nice = (
        f"raytrec's ranks at {default_nice} unless an arm says otherwise"
        if several
        else f"raytrec's ranks at {default_nice} (`scaling.rank_niceness`)"
    ) + ", its coordinator and Ray's other workers at Ray's nice 15"
    lines = []
    for name, arm in zip(names, arms, strict=True):
        lo, hi = arm["ci"]
        lines.append(
            f"- {name}: median **{arm['median']:.3f}** (95% CI {lo:.3f} - {hi:.3f}); mean over "
            f"mean {arm['mean'] / summary['torchrun_all']:.3f}; raytrec ahead in {arm['ahead']} "
            f"of {len(arm['ratios'])} rounds. Per-round ratios: "
            + ", ".join(f"{r:.3f}" for r in arm["ratios"])
            + "."
        )
    paired = ""
    if several:
        paired = (
            "\n\nEach arm against the first, per round (its ratio over the first arm's):\n\n"
            + "\n".join(
                f"- {names[i]} / {names[0]}: median **{arm['vs_first']:.3f}** (95% CI "
                f"{arm['vs_first_ci'][0]:.3f} - {arm['vs_first_ci'][1]:.3f}), above 1 in "
                f"{arm['vs_first_above']} of {arm['vs_first_n']} rounds."
                for i, arm in enumerate(arms)
                if i
            )
        )
    return f"""{SECTION}

Generated by `benchmarks/throughput_turns.py` on {summary["when"]} (whole run
{summary["minutes"]:.1f} min; {os.cpu_count()} CPU cores, Python {platform.python_version()},
torch {summary["torch"]}, ray {summary["ray"]}):

    {cmd}

A torchrun + DMP job and {jobs} are up at once and take turns of {a.window_s:g} s: one runs
while every process of the {"others" if several else "other"} is stopped (SIGSTOP), {order}.
T = {a.world_size} ranks on each side, gloo, one torch thread per rank, batch {a.batch_size}
per rank, the throughput benchmark's model; {nice}. A window's rows/s is timed from each
side's own progress records (every {a.log_every} steps{unless}), on the whole intervals inside
the window, from {a.settle_s:g} s after its first record on.

| side | mean window rows/s | median window rows/s |
|---|---:|---:|
| torchrun + DMP | {summary["torchrun_all"]:,.0f} | {summary["torchrun_median"]:,.0f} |
{rows}

raytrec / torchrun per round (a raytrec window over the mean of the torchrun windows just
before and after it):

{chr(10).join(lines)}{paired}
"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.driver is not None:
        return run_driver(a)
    if a.gpu:
        raise SystemExit("throughput_turns.py: CPU ranks only")
    import ray
    import torch

    began = time.perf_counter()
    rows_per_step = a.world_size * a.batch_size
    tmp = Path(tempfile.mkdtemp(prefix="rt-turns-"))
    t_rec = tmp / "torchrun.marks"
    exe = Path(sys.executable).with_name("torchrun")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    torchrun_cmd = [
        *launcher,
        "--standalone",
        f"--nproc-per-node={a.world_size}",
        str(WORKER),
        f"--steps={FOREVER}",
        "--warmup-steps=0",
        f"--log-every={a.log_every}",
        f"--out={tmp / 'torchrun.json'}",
        f"--marks-file={t_rec}",
        *model_argv(a),
    ]
    sides: list[Side] = []
    arm_sides: list[Side] = []
    windows: dict[str, list[tuple[float, float]]] = {}
    try:
        print(
            f"throughput_turns: T={a.world_size}, {a.layout.label}, arms "
            f"{[arm.label for arm in a.arms]}, {a.rounds} rounds of {a.window_s:g} s per side; "
            f"records in {tmp} until done",
            flush=True,
        )
        torchrun = Side("torchrun", torchrun_cmd, t_rec, tmp / "torchrun.log")
        sides.append(torchrun)
        torchrun.wait_for_step(a.warmup_steps, a.start_timeout_s)
        torchrun.signal(signal.SIGSTOP)
        for i, arm in enumerate(a.arms):
            rec = tmp / f"raytrec-{i}.marks"
            cmd = [sys.executable, str(Path(__file__).resolve()), *argv, f"--driver={rec}"]
            side = Side(f"raytrec-{i}", [*cmd, *arm.driver_argv()], rec, tmp / f"raytrec-{i}.log")
            sides.append(side)
            arm_sides.append(side)
            side.wait_for_step(a.warmup_steps, a.start_timeout_s)
            side.signal(signal.SIGSTOP)
        # torchrun, arm 0, torchrun, arm 1, ..., torchrun: each raytrec window sits between
        # two torchrun windows, and is compared with their mean, which takes out a drift that
        # is steady over the three windows.
        turns = [s for _ in range(a.rounds) for arm in arm_sides for s in (torchrun, arm)]
        turns.append(torchrun)
        for i, side in enumerate(turns):
            side.signal(signal.SIGCONT)
            start = time.perf_counter()
            time.sleep(a.window_s)
            side.signal(signal.SIGSTOP)
            windows.setdefault(side.name, []).append((start, time.perf_counter()))
            if side is not torchrun:
                print(
                    f"  round {i // (2 * len(arm_sides)) + 1}/{a.rounds}, {side.name}: "
                    f"at step {side.steps()} (torchrun at step {torchrun.steps()})",
                    flush=True,
                )
    finally:
        for side in sides:
            side.stop_all()

    gap = a.window_s / 2

    def rates(side: Side) -> list[float | None]:
        return window_rates(
            read_records(side.records, driver=side is not torchrun),
            windows[side.name],
            rows_per_step,
            gap_s=gap,
            settle_s=a.settle_s,
        )

    t_rates = rates(torchrun)
    n = len(arm_sides)
    per_round: list[list[float | None]] = []  # arm -> round -> ratio to torchrun
    for j, side in enumerate(arm_sides):
        mine: list[float | None] = []
        for k, rt in enumerate(rates(side)):
            before, after = t_rates[k * n + j], t_rates[k * n + j + 1]
            mine.append(rt / ((before + after) / 2) if rt and before and after else None)
        per_round.append(mine)
    if any(not [x for x in r if x] for r in per_round):
        raise RuntimeError(f"an arm has no round timed on both sides; records in {tmp}")
    arms: list[dict[str, Any]] = []
    for j, side in enumerate(arm_sides):
        ratios = [x for x in per_round[j] if x]
        arm = {"label": a.arms[j].label, **arm_summary(ratios, [r for r in rates(side) if r])}
        if j:
            vs = [x / y for x, y in zip(per_round[j], per_round[0], strict=True) if x and y]
            arm.update(
                vs_first=statistics.median(vs),
                vs_first_ci=bootstrap_median_ci(vs),
                vs_first_above=sum(x > 1 for x in vs),
                vs_first_n=len(vs),
            )
        arms.append(arm)
    timed = {side.name: sum(1 for r in rates(side) if r) for side in sides}
    shutil.rmtree(tmp, ignore_errors=True)  # kept above, where the records explain a failure
    tr_all = [tr for tr in t_rates if tr]
    summary: dict[str, Any] = {
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "minutes": (time.perf_counter() - began) / 60,
        "torch": torch.__version__,
        "ray": ray.__version__,
        "arms": arms,
        "torchrun_all": statistics.fmean(tr_all),
        "torchrun_median": statistics.median(tr_all),
    }
    text = section(a, summary, argv)
    print(text)
    print("windows timed: " + ", ".join(f"{k} {v}/{len(windows[k])}" for k, v in timed.items()))
    if not a.no_doc:
        replace_section(a.doc, text, heading=SECTION)
        print(f"wrote {a.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
