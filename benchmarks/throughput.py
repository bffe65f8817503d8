"""Training throughput on CPU: raytrec's ``fit()`` against plain TorchRec DMP under ``torchrun``.

    .venv/bin/python -m benchmarks.throughput [--rounds 40] [--window-s 12] [--world-size 2]

The two take turns of ``--window-s`` on the same cores, the other SIGSTOPped; how a window is
timed and the two compared: docs/benchmarks.md, "Throughput against torchrun".
"""

from __future__ import annotations

import argparse
import contextlib
import os
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

from benchmarks import common
from raytrec.cluster.local import session_pids, stop_session
from raytrec.config import TrainConfig

FOREVER = 10**8  # steps of either side's job: this script stops it
MODEL, BATCH_SIZE = (26, 10_000, 16), 256  # tables x rows x dim; rows per rank per step


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = common.parser(__doc__, "throughput", "docs/benchmarks.md")
    p.add_argument("--world-size", type=int, default=2, help="T: ranks a side")
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--log-every", type=int, default=25, help="steps between progress records")
    p.add_argument("--rounds", type=int, default=40, help="raytrec windows")
    p.add_argument("--window-s", type=float, default=12.0, help="seconds per turn")
    p.add_argument("--settle-s", type=float, default=3.0, help="left out of a window")
    p.add_argument("--marks-file", type=Path, help=argparse.SUPPRESS)  # a torchrun worker's
    p.add_argument("--driver", type=Path, help=argparse.SUPPRESS)  # the raytrec side's records
    a = common.parse(p, argv)
    if a.warmup_steps % a.log_every:
        p.error("--log-every must divide --warmup-steps")
    if not 0 <= a.settle_s < a.window_s / 2:
        p.error("--settle-s must be below half of --window-s")
    return a


def build_config(a: argparse.Namespace, *, run_dir: str) -> TrainConfig:
    """The job both sides train (the shape of ``python -m jobs.train``'s), until stopped."""
    return common.dlrm_job(
        MODEL, batch_size=BATCH_SIZE, world_size=a.world_size, num_steps=FOREVER,
        log_every=a.log_every, storage_path=run_dir,
    )  # fmt: skip


def torchrun_worker(a: argparse.Namespace) -> int:
    """One torchrun rank: DMP over the whole world, the step a raytrec rank runs (next batch,
    forward, backward with the fused embedding update, dense optimizer step, read the loss);
    rank 0 writes 'step perf_counter perf_counter' to ``--marks-file`` every interval."""
    import torch
    import torch.distributed as dist

    from raytrec._quiet import quiet_known_warnings
    from raytrec.api import _plan, default_source
    from raytrec.models import build_train_model

    quiet_known_warnings()
    torch.set_num_threads(1)  # what a CPU raytrec rank does (cpus_per_rank=1)
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = build_config(a, run_dir="unused")
    source = default_source(cfg)
    plan = [None if rank else _plan(cfg, source.dense_features, build_train_model)]
    dist.broadcast_object_list(plan, src=0)  # every rank shards alike, as collective_plan does
    dmp, dense = common.plain_torchrec(cfg, source.dense_features, torch.device("cpu"), plan[0])
    batches = source.split(world)[rank].batches(cfg.data.batch_size)
    with open(a.marks_file if rank == 0 else os.devnull, "a") as out:
        for step in range(1, FOREVER):
            loss, _ = dmp(next(batches))
            loss.backward()
            dense.step()
            dense.zero_grad(set_to_none=False)
            float(loss.detach())
            if step % a.log_every == 0:
                now = time.perf_counter()
                print(step, now, now, file=out, flush=True)
    return 0


def run_driver(a: argparse.Namespace) -> int:
    """The raytrec side, in a process of its own: 'step elapsed_s perf_counter' to ``--driver``."""
    from raytrec.api import fit

    cfg = build_config(a, run_dir=str(a.driver.parent))
    with open(a.driver, "a") as out:

        def progress(m: Any) -> None:
            print(m.step, m.elapsed_s, time.perf_counter(), file=out, flush=True)

        fit(cfg, on_progress=progress)
    return 0


