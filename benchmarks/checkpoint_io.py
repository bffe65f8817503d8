"""Checkpoint save and load throughput next to the raw write and read speed of the same bytes.

    .venv/bin/python -m benchmarks.checkpoint_io [--tables 8] [--rows 600000] [--repeats 5]

One rank (gloo), its tables and row-wise Adagrad state a few hundred MB; each round, taking
turns, ``save_checkpoint`` against ``write`` + ``fsync``, and ``load_checkpoint`` against
``readinto`` on one thread, cold (files evicted from the page cache) and warm.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import dlrm_job, md_table, parse, parser, publish, rank_engine, timed
from raytrec._quiet import quiet_known_warnings
from raytrec.api import _plan
from raytrec.checkpoint.layout import _fsync_dir, read_manifest
from raytrec.checkpoint.reader import DEFAULT_THREADS, DirectReader
from raytrec.checkpoint.state import load_checkpoint, save_checkpoint
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.engine.rank_engine import RankEngine
from raytrec.models import build_dlrm

NUM_DENSE, MB = 13, 1e6
ROWS = [  # of the table: (operation, its timing, the raw operation, its timing)
    ("save (save_checkpoint)", "save", "raw write (write + fsync)", "raw write"),
    ("load, cold cache (load_checkpoint)", "load cold", "raw read, cold cache", "raw read cold"),
    ("load, warm cache", "load warm", "raw read, warm cache", "raw read warm"),
]


def build_engine(tables: int, rows: int, dim: int) -> tuple[RankEngine, Callable[[], None]]:
    """One rank's engine (gloo) of a DLRM of ``tables`` x ``rows`` x ``dim``, trained a step."""
    config = dlrm_job((tables, rows, dim), batch_size=256, world_size=1)
    engine, close = rank_engine(config, _plan(config, NUM_DENSE, build_dlrm), NUM_DENSE)
    source = SyntheticCriteo(num_sparse=tables, num_embeddings=rows, seed=1)
    engine.train_step(source.make_batch(0, 0, config.data.batch_size))
    return engine, close


def evict(paths: Sequence[Path]) -> None:
    """Drops the files' pages from the page cache (only these files: the machine is shared)."""
    for path in paths:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def raw_write(directory: Path, sizes: dict[str, int], payload: memoryview) -> None:
    """Files of ``sizes`` in ``directory``, made of ``payload`` repeated, written durably."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    for name, size in sizes.items():
        with open(directory / name, "wb") as f:
            for start in range(0, size, len(payload)):
                f.write(payload[: size - start])
            f.flush()
            os.fsync(f.fileno())
    _fsync_dir(str(directory))


def raw_read(paths: Sequence[Path], buffers: dict[Path, bytearray]) -> None:
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            view, got = memoryview(buffers[path]), 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise RuntimeError(f"{path}: short read")
                got += n


def one_round(
    engine: RankEngine, base: Path, payload: memoryview, expected: list[torch.Tensor],
    times: dict[str, list[float]], reader_threads: int,
) -> dict[str, int]:  # fmt: skip
    """Save, raw write, cold and warm load and raw read, in ``base``; returns the file sizes."""
    root, raw_dir = str(base / "checkpoints"), base / "raw"
    ref, seconds = timed(lambda: save_checkpoint(engine, root, generation=0, num_to_keep=1))
    times["save"].append(seconds)
    sizes = dict(read_manifest(ref.uri).files)
    ckpt_files = [Path(ref.uri) / n for n in sizes]
    times["raw write"].append(timed(lambda: raw_write(raw_dir, sizes, payload))[1])
    raw_files = [raw_dir / n for n in sizes]
    buffers = {path: bytearray(path.stat().st_size) for path in raw_files}
    weights = engine.embedding_weights()
    reader = functools.partial(DirectReader, thread_count=reader_threads)
    for temp in ("cold", "warm"):
        if temp == "cold":
            evict(ckpt_files + raw_files)
        with torch.no_grad():
            for w in weights:
                w.zero_()  # the load must bring every table back
        times[f"load {temp}"].append(
            timed(lambda: load_checkpoint(engine, ref, reader_factory=reader))[1]
        )
        for w, e in zip(weights, expected, strict=True):
            assert torch.equal(w, e), "the load did not restore the tables"
        times[f"raw read {temp}"].append(timed(lambda: raw_read(raw_files, buffers))[1])
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "checkpoint_io", "docs/checkpoints.md")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=600_000, help="rows per table")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    threads = f"threads of the checkpoint reader (default on this machine: {DEFAULT_THREADS})"
    p.add_argument("--reader-threads", type=int, default=DEFAULT_THREADS, help=threads)
    a = parse(p, argv)
    quiet_known_warnings()
    torch.set_num_threads(1)
    base = Path(tempfile.mkdtemp(prefix="raytrec-ckpt-bench-"))
    engine, close = build_engine(a.tables, a.rows, a.dim)
    weights = engine.embedding_weights()
    expected = [w.clone() for w in weights]
    payload = weights[0].detach().numpy().view(np.uint8).reshape(-1).data
    times: dict[str, list[float]] = {k: [] for row in ROWS for k in row[1::2]}
    sizes: dict[str, int] = {}
    for _ in range(a.repeats):
        sizes = one_round(engine, base, payload, expected, times, a.reader_threads)
    total = sum(sizes.values())
    state_mb = sum(t.numel() * 4 for t in [*weights, *engine.embedding_optimizer_states()]) / MB
    close()
    shutil.rmtree(base, ignore_errors=True)

    def rates(name: str) -> tuple[float, float]:  # best (the least disturbed round), median
        r = [total / MB / t for t in times[name]]
        return max(r), statistics.median(r)

    threads = f"{a.reader_threads} threads" if a.reader_threads > 1 else "one thread"
    lines = [
        f"- State: {a.tables} tables x {a.rows:,} rows x dim {a.dim} (float32) with row-wise "
        f"Adagrad state, plus a small dense part: {state_mb:.1f} MB of embedding state, "
        f"written as {total / MB:.1f} MB in {len(sizes)} files (one data file per rank of the "
        "writing gang, here one rank; DCP's `.metadata`; `model_spec.json`).",
        f"- Files on the local disk of {os.uname().nodename!r}. The load reads with {threads}, "
        "the raw read with one.",
        f"- {a.repeats} rounds, the methods taking turns; each figure is the checkpoint's bytes "
        "over wall time, the best round (the least disturbed by other jobs) and the median. "
        "Cold: the files were evicted from the page cache (`posix_fadvise(DONTNEED)`) first.",
    ]
    rows = []
    for label, key, raw_label, raw in ROWS:
        (best, median), (raw_best, raw_median) = rates(key), rates(raw)
        rows.append([label, f"{best:,.0f}", f"{median:,.0f}", raw_label, f"{raw_best:,.0f}"])
        rows[-1] += [f"{raw_median:,.0f}", f"{best / raw_best:.2f}", f"{median / raw_median:.2f}"]
    heads = "operation | best MB/s | median MB/s | raw operation | best MB/s | median MB/s | best "
    lines += ["", md_table(heads + "/ raw best | median / raw median", rows)]
    publish(a, "\n".join(lines), name="checkpoint-io", heading="## Save and load throughput")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
