"""AUC against the oracle, and data wait: one run of the main job's default configuration.

    .venv/bin/python -m benchmarks.auc_vs_oracle [--set KEY=VALUE ...] [--write docs/benchmarks.md]

Trains what ``python -m jobs.train`` trains with no arguments (``--set`` adds the job's own
overrides), data and runs in a temporary directory, and reports the final progressive-validation
AUC and the mean of the last ``--tail`` intervals against the oracle's (the teacher's own click
probabilities), the spread of the oracle's AUC over chunks as large as an interval (sampling
noise), the share of rank time spent waiting for data, and rows trained per second.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.common import parse, parser, publish
from jobs.train import build_config
from raytrec.config import TrainConfig
from raytrec.data.generate import auc
from raytrec.metrics import IntervalMetrics
from raytrec.model import ModelFactory, build_dlrm

TARGET_RATIO = 0.97
TARGET_WAIT = 0.05


@dataclasses.dataclass(frozen=True, kw_only=True)
class Summary:
    """The figures one run is judged by (pure data, from the metrics history)."""

    oracle_auc: float
    final_auc: float
    tail_auc: float  # mean AUC of the last `tail` intervals
    tail: int
    wait_max: float  # data-wait share of rank time, intervals after the first
    wait_mean: float
    first_interval_wait: float
    first_batch_s: float
    samples_per_s: float  # mean over intervals after the first
    train_s: float  # from the start of training to the end of the last interval
    wall_s: float  # the whole fit() call, start-up and data generation included

    @property
    def final_ratio(self) -> float:
        return self.final_auc / self.oracle_auc

    @property
    def tail_ratio(self) -> float:
        return self.tail_auc / self.oracle_auc


def summarize(
    history: Sequence[IntervalMetrics],
    *,
    oracle_auc: float,
    first_batch_s: float,
    wall_s: float,
    tail: int,
) -> Summary:
    """Folds a run's history into a :class:`Summary`; the first interval (start-up, warm caches)
    is left out of the wait and throughput figures and reported on its own."""
    if len(history) < 2:
        raise ValueError(f"need at least 2 intervals to leave the first out, got {len(history)}")
    aucs = [m.auc for m in history]
    if any(a is None for a in aucs):
        raise ValueError("every interval needs an AUC; this data source reports none")
    scored = [float(a) for a in aucs if a is not None]
    later = history[1:]
    waits = [m.data_wait_fraction for m in later]
    tail = max(1, min(tail, len(scored)))
    return Summary(
        oracle_auc=oracle_auc,
        final_auc=scored[-1],
        tail_auc=statistics.fmean(scored[-tail:]),
        tail=tail,
        wait_max=max(waits),
        wait_mean=statistics.fmean(waits),
        first_interval_wait=history[0].data_wait_fraction,
        first_batch_s=first_batch_s,
        samples_per_s=statistics.fmean(m.samples_per_s for m in later),
        train_s=history[-1].elapsed_s,
        wall_s=wall_s,
    )


def chunk_auc_spread(
    scores: np.ndarray, labels: np.ndarray, chunk_rows: int
) -> tuple[float, float, int]:
    """Mean and standard deviation of the AUC over consecutive disjoint chunks of
    ``chunk_rows`` rows (a trailing partial chunk is dropped), and the number of chunks."""
    n = len(scores) // chunk_rows
    if n < 2:
        raise ValueError(f"need at least 2 chunks of {chunk_rows} rows, have {len(scores)} rows")
    bounds = [slice(i * chunk_rows, (i + 1) * chunk_rows) for i in range(n)]
    values = [auc(scores[b], labels[b]) for b in bounds]
    return statistics.fmean(values), statistics.stdev(values), n


def oracle_noise(data_path: str, chunk_rows: int) -> tuple[float, float, int]:
    """:func:`chunk_auc_spread` of the teacher's click probabilities in generated Parquet."""
    import pyarrow.parquet as pq

    files = sorted(glob.glob(os.path.join(data_path, "*.parquet")))
    if not files:
        raise FileNotFoundError(f"no Parquet files under {data_path}")
    tables = [pq.read_table(f, columns=["row_id", "click_prob", "label"]) for f in files]
    row_id = np.concatenate([t.column("row_id").to_numpy() for t in tables])
    order = np.argsort(row_id, kind="stable")
    prob = np.concatenate([t.column("click_prob").to_numpy() for t in tables])[order]
    label = np.concatenate([t.column("label").to_numpy() for t in tables])[order]
    return chunk_auc_spread(prob, label, chunk_rows)


