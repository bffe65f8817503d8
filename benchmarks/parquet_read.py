"""Parquet to ranks through Ray Data: the indexed read mode against the streaming one.

    .venv/bin/python benchmarks/parquet_read.py [--rows 262144] [--ranks 2] [--repeats 3]

Writes Criteo-shaped synthetic Parquet once (``--files`` files of ``--row-groups`` row groups),
starts a local Ray cluster (127.0.0.1) with one CPU per rank plus ``--data-cpus`` for Ray Data's
read tasks, and drains one epoch with ``--ranks`` rank actors, each turning its shard's stream
into torchrec batches of ``--batch-size`` rows, as ranks do (no training: the data path alone).
The two modes take turns, ``--repeats`` times each. For each run: rows per second over all ranks
(rows over the slowest rank's wall time, from the first ``next()`` to the last batch), and the
time to the first batch (the pipeline's start-up). Then the cost of a replay in the indexed mode
(reading one batch again by its id, in the rank's process). The results are printed and written
to the "Indexed and streaming reads, measured" section of ``docs/data.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from _docs import replace_section  # benchmarks/, the script's own folder

from raytrec.cluster import connect
from raytrec.data.generate import write_synthetic_parquet
from raytrec.data.parquet import ParquetSource
from raytrec.data.source import BatchShard
from raytrec.data.spec import criteo_spec
from raytrec.data.synthetic import batch_id

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "data.md"
SECTION = "## Indexed and streaming reads, measured"
VOCAB = 100_000


@ray.remote(num_cpus=1)
class Rank:
    """Drains a shard as a rank's feed would, converting every batch."""

    def drain(self, shard: BatchShard, batch_size: int) -> dict[str, float]:
        import torch

        torch.set_num_threads(1)
        start = time.perf_counter()
        first = None
        rows = batches = 0
        for batch in shard.batches(batch_size):
            if first is None:
                first = time.perf_counter() - start
            rows += int(batch.labels.shape[0])
            batches += 1
        wall = time.perf_counter() - start
        return {"rows": rows, "batches": batches, "wall_s": wall, "first_s": first or 0.0}

    def replay(self, shard: BatchShard, ids: list[int], batch_size: int) -> list[float]:
        out = []
        for i in ids:
            t = time.perf_counter()
            shard.replay(i, batch_size)
            out.append(time.perf_counter() - t)
        return out


def run_mode(
    path: str, mode: str, ranks: int, batch_size: int, concurrency: int
) -> dict[str, float]:
    source = ParquetSource(
        paths=path,
        spec=criteo_spec(VOCAB),
        read_mode=mode,
        read_concurrency=concurrency,
    )
    shards = source.split(ranks)
    actors = [Rank.remote() for _ in range(ranks)]
    ray.get([a.__ray_ready__.remote() for a in actors])  # started before the clock
    results = ray.get([a.drain.remote(s, batch_size) for a, s in zip(actors, shards, strict=True)])
    for a in actors:
        ray.kill(a)
    rows = sum(r["rows"] for r in results)
    wall = max(r["wall_s"] for r in results)
    return {"rows": rows, "rows_per_s": rows / wall, "first_s": max(r["first_s"] for r in results)}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--rows", type=int, default=262_144)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--row-groups", type=int, default=4, help="row groups per file")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--data-cpus", type=int, default=2, help="CPUs for Ray Data's tasks")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=2, help="indexed: read tasks per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--no-doc", action="store_true", help="do not touch docs/data.md")
    a = p.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        write_synthetic_parquet(
            tmp,
            rows=a.rows,
            files=a.files,
            row_groups_per_file=a.row_groups,
            seed=0,
            num_embeddings=VOCAB,
        )
        connect(num_cpus=a.ranks + a.data_cpus)
        ray.data.DataContext.get_current().enable_progress_bars = False
        runs: dict[str, list[dict[str, float]]] = {"streaming": [], "indexed": []}
        try:
            run_mode(tmp, "indexed", a.ranks, a.batch_size, a.concurrency)  # warm-up: imports
            for r in range(a.repeats):
                for mode in ("streaming", "indexed") if r % 2 == 0 else ("indexed", "streaming"):
                    res = run_mode(tmp, mode, a.ranks, a.batch_size, a.concurrency)
                    assert res["rows"] == a.rows, res
                    runs[mode].append(res)
                    rate, first = res["rows_per_s"], res["first_s"]
                    print(f"{mode:9s} {rate:>10,.0f} rows/s, first batch {first:.2f} s")
            (shard,) = ParquetSource(paths=tmp, spec=criteo_spec(VOCAB), read_mode="indexed").split(
                a.ranks
            )[:1]
            steps = shard.plan(a.batch_size).num_steps
            ids = [batch_id(k % a.ranks, (k * 7) % steps) for k in range(a.replays)]
            actor = Rank.remote()
            replay_s = ray.get(actor.replay.remote(shard, ids, a.batch_size))
        finally:
            ray.shutdown()
    took = time.perf_counter() - started
    text = render(a, argv, runs, replay_s, took)
    print(text)
    if not a.no_doc:
        replace_section(DOC, text, heading=SECTION, title="# Data")
        print(f"updated {SECTION!r} in {DOC.relative_to(ROOT)}")
    return 0


def render(
    a: Any,
    argv: list[str],
    runs: dict[str, list[dict[str, float]]],
    replay: list[float],
    took: float,
) -> str:
    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    def best(mode: str) -> float:
        return max(r["rows_per_s"] for r in runs[mode])

    ratio_med = med("indexed", "rows_per_s") / med("streaming", "rows_per_s")
    ratio_best = best("indexed") / best("streaming")
    rows = "\n".join(
        f"| {mode} | {best(mode):,.0f} | {med(mode, 'rows_per_s'):,.0f} | "
        f"{med(mode, 'first_s'):.2f} |"
        for mode in ("streaming", "indexed")
    )
    cmd = shlex.join([".venv/bin/python", "benchmarks/parquet_read.py", *argv])
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    per_group = a.rows // (a.files * a.row_groups)
    replay_med, replay_max = statistics.median(replay) * 1e3, max(replay) * 1e3
    return f"""{SECTION}

Generated by `benchmarks/parquet_read.py` on {date} (whole run {took:.0f} s).

Command: `{cmd}`

- Machine: {os.cpu_count()} CPU cores ({platform.machine()}), shared with other jobs while
  it ran (load average {load}); ray {ray.__version__}.
- Data: {a.rows:,} Criteo-shaped rows (13 dense, 26 id lists, label, row id) in
  {a.files} files of {a.row_groups} row groups (~{per_group:,} rows each).
- {a.ranks} rank actors (1 CPU each) plus {a.data_cpus} CPUs for Ray Data's tasks; batches
  of {a.batch_size} rows, converted to torchrec batches in the ranks as in training, with no
  training: the data path alone. Indexed: each rank's own pipeline, {a.concurrency} read
  tasks in flight. {a.repeats} runs of one epoch per mode, the modes taking turns.

| mode | best rows/s | median rows/s | median s to first batch |
|---|---:|---:|---:|
{rows}

- **indexed / streaming: {ratio_med:.2f}x** (medians), {ratio_best:.2f}x (best runs).
- A replay (one batch read again by its id, in the rank's process: open the file, decode
  the row group up to the batch's rows, preprocess, convert): median {replay_med:.0f} ms,
  max {replay_max:.0f} ms over {len(replay)} batches.
"""


if __name__ == "__main__":
    sys.exit(main())
