"""The chaos harness's job with its Ray Data pipelines' scheduling loops paced (the default,
raytrec.data.executor_pace) and unpaced (``RAYTREC_DATA_STEP_FLOOR_S=0``), no fault: how fast it
trains and how long its slowest intervals take.

    .venv/bin/python -m benchmarks.data_loop [--runs 2] [--until-step 500]

Each run starts the chaos harness's cluster (a head of one CPU for Ray Data's read tasks, two
worker nodes of two CPUs; docs/fault_tolerance.md, "Chaos"), submits its job with `ray job
submit` (2 gangs x 2 ranks, generated Parquet read by index, a checkpoint every 300 steps) and
stops it at ``--until-step``. The sides take turns (paced, unpaced, unpaced, paced, ...). From
the job's own metrics, after step 40 (the start apart) and leaving out intervals with an
evaluation: steps per second, and the wall time of each 2-step interval.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import raytrec.cluster.local as lc
from benchmarks import chaos
from benchmarks.common import ROOT, md_table, parse, parser, publish

SIDES = {"paced": None, "unpaced": "0"}  # RAYTREC_DATA_STEP_FLOOR_S of each (None: unset)
FROM_STEP = 40


def runtime_env(floor: str | None, into: str) -> str:
    """examples/runtime_env.yaml, with the floor's variable set when ``floor`` is not None;
    its path."""
    text = (ROOT / "examples/runtime_env.yaml").read_text()
    if floor is not None:
        text = text.replace("env_vars:\n", f'env_vars:\n  RAYTREC_DATA_STEP_FLOOR_S: "{floor}"\n')
    path = Path(into, "runtime_env.yaml")
    path.write_text(text)
    return str(path)


def run(a: argparse.Namespace, side: str, index: int) -> list[dict[str, Any]]:
    """One run of the job on a new cluster until ``a.until_step``; its metrics rows."""
    storage = tempfile.mkdtemp(prefix="rtloop-", dir="/tmp")
    env = runtime_env(SIDES[side], storage)
    with lc.local_cluster(head_cpus=chaos.HEAD_CPUS["parquet"], temp_prefix="rtlp-") as cluster:
        with concurrent.futures.ThreadPoolExecutor(len(chaos.NODES)) as pool:
            add = lambda name: cluster.add_node(name, num_cpus=chaos.GANG_SIZE)  # noqa: E731
            list(pool.map(add, chaos.NODES))
        job = f"data-loop-{os.getpid()}-{index}"
        cluster.submit(job, *chaos.entrypoint(a, storage), cwd=str(ROOT), runtime_env=env)
        run_dir = chaos.RunDir(storage)
        end = time.monotonic() + a.timeout_s
        while run_dir.step < a.until_step and time.monotonic() < end:
            run_dir.poll()
            time.sleep(0.2)
        cluster.ray("job", "stop", "--no-wait", "--address", cluster.dashboard, job)
        cluster.wait(job, 180)
        run_dir.poll()
    shutil.rmtree(storage, ignore_errors=True)  # its rows are read
    return run_dir.rows


def figures(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Steps per second and the 2-step intervals' wall times, from step FROM_STEP on."""
    rows = [r for r in rows if r["step"] >= FROM_STEP and r.get("eval_auc") is None]
    if len(rows) < 3:
        raise SystemExit("the job trained too few steps to measure; see its log")
    pairs = [(x, y) for x, y in itertools.pairwise(rows) if y["steps"]]
    took = [(y["at"] - x["at"]) * chaos.LOG_EVERY / y["steps"] for x, y in pairs]
    span = rows[-1]["at"] - rows[0]["at"]
    return {
        "steps_s": (rows[-1]["step"] - rows[0]["step"]) / span,
        "median": statistics.median(took),
        "p95": statistics.quantiles(took, n=20)[-1],
        "max": max(took),
        "over_1s": sum(t > 1.0 for t in took),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "data_loop", "docs/data.md")
    p.add_argument("--runs", type=int, default=2, help="runs of each side, taking turns")
    p.add_argument("--until-step", type=int, default=500, help="stop each job at this step")
    p.add_argument("--timeout-s", type=float, default=600.0, help="stop a job after this")
    a = parse(p, argv)
    # The chaos job's command line: its rows sized for 8000 steps (it is stopped long before).
    a.steps, a.checkpoint_every, a.collective_timeout_s = 8000, 300, 10.0
    a.schedule, a.data = chaos.SCHEDULES["full"], "parquet"
    a.data_dir = tempfile.mkdtemp(prefix="rtloop-data-", dir="/tmp")
    results: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    order = [s for i in range(a.runs) for s in (SIDES if i % 2 == 0 else reversed(SIDES))]
    for index, side in enumerate(order):
        results[side].append(figures(run(a, side, index)))
        print(f"[data_loop] run {index + 1} ({side}): {results[side][-1]}", flush=True)
    shutil.rmtree(a.data_dir, ignore_errors=True)

    def spread(side: str, key: str, fmt: str) -> str:
        return " / ".join(format(r[key], fmt) for r in results[side])

    table = md_table(
        "side | steps/s | 2-step interval, median (s) | p95 (s) | max (s) | intervals over 1 s",
        [
            [side, spread(side, "steps_s", ".1f"), spread(side, "median", ".2f"),
             spread(side, "p95", ".2f"), spread(side, "max", ".2f"), spread(side, "over_1s", "d")]
            for side in SIDES
        ],
    )  # fmt: skip
    paced = statistics.median(r["steps_s"] for r in results["paced"])
    unpaced = statistics.median(r["steps_s"] for r in results["unpaced"])
    body = (
        f"- The chaos harness's cluster and job (2 gangs x 2 ranks on two worker nodes of 2 CPUs, "
        f"Ray Data's read tasks on a head of 1 CPU), no fault, stopped at step {a.until_step}; "
        f"from step {FROM_STEP}, evaluations left out. Each cell: the runs in order.\n\n{table}"
        f"\n\n**Steps per second, paced / unpaced: {paced / unpaced:.1f}x** (medians of "
        f"{a.runs} runs a side)."
    )
    publish(a, body, name="data-loop", heading="## The pipelines' scheduling loop, measured")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
