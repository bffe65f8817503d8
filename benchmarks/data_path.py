"""The data path: Arrow record batches to torchrec batches on one core, and Parquet to ranks
through Ray Data (indexed against streaming reads).

    .venv/bin/python -m benchmarks.data_path --part kjt [--rows 8192] [--repeats 15]
    .venv/bin/python -m benchmarks.data_path --part parquet [--rows 1048576] [--ranks 2]

``kjt``: :func:`raytrec.data.arrow_kjt.to_batch` against a copy floor (``np.copy`` of every
buffer it reads) and a per-row Python collate, the best pass in the thread's CPU time.
``parquet``: ``--ranks`` rank actors drain an epoch of Parquet into torchrec batches; rows/s over
the slowest rank's wall time, the time to the first batch, and a replay's cost. Modes and
methods take turns.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from benchmarks.common import parse, parser, publish, timed
from raytrec.data.generate import batch_to_table
from raytrec.data.source import Batch, BatchShard
from raytrec.data.spec import FeatureSpec, criteo_spec
from raytrec.data.synthetic import SyntheticCriteo

VOCAB = 100_000
BATCHES, ROW_REPEATS = 4, 2  # kjt: record batches per pass; passes of the per-row collate
#: parquet: files, row groups per file, rank actors, CPUs for Ray Data's tasks, rows per batch,
#: indexed read tasks per rank, and replays timed
FILES, ROW_GROUPS, RANKS, DATA_CPUS, BATCH_SIZE, CONCURRENCY, REPLAYS = 8, 4, 2, 2, 512, 2, 20


def make_record_batch(source: SyntheticCriteo, step: int, rows: int) -> pa.RecordBatch:
    """A synthetic batch as Criteo-shaped Parquet holds it (the teacher's column left out)."""
    batch = source.make_batch(0, step, rows)
    table = batch_to_table(batch, row_id_start=step * rows, click_prob=np.zeros(rows))
    return table.drop_columns(["click_prob"]).to_batches()[0]


def buffers(rb: pa.RecordBatch, spec: FeatureSpec) -> list[np.ndarray]:
    """Views of every buffer to_batch reads: what the copy floor copies."""
    out: list[np.ndarray] = []
    for name in spec.required_columns():
        arr = rb.column(name)
        if isinstance(arr, pa.ListArray):
            offsets = arr.offsets.to_numpy()
            out.append(offsets)
            out.append(arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])).to_numpy())
        else:
            out.append(arr.to_numpy())
    return out


