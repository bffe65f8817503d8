"""Delta size and publish time against a full export, at several shares of rows touched.

    .venv/bin/python -m benchmarks.serving_deltas [--tables 8] [--rows 250000] [--dim 32]

One process, no Ray: a DLRM with random weights saved as a job saves its final model. Each
round, taking turns: ``raytrec.export`` of it (``program=False``: the state dict and
``model.json``), and, per share of rows touched, a delta of that share of every table's rows
(random ids) and the dense state, published with ``DeltaWriter`` beside a base export. The
stall is what training waits for: copying the touched rows out of the tables and the call to
``publish`` (it copies them); the publish time runs until the delta is durable (written,
fsynced, checksummed, renamed).
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torchrec.models.dlrm import DLRMTrain

from benchmarks.common import dlrm, md_table, parse, parser, publish, timed
from raytrec._quiet import quiet_known_warnings
from raytrec.config import TrainConfig
from raytrec.models import build_dlrm_model
from raytrec.serving.deltas import DeltaWriter
from raytrec.serving.export import base_id, export
from raytrec.serving.model_spec import ModelSpec, write_model_spec

NUM_DENSE, MB = 13, 1e6
SHARES = (0.01, 0.05, 0.25)


def saved_model(root: Path, tables: int, rows: int, dim: int) -> tuple[DLRMTrain, Path]:
    """A DLRM with random weights, saved as a job saves its final model (DCP and its spec)."""
    config = TrainConfig(model=dlrm(tables, rows, dim))
    model = DLRMTrain(
        build_dlrm_model(
            config.model, NUM_DENSE, torch.device("cpu"), 0, embedding_device=torch.device("cpu")
        )
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    path = root / "final_model"
    dcp.save(model.state_dict(), checkpoint_id=str(path), no_dist=True)
    write_model_spec(str(path), ModelSpec.for_config(config, NUM_DENSE))
    return model, path


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, "serving_deltas", "docs/serving.md")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=250_000, help="rows per table")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    a = parse(p, argv)
    quiet_known_warnings()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="raytrec-delta-bench-"))
    g = torch.Generator().manual_seed(0)
    try:
        model, final = saved_model(root, a.tables, a.rows, a.dim)
        state = model.model.state_dict()
        tables = {k: v for k, v in state.items() if "embedding_bags" in k}
        dense = {k: v for k, v in state.items() if "embedding_bags" not in k}
        base = root / "base"
        export(str(final), base, program=False, quiet=True)
        writer = DeltaWriter(str(base), base_id(base))
        full_s: list[float] = []
        full_bytes = 0
        stall: dict[float, list[float]] = {s: [] for s in SHARES}
        publish_s: dict[float, list[float]] = {s: [] for s in SHARES}
        delta_bytes: dict[float, int] = {}
        for r in range(a.repeats):
            out = root / f"full_{r}"
            _, took = timed(functools.partial(export, str(final), out, program=False, quiet=True))
            full_s.append(took)
            full_bytes = size(out)
            shutil.rmtree(out)
            for share in SHARES:
                n = int(share * a.rows)
                ids = {k: torch.randperm(a.rows, generator=g)[:n] for k in tables}
                start = time.perf_counter()
                rows = {
                    k: (i, t.index_select(0, i))
                    for (k, t), i in zip(tables.items(), ids.values(), strict=True)
                }
                seq = writer.publish(r + 1, rows, dense)
                stall[share].append(time.perf_counter() - start)
                writer.wait()
                publish_s[share].append(time.perf_counter() - start)
                delta_bytes[share] = size(base / "deltas" / f"{seq:06d}")
        full_median = statistics.median(full_s)
        table_rows = []
        for share in SHARES:
            median = statistics.median(publish_s[share])
            table_rows.append([
                f"{share:.0%}", f"{int(share * a.rows):,}", f"{delta_bytes[share] / MB:.1f}",
                f"{full_bytes / MB:.1f}", f"{full_bytes / delta_bytes[share]:.1f}x",
                f"{median:.2f}", f"{full_median:.2f}", f"{full_median / median:.1f}x",
                f"{statistics.median(stall[share]) * 1e3:.0f}",
            ])  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    heads = (
        "rows touched | rows per table | delta MB | full export MB | fewer bytes | publish s "
        "| full export s | less time | stall ms"
    )
    lines = [
        f"- Model: DLRM, {a.tables} tables x {a.rows:,} rows x dim {a.dim} (float32); files on "
        f"the local disk of {os.uname().nodename!r}; medians of {a.repeats} rounds.",
        "- Full export: `raytrec.export(final_model, dir, program=False)` (reads the DCP save, "
        "writes `model.pt` and `model.json`, no fsync). Publish: a delta written, fsynced, "
        "checksummed and renamed into place. Stall: copying the touched rows out of the tables "
        "and `DeltaWriter.publish` returning (it copies rows and dense state).",
        "",
        md_table(heads, table_rows),
    ]
    publish(a, "\n".join(lines), name="serving-deltas", heading="## Delta size and publish time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
