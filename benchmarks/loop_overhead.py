"""raytrec's rank loop against the plain DMP loop, in the same two processes, without Ray.

    ./dev.sh bench loop_overhead [--steps 300] [--cycles 6]

The throughput benchmark (``throughput_vs_torchrun.py``) compares whole systems: raytrec in
Ray actors against torchrun. This one isolates the rank's own code. One 1 x 2 job of
:class:`~raytrec.engine.rank.RankEngine` ranks runs on gloo in two plain processes (the
``tests/gloo_job.py`` harness, no Ray), and each process takes turns, ``--cycles`` times, at
``--steps`` steps of:

* **plain DMP loop**: what the torchrun baseline worker does per step (next batch, forward,
  backward with the fused embedding update, dense optimizer step, zero_grad, read the loss) on
  the engine's own ``DistributedModelParallel`` and dense optimizer;
* **RankEngine.train_step**: the same step through the engine (plus the replica plane's dense
  averaging, a no-op with one gang);
* **RankWorker.train**: the rank actor's whole loop, called as a plain object: intervals of
  ``--log-every`` steps with the batches prepared ahead, the batch ledger, fault checks, the
  sync decision and the rank's AUC/NE states.

All three train the same model on the same shard, one after the other, so the machine's drift
over minutes hits all of them alike; odd cycles run them in reverse order. Each is timed by rank
0 between two barriers. The table gives the median over cycles of each loop's ms per step and
of its per-cycle ratio to the plain loop (rows/s, so > 1 is faster), printed and written to
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the gloo_job harness

from _docs import replace_section  # noqa: E402  (benchmarks/, the script's own folder)
from _torchrun_dmp import add_model_args, build_config  # noqa: E402

SECTION = "## Rank loop overhead, without Ray"
LOOPS = ("plain DMP loop", "RankEngine.train_step", "RankWorker.train")


def worker(spec: Any, *, steps: int, cycles: int, log_every: int) -> dict[str, list[float]]:
    """One rank: builds the engine once, then times every loop ``cycles`` times."""
    import torch
    import torch.distributed as dist

    from actors.rank import RankWorker
    from raytrec.api import default_source

    torch.set_num_threads(1)
    cfg = spec.config
    shard = default_source(cfg).split(cfg.scaling.num_workers)[spec.rank]
    rank = RankWorker(spec, shard)
    # RankWorker.build() without its Ray bits (it reports the Ray node it runs on).
    rank.engine.build()
    rank._open_feed()
    engine = rank.engine
    engine.join_replica_plane(generation=0, member_rank=0, size=1)
    batches = shard.batches(cfg.data.batch_size)

    def plain(n: int) -> None:
        for _ in range(n):
            batch = next(batches)
            loss, _ = engine.model(batch)
            loss.backward()
            engine.dense_optimizer.step()
            engine.dense_optimizer.zero_grad(set_to_none=False)
            float(loss.detach())

    def train_step(n: int) -> None:
        for _ in range(n):
            engine.train_step(next(batches))

    def rank_loop(n: int) -> None:
        rank.prepare(log_every)
        for _ in range(n // log_every):
            rank.train(log_every, 2 * log_every)  # as the job asks: the next two intervals

    loops: dict[str, Callable[[int], None]] = dict(
        zip(LOOPS, (plain, train_step, rank_loop), strict=True)
    )
    for run in loops.values():
        run(2 * log_every)  # warm up
    times: dict[str, list[float]] = {name: [] for name in LOOPS}
    for cycle in range(cycles):
        for name in LOOPS if cycle % 2 == 0 else tuple(reversed(LOOPS)):
            dist.barrier()
            start = time.perf_counter()
            loops[name](steps)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="steps per loop per cycle")
    p.add_argument("--cycles", type=int, default=6)
    p.add_argument("--log-every", type=int, default=25, help="RankWorker.train's interval")
    p.add_argument("--no-doc", action="store_true", help="print only")
    a = p.parse_args(argv)
    if a.steps % a.log_every:
        p.error("--steps must be a multiple of --log-every")

    from gloo_job import make_plan_for, run_gang_job

    from raytrec.api import default_source

    started = time.perf_counter()
    defaults = argparse.ArgumentParser()
    add_model_args(defaults)
    model_args = defaults.parse_args([])  # the throughput benchmark's model, by default
    cfg = build_config(model_args, num_workers=2, gang_size=2, steps=1 << 20, log_every=25)
    num_dense = default_source(cfg).dense_features
    out = run_gang_job(
        worker,
        num_gangs=1,
        gang_size=2,
        config=cfg,
        plan=make_plan_for(cfg, num_dense),
        num_dense=num_dense,
        timeout_s=1800,
        steps=a.steps,
        cycles=a.cycles,
        log_every=a.log_every,
    )
    times = out[0]  # rank 0's clock
    base = times[LOOPS[0]]
    lines = [
        "| loop | ms per step (median) | per cycle | rows/s vs plain DMP loop (median) |",
        "|---|---:|---|---:|",
    ]
    for name in LOOPS:
        per_step = [1000 * t / a.steps for t in times[name]]
        ratio = statistics.median(b / t for b, t in zip(base, times[name], strict=True))
        cycles = ", ".join(f"{x:.2f}" for x in per_step)
        lines.append(f"| {name} | {statistics.median(per_step):.2f} | {cycles} | {ratio:.3f} |")
    table = "\n".join(lines)
    print(table)
    if not a.no_doc:
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        cmd = shlex.join(["./dev.sh", "bench", "loop_overhead", *argv])
        text = f"""{SECTION}

Generated by `benchmarks/loop_overhead.py` on {date} (whole run
{(time.perf_counter() - started) / 60:.1f} min; Python {platform.python_version()}):

    {cmd}

One 1 x 2 job (the throughput benchmark's model and batch size, gloo, one torch thread per
rank) in two plain processes, no Ray. Each process takes turns at {a.steps} steps of each loop,
{a.cycles} cycles, the order reversed every other cycle; rank 0 times each between barriers.
The plain loop is the torchrun baseline's step on the engine's own DMP; `RankWorker.train` is
the rank actor's whole loop (batches prepared {a.log_every} at a time, batch ledger, fault
checks, sync decision, AUC/NE states), called as a plain object.

{table}

`RankEngine.train_step` is part of `RankWorker.train`'s loop, so a gap between those two rows is
the cycles' spread (the machine is shared), not a cost: read differences of a few percent as
noise.
"""
        replace_section(HERE.parent / "docs" / "benchmarks.md", text, heading=SECTION)
        print("\nwrote docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
