"""AUC against the oracle, and data wait: one run of the main job's default configuration.

    .venv/bin/python -m benchmarks.auc_vs_oracle [--set KEY=VALUE ...] [--write docs/benchmarks.md]

What each figure counts: docs/benchmarks.md, "AUC against the oracle".
"""

from __future__ import annotations

import glob
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from benchmarks.common import md_table, parse, parser, publish
from jobs.train import build_config
from raytrec.api import Result
from raytrec.config import TrainConfig
from raytrec.data.generate import auc

TARGET_RATIO, TARGET_WAIT = 0.97, 0.05  # of the oracle's AUC; of rank time
TAIL = 4  # intervals averaged for the tail AUC


def oracle_noise(data_path: str, chunk_rows: int) -> tuple[float, float, int, int]:
    """Mean, standard deviation and number of the oracle's AUCs (the teacher's click probabilities
    in generated Parquet, in row order) over whole consecutive chunks, and ``chunk_rows``."""
    import pyarrow.parquet as pq

    files = sorted(glob.glob(os.path.join(data_path, "*.parquet")))
    tables = [pq.read_table(f, columns=["row_id", "click_prob", "label"]) for f in files]
    order = np.argsort(np.concatenate([t.column("row_id").to_numpy() for t in tables]))
    prob = np.concatenate([t.column("click_prob").to_numpy() for t in tables])[order]
    label = np.concatenate([t.column("label").to_numpy() for t in tables])[order]
    n = len(prob) // chunk_rows
    chunks = [slice(i * chunk_rows, (i + 1) * chunk_rows) for i in range(n)]
    values = [auc(prob[c], label[c]) for c in chunks]
    return statistics.fmean(values), statistics.stdev(values), n, chunk_rows


def describe(config: TrainConfig) -> list[str]:
    """The configuration facts that bear on the AUC, one line each (markdown)."""
    m, o, s, d = config.model, config.optimizer, config.scaling, config.data
    sizes = sorted({t.num_embeddings for t in m.tables})
    pooling = "/".join(sorted({t.pooling for t in m.tables}))
    rows = (config.num_steps or 0) * s.world_size * d.batch_size
    return [
        f"- Model: {m.arch}, {len(m.tables)} tables x {'/'.join(f'{n:,}' for n in sizes)} ids x "
        f"dim {m.embedding_dim}, {pooling} pooling; dense arch {list(m.dense_arch_layers)}, "
        f"over arch {list(m.over_arch_layers)}.",
        f"- Optimizers: embeddings {o.embedding} (fused) lr {o.embedding_lr:g}, dense {o.dense} "
        f"lr {o.dense_lr:g}.",
        f"- Job: {s.world_size} ranks ({s.num_gangs} gangs x {s.gang_size}), {d.batch_size} rows "
        f"per rank per step, {config.num_steps} steps = {rows:,} rows trained; replica sync "
        f"every {config.sync.sync_every} steps; a metrics interval is {config.log_every} steps "
        f"= {config.log_every * s.world_size * d.batch_size:,} rows.",
        f"- Data: source {d.source!r}, {d.epochs} epoch(s) "
        + (
            "(one pass: every AUC is out of sample)."
            if d.epochs == 1
            else "(after the first epoch the progressive AUC is in sample; it overstates)."
        ),
    ]


def render(result: Result, wall_s: float, noise: tuple[float, float, int, int] | None) -> list[str]:
    """The verdicts, then one row per interval (markdown). The first interval (start-up, warm
    caches) is left out of the wait and throughput figures and reported on its own."""
    history, oracle = result.history, result.oracle_auc
    aucs = [m.auc for m in history]
    if oracle is None or None in aucs:
        raise SystemExit("auc_vs_oracle: every interval needs an AUC, and the data an oracle's")
    scored = [float(a) for a in aucs if a is not None]
    tail = min(TAIL, len(scored))
    tail_auc = statistics.fmean(scored[-tail:])
    waits = [m.data_wait_fraction for m in history[1:]]
    lines = [
        f"- **Final AUC {scored[-1]:.4f} against the oracle's {oracle:.4f}: "
        f"{scored[-1] / oracle:.3f}** (target >= {TARGET_RATIO}); mean of the last {tail} "
        f"intervals {tail_auc:.4f} = {tail_auc / oracle:.3f} of the oracle.",
        f"- **Data wait: at most {max(waits):.1%} of rank time in any interval after the first, "
        f"{statistics.fmean(waits):.1%} on average** (target < {TARGET_WAIT:.0%}); "
        f"{history[0].data_wait_fraction:.1%} in the first interval. Start-up until every rank "
        f"held its first batch: {result.first_batch_s:.1f} s.",
        f"- Throughput {statistics.fmean(m.samples_per_s for m in history[1:]):,.0f} rows/s "
        f"(intervals after the first); training {history[-1].elapsed_s:.0f} s, the whole "
        f"`fit()` {wall_s:.0f} s including start-up and writing the data.",
    ]
    if noise is not None:
        lines.append(
            f"- Sampling noise of one interval: the oracle's own AUC over {noise[2]} disjoint "
            f"chunks of {noise[3]:,} rows of this data is {noise[0]:.4f} +- {noise[1]:.4f} "
            f"(std), i.e. +- {noise[1] / oracle:.3f} in the ratio."
        )
    rows = []
    for m in history:
        a, ne = m.auc if m.auc is not None else math.nan, m.ne if m.ne is not None else math.nan
        rows.append([m.step, f"{a:.4f}", f"{a / oracle:.3f}", f"{ne:.3f}"])
        rows[-1] += [f"{m.data_wait_fraction:.1%}", f"{m.samples_per_s:,.0f}"]
    heads = "step | AUC | AUC / oracle | NE | data wait | rows/s"
    return [*lines, "", md_table(heads, rows, left=0)]


def main(argv: Sequence[str] | None = None) -> int:
    from raytrec.api import fit

    p = parser(__doc__, "auc_vs_oracle", "docs/benchmarks.md")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="as jobs.train --set"
    )
    a = parse(p, argv)
    with tempfile.TemporaryDirectory(prefix="raytrec-auc-") as tmp:
        overrides = [x for kv in a.set for x in ("--set", kv)]
        config = build_config(["--storage-path", tmp, *overrides])
        print("\n".join(describe(config)), flush=True)
        result = fit(config)
        wall_s = time.perf_counter() - a.started
        path = str(result.data.path)
        interval_rows = config.log_every * config.scaling.world_size * config.data.batch_size
        generated = bool(result.data.path) and os.path.isdir(path)
        noise = oracle_noise(path, interval_rows) if generated else None
    body = "\n".join([*describe(config), *render(result, wall_s, noise)])
    publish(a, body, name="auc-vs-oracle", heading="## AUC against the oracle")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