def pooling_of(config: TrainConfig, model_factory: ModelFactory) -> str:
    """How the model that ``model_factory`` builds pools each id list (read from the model)."""
    import torch
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    dense = 13 if config.data.num_dense is None else config.data.num_dense
    model = model_factory(config.model, dense, torch.device("cpu"), config.seed)
    kinds = {
        t.pooling.name.lower()
        for m in model.modules()
        if isinstance(m, EmbeddingBagCollection)
        for t in m.embedding_bag_configs()
    }
    return "/".join(sorted(kinds)) or "unknown"


def describe(config: TrainConfig, pooling: str) -> list[str]:
    """The configuration facts that bear on the AUC, one line each (markdown)."""
    m, o, s, d = config.model, config.optimizer, config.scaling, config.data
    sizes = sorted({t.num_embeddings for t in m.tables})
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


def render(
    config: TrainConfig,
    s: Summary,
    history: Sequence[IntervalMetrics],
    noise: tuple[float, float, int] | None,
) -> list[str]:
    """The verdicts, then one row per interval (markdown)."""
    interval_rows = config.log_every * config.scaling.world_size * config.data.batch_size
    lines = [
        f"- **Final AUC {s.final_auc:.4f} against the oracle's {s.oracle_auc:.4f}: "
        f"{s.final_ratio:.3f}** (target >= {TARGET_RATIO}); mean of the last {s.tail} intervals "
        f"{s.tail_auc:.4f} = {s.tail_ratio:.3f} of the oracle.",
        f"- **Data wait: at most {s.wait_max:.1%} of rank time in any interval after the first, "
        f"{s.wait_mean:.1%} on average** (target < {TARGET_WAIT:.0%}); {s.first_interval_wait:.1%} "
        f"in the first interval. Start-up until every rank held its first batch: "
        f"{s.first_batch_s:.1f} s.",
        f"- Throughput {s.samples_per_s:,.0f} rows/s (intervals after the first); training "
        f"{s.train_s:.0f} s, the whole `fit()` {s.wall_s:.0f} s including start-up and writing "
        "the data.",
    ]
    if noise is not None:
        lines.append(
            f"- Sampling noise of one interval: the oracle's own AUC over {noise[2]} disjoint "
            f"chunks of {interval_rows:,} rows of this data is {noise[0]:.4f} +- {noise[1]:.4f} "
            f"(std), i.e. +- {noise[1] / s.oracle_auc:.3f} in the ratio."
        )
    lines += [
        "",
        "| step | AUC | AUC / oracle | NE | data wait | rows/s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for m in history:
        a, ne = m.auc if m.auc is not None else math.nan, m.ne if m.ne is not None else math.nan
        lines.append(
            f"| {m.step} | {a:.4f} | {a / s.oracle_auc:.3f} | {ne:.3f} | "
            f"{m.data_wait_fraction:.1%} | {m.samples_per_s:,.0f} |"
        )
    return lines


def run(
    argv: Sequence[str] | None = None, *, model_factory: ModelFactory = build_dlrm
) -> dict[str, Any]:
    """Parses ``argv``, trains the configuration, prints the report; returns what it measured."""
    from raytrec.api import fit

    p = parser(__doc__, "auc_vs_oracle", "docs/benchmarks.md")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a job config override on top of the defaults (as jobs.train --set)",
    )
    p.add_argument("--storage-path", help="where runs and data go (default: a temporary dir)")
    p.add_argument("--tail", type=int, default=4, help="intervals averaged for the tail AUC")
    a = parse(p, argv)
    with tempfile.TemporaryDirectory(prefix="raytrec-auc-") as tmp:
        job_argv = ["--storage-path", a.storage_path or tmp]
        for kv in a.overrides:
            job_argv += ["--set", kv]
        config = build_config(job_argv)
        pooling = pooling_of(config, model_factory)
        print("\n".join(describe(config, pooling)), flush=True)
        result = fit(config, model_factory=model_factory)
        if result.oracle_auc is None:
            raise SystemExit("auc_vs_oracle: only data.source='generated' records an oracle AUC")
        summary = summarize(
            result.history,
            oracle_auc=result.oracle_auc,
            first_batch_s=result.first_batch_s,
            wall_s=time.perf_counter() - a.started,
            tail=a.tail,
        )
        path = str(result.data.path)
        interval_rows = config.log_every * config.scaling.world_size * config.data.batch_size
        generated = bool(result.data.path) and os.path.isdir(path)
        noise = oracle_noise(path, interval_rows) if generated else None
    factory = (
        [] if model_factory is build_dlrm else [f"- Model built by `{model_factory.__qualname__}`."]
    )
    body = [*describe(config, pooling), *factory, *render(config, summary, result.history, noise)]
    publish(a, "\n".join(body), name="auc-vs-oracle", heading="## AUC against the oracle")
    return {"summary": summary, "noise": noise, "config": config}


def main(argv: Sequence[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
