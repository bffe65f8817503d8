"""Parquet to the ranks through Ray Data: indexed against streaming reads.

    .venv/bin/python -m benchmarks.data_path [--rows 1048576] [--repeats 3] [--write docs/data.md]

Rank actors drain an epoch of Parquet into torchrec batches, the modes taking turns; rows/s over
the slowest rank's wall time, the time to the first batch, and a replay's cost.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks.common import md_table, parse, parser, publish, timed
from raytrec.data.source import BatchShard
from raytrec.data.spec import criteo_spec

#: Ids per table; files, row groups per file, rank actors, CPUs for Ray Data's tasks, rows per
#: batch, indexed read tasks per rank, and replays timed.
VOCAB = 100_000
FILES, ROW_GROUPS, RANKS, DATA_CPUS, BATCH_SIZE, CONCURRENCY, REPLAYS = 8, 4, 2, 2, 512, 2, 20


def drain(shard: BatchShard, batch_size: int) -> dict[str, float]:
    """A rank's feed: every batch of the shard, converted (runs in a rank actor)."""
    torch.set_num_threads(1)
    start, first, rows = time.perf_counter(), None, 0
    for batch in shard.batches(batch_size):
        first = time.perf_counter() - start if first is None else first
        rows += int(batch.labels.shape[0])
    return {"rows": rows, "wall_s": time.perf_counter() - start, "first_s": first or 0.0}


def replay(shard: BatchShard, ids: list[int], batch_size: int) -> list[float]:
    """Seconds to read each batch of ``ids`` again (in a rank actor)."""
    return [timed(functools.partial(shard.replay, i, batch_size))[1] for i in ids]


def parquet(a: argparse.Namespace) -> str:
    import ray

    from raytrec.cluster import connect
    from raytrec.data.generate import write_synthetic_parquet
    from raytrec.data.parquet import ParquetSource
    from raytrec.data.synthetic import batch_id

    class _Rank:
        def call(self, fn: Callable[..., Any], *args: Any) -> Any:
            return fn(*args)

    Rank: Any = ray.remote(num_cpus=1)(_Rank)

    def run(path: str, mode: Any) -> dict[str, float]:
        source = ParquetSource(
            paths=path, spec=criteo_spec(VOCAB), read_mode=mode, read_concurrency=CONCURRENCY
        )
        actors = [Rank.remote() for _ in range(RANKS)]
        ray.get([r.__ray_ready__.remote() for r in actors])  # started before the clock
        pairs = zip(actors, source.split(RANKS), strict=True)
        res = ray.get([r.call.remote(drain, s, BATCH_SIZE) for r, s in pairs])
        for r in actors:
            ray.kill(r)
        rows = sum(x["rows"] for x in res)
        assert rows == a.rows, res
        wall = max(x["wall_s"] for x in res)
        return {"rows_per_s": rows / wall, "first_s": max(x["first_s"] for x in res)}

    runs: dict[str, list[dict[str, float]]] = {"streaming": [], "indexed": []}
    with tempfile.TemporaryDirectory() as tmp:
        write_synthetic_parquet(
            tmp, rows=a.rows, files=FILES, row_groups_per_file=ROW_GROUPS, num_embeddings=VOCAB
        )
        connect(num_cpus=RANKS + DATA_CPUS)
        ray.data.DataContext.get_current().enable_progress_bars = False
        try:
            run(tmp, "indexed")  # warm-up: imports
            for r in range(a.repeats):
                for mode in ("streaming", "indexed")[:: 1 if r % 2 == 0 else -1]:
                    runs[mode].append(run(tmp, mode))
                    print(f"{mode:9s} {runs[mode][-1]['rows_per_s']:>10,.0f} rows/s", flush=True)
            shard: Any = ParquetSource(paths=tmp, spec=criteo_spec(VOCAB)).split(RANKS)[0]
            steps = shard.plan(BATCH_SIZE).num_steps
            ids = [batch_id(k % RANKS, (k * 7) % steps) for k in range(REPLAYS)]
            replay_s = ray.get(Rank.remote().call.remote(replay, shard, ids, BATCH_SIZE))
        finally:
            ray.shutdown()

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    def best(mode: str) -> float:
        return max(r["rows_per_s"] for r in runs[mode])

    ratio = med("indexed", "rows_per_s") / med("streaming", "rows_per_s")
    rows = [
        [m, f"{best(m):,.0f}", f"{med(m, 'rows_per_s'):,.0f}", f"{med(m, 'first_s'):.2f}"]
        for m in ("streaming", "indexed")
    ]
    heads = "mode | best rows/s | median rows/s | median s to first batch"
    return f"""- {a.rows:,} rows in {FILES} files of {ROW_GROUPS} row groups; {RANKS} rank actors \
(1 CPU each) and {DATA_CPUS} CPUs for Ray Data; batches of {BATCH_SIZE} rows; indexed: \
{CONCURRENCY} read tasks per rank; {a.repeats} epochs per mode.

{md_table(heads, rows)}

**indexed / streaming: {ratio:.2f}x** (medians), {best("indexed") / best("streaming"):.2f}x (best \
runs). A replay: median {statistics.median(replay_s) * 1e3:.0f} ms, max \
{max(replay_s) * 1e3:.0f} ms over {len(replay_s)} batches."""


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "data_path", "docs/data.md")
    p.add_argument("--rows", type=int, default=1_048_576, help="rows in all")
    p.add_argument("--repeats", type=int, default=3, help="epochs per mode")
    a = parse(p, argv)
    publish(a, parquet(a), name="data-path-parquet", heading="## Parquet")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