def per_row_collate(rb: pa.RecordBatch, spec: FeatureSpec) -> Batch:
    """The straightforward way: Python rows, Python lists, then tensors."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys, sizes = spec.sparse_names, spec.num_embeddings
    dense, labels = [], []
    lengths: list[list[int]] = [[] for _ in keys]
    values: list[list[int]] = [[] for _ in keys]
    for row in rb.to_pylist():
        dense.append([row[c] for c in spec.dense])
        labels.append(row["label"])
        for k, key in enumerate(keys):
            ids = row[key] or []
            lengths[k].append(len(ids))
            values[k].extend(i % sizes[k] for i in ids)
    kjt = KeyedJaggedTensor(
        keys=list(keys),
        values=torch.tensor([v for vs in values for v in vs], dtype=torch.int64),
        lengths=torch.tensor([n for ns in lengths for n in ns], dtype=torch.int32),
        stride=len(labels),
    )
    return Batch(torch.tensor(dense), kjt, torch.tensor(labels))


def kjt(a: argparse.Namespace) -> str:
    from raytrec.data.arrow_kjt import to_batch

    torch.set_num_threads(1)
    source = SyntheticCriteo(mean_length=3.0, num_embeddings=VOCAB)
    rbs = [make_record_batch(source, s, a.rows) for s in range(BATCHES)]
    spec = criteo_spec(num_embeddings=VOCAB)
    spec_mod = criteo_spec(num_embeddings=97, id_policy="modulo")  # ids >= 97 in every feature
    spec_hash = criteo_spec(num_embeddings=VOCAB, id_policy="hash")
    bufs = [buffers(rb, spec) for rb in rbs]
    id_views = [[rb.column(f"cat_{f}").values.to_numpy() for f in range(26)] for rb in rbs]
    for s in (spec, spec_mod):  # the per-row collate is the reference: to_batch must agree
        x, y = to_batch(rbs[0], s)[0], per_row_collate(rbs[0], s)
        for t, u in [(x.dense_features, y.dense_features), (x.labels, y.labels)]:
            assert torch.equal(t, u)
        assert torch.equal(x.sparse_features.values(), y.sparse_features.values())

    def each(fn: Callable[[pa.RecordBatch], object]) -> Callable[[], object]:
        return lambda: [fn(rb) for rb in rbs]

    floor = "copy floor: np.copy of each buffer read"
    methods: list[tuple[str, Callable[[], object]]] = [  # the slow per-row collate last
        (floor, lambda: [np.copy(b) for bs in bufs for b in bs]),
        (
            "(for scale) np.concatenate of the 26 id arrays",
            lambda: [np.concatenate(v) for v in id_views],
        ),
        ("to_batch, ids in range", each(lambda rb: to_batch(rb, spec))),
        ("to_batch, ids need modulo", each(lambda rb: to_batch(rb, spec_mod))),
        ("to_batch, id_policy=hash", each(lambda rb: to_batch(rb, spec_hash))),
        ("per-row Python collate", each(lambda rb: per_row_collate(rb, spec))),
    ]
    best = {name: (math.inf, math.inf) for name, _ in methods}
    for _, fn in methods:
        fn()  # warm up (allocator, caches, lazy imports)
    for r in range(a.repeats):  # the methods take turns: a load change hits them alike
        for name, fn in methods[: None if r < ROW_REPEATS else -1]:
            c0, w0 = time.thread_time(), time.perf_counter()
            fn()
            c, w = time.thread_time() - c0, time.perf_counter() - w0
            best[name] = (min(best[name][0], c / BATCHES), min(best[name][1], w / BATCHES))
    mib = sum(b.nbytes for bs in bufs for b in bs) / BATCHES / 2**20
    lines = [
        f"- {BATCHES} record batches x {a.rows:,} rows, {mib:.2f} MiB of Arrow buffers read "
        f"per batch; best of {a.repeats} passes ({ROW_REPEATS} for the per-row collate); "
        f"pyarrow {pa.__version__}, numpy {np.__version__}.",
        "",
        "| method | rows/s per core | CPU µs / batch | wall µs / batch | CPU time / copy floor |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, (cpu, wall) in best.items():
        lines.append(
            f"| {name} | {a.rows / cpu:,.0f} | {cpu * 1e6:,.0f} | {wall * 1e6:,.0f} | "
            f"{cpu / best[floor][0]:.2f}x |"
        )
    fast = best["to_batch, ids in range"][0]
    lines += [
        "",
        f"**to_batch / copy floor: {fast / best[floor][0]:.2f}x** (target <= 3x); **per-row "
        f"collate / to_batch: {best['per-row Python collate'][0] / fast:.0f}x** (target >= 20x).",
    ]
    return "\n".join(lines)


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
    lines = [
        f"- {a.rows:,} rows in {FILES} files of {ROW_GROUPS} row groups; {RANKS} rank "
        f"actors (1 CPU each) and {DATA_CPUS} CPUs for Ray Data; batches of {BATCH_SIZE} "
        f"rows; indexed: {CONCURRENCY} read tasks per rank; {a.repeats} epochs per mode.",
        "",
        "| mode | best rows/s | median rows/s | median s to first batch |",
        "|---|---:|---:|---:|",
        *(
            f"| {m} | {best(m):,.0f} | {med(m, 'rows_per_s'):,.0f} | {med(m, 'first_s'):.2f} |"
            for m in ("streaming", "indexed")
        ),
        "",
        f"**indexed / streaming: {ratio:.2f}x** (medians), "
        f"{best('indexed') / best('streaming'):.2f}x (best runs). A replay: median "
        f"{statistics.median(replay_s) * 1e3:.0f} ms, max {max(replay_s) * 1e3:.0f} ms over "
        f"{len(replay_s)} batches.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "data_path", "docs/benchmarks.md (kjt), docs/data.md (parquet)")
    p.add_argument("--part", choices=("kjt", "parquet"), required=True)
    p.add_argument("--rows", type=int, help="rows per record batch (kjt: 8192) or in all (1048576)")
    p.add_argument("--repeats", type=int, help="kjt: timed passes (15); parquet: epochs (3)")
    a = parse(p, argv)
    is_kjt = a.part == "kjt"
    a.rows = a.rows or (8192 if is_kjt else 1_048_576)
    a.repeats = a.repeats or (15 if is_kjt else 3)
    table = kjt(a) if is_kjt else parquet(a)
    publish(a, table, name=f"data-path-{a.part}", heading=f"## {a.part}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