class Side:
    """One system: a process in a session of its own, and every process it starts."""

    def __init__(self, cmd: list[str], records: Path) -> None:
        self.records, self.log = records, records.with_suffix(".log")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(common.ROOT), env.get("PYTHONPATH")]))
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, cwd=common.ROOT, env=env,
                start_new_session=True,
            )  # fmt: skip

    def signal(self, sig: int) -> None:
        """Signals every process of the session (a child that re-parented included) and their
        descendants: torchrun starts each worker in a session of its own."""
        import psutil

        pids = set(session_pids(self.proc.pid))
        for pid in list(pids):
            with contextlib.suppress(psutil.Error):
                pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)

    def records_now(self) -> list[tuple[int, float, float]]:
        text = self.records.read_text() if self.records.exists() else ""
        return [(int(s), float(t), float(w)) for s, t, w in (x.split() for x in text.splitlines())]

    def wait_for_step(self, step: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while max((r[0] for r in self.records_now()), default=0) < step:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no step {step}:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop_all(self) -> None:
        self.signal(signal.SIGCONT)  # a stopped process would not see the SIGTERM
        stop_session(self.proc.pid, grace_s=15)


def window_rates(
    records: list[tuple[int, float, float]], windows: list[tuple[float, float]],
    rows_per_step: int, *, gap_s: float, settle_s: float,
) -> list[float | None]:  # fmt: skip
    """rows/s of each window ((start, end) in ``time.perf_counter``) from the records (step, t,
    perf_counter at which the record was written or seen). Records closer than ``gap_s`` in
    ``t`` are one stretch of running, assigned to the window most of its records were seen in;
    its records in the first ``settle_s`` are left out (a side coming back from a pause)."""
    out: list[float | None] = [None] * len(windows)
    stretches: list[list[tuple[int, float, float]]] = []
    for rec in records:
        if not stretches or rec[1] - stretches[-1][-1][1] > gap_s:
            stretches.append([])
        stretches[-1].append(rec)
    for run in stretches:
        run = [r for r in run if r[1] >= run[0][1] + settle_s]
        if len(run) < 3:  # too few whole intervals to time
            continue
        seen_at = statistics.median(r[2] for r in run)
        for i, (start, end) in enumerate(windows):
            if start <= seen_at <= end + gap_s:
                out[i] = (run[-1][0] - run[0][0]) * rows_per_step / (run[-1][1] - run[0][1])
                break
    return out


def turns(a: argparse.Namespace) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="rt-turns-"))
    t_rec, r_rec = tmp / "t.rec", tmp / "r.rec"  # each side's progress records
    torchrun = f"-m torch.distributed.run --standalone --nproc-per-node={a.world_size}".split()
    me = [sys.executable, *torchrun, "-m", "benchmarks.throughput", *a.argv]
    commands = [
        ([*me, f"--marks-file={t_rec}"], t_rec),
        ([sys.executable, "-m", "benchmarks.throughput", *a.argv, f"--driver={r_rec}"], r_rec),
    ]
    sides: list[Side] = []
    windows: dict[int, list[tuple[float, float]]] = {0: [], 1: []}
    try:
        for cmd, records in commands:  # each up and past its warmup, then stopped
            sides.append(Side(cmd, records))
            sides[-1].wait_for_step(a.warmup_steps, timeout_s=900)
            sides[-1].signal(signal.SIGSTOP)
        for i in [0, 1] * a.rounds + [0]:
            sides[i].signal(signal.SIGCONT)
            start = time.perf_counter()
            time.sleep(a.window_s)
            sides[i].signal(signal.SIGSTOP)
            windows[i].append((start, time.perf_counter()))
            print(f"window {len(windows[0]) + len(windows[1])} of {2 * a.rounds + 1}", flush=True)
    finally:
        for side in sides:
            side.stop_all()
    gap_s, per_step = a.window_s / 2, a.world_size * BATCH_SIZE
    t, r = (
        window_rates(s.records_now(), windows[i], per_step, gap_s=gap_s, settle_s=a.settle_s)
        for i, s in enumerate(sides)
    )
    ratios = [x / ((b + c) / 2) for x, b, c in zip(r, t, t[1:], strict=False) if x and b and c]
    if not ratios:
        raise RuntimeError(f"no round timed on both sides; records in {tmp}")
    shutil.rmtree(tmp, ignore_errors=True)  # kept above, where the records explain a failure
    rows = []
    for name, rates in (("torchrun + DMP", t), (f"raytrec 1x{a.world_size}", r)):
        ok = [x for x in rates if x]
        rows.append([name, f"{statistics.fmean(ok):,.0f}", f"{statistics.median(ok):,.0f}"])
    return (
        common.md_table("side | mean window rows/s | median window rows/s", rows)
        + "\n\nraytrec / torchrun per round: median "
        + common.ratio_ci(ratios, ".3f", "(95% CI {} - {})")
        + f", raytrec ahead in {sum(x > 1 for x in ratios)} of {len(ratios)} "
        "rounds. Per-round ratios: " + ", ".join(f"{x:.3f}" for x in ratios) + "."
    )


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.marks_file:
        return torchrun_worker(a)
    if a.driver:
        return run_driver(a)
    table = turns(a)
    shape = (
        f"T = {a.world_size} ranks a side, batch {BATCH_SIZE} per rank, DLRM "
        + "{} tables x {:,} x {}".format(*MODEL)
        + f", raytrec ranks at nice 0; {a.rounds} rounds of {a.window_s:g} s windows, "
        f"{a.settle_s:g} s settling left out."
    )
    common.publish(a, f"- {shape}\n\n{table}", name="throughput", heading="## throughput")
    return 0


if __name__ == "__main__":
    sys.exit(main())
