"""The pipelined step on one GPU: raytrec's rank engine against plain TorchRec.

    .venv/bin/python -m benchmarks.pipeline [--batch-sizes 512,4096,16384] [--run-s 5]
    .venv/bin/python -m benchmarks.pipeline --dcn [--dcn-cap 40000000 --uvm-precision fp16]

How the sides are built, take turns and are paired: docs/benchmarks.md, "The pipelined step on
one GPU". Without a GPU it runs on one CPU rank (a check of this script, no more).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks import common
from raytrec.config import TrainConfig

#: The MLPerf DLRM-DCNv2 (Criteo 1TB) tables' rows, as its reference caps them at 40 million.
MLPERF_ROWS = (
    40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000, 3_067_956,
    405_282, 10, 2_209, 11_938, 155, 4, 976, 14, 40_000_000, 40_000_000, 40_000_000, 590_152,
    12_973, 108, 36,
)  # fmt: skip
CACHE_LOAD_FACTOR = 0.2  # of the UVM-cached tables
SIDES = ("raytrec", "plain")  # raytrec's first: see side()
Interval = Callable[[], None]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = common.parser(__doc__, "pipeline", "docs/benchmarks.md")
    p.add_argument("--steps", type=int, default=400, help="steps a side, warmup included")
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--log-every", type=int, default=25, help="steps per timed interval")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", type=lambda x: common.dims(x, 3), default=(26, 10_000, 16))
    p.add_argument(
        "--batch-sizes", type=lambda x: [int(b) for b in x.split(",")], default=[512, 4096, 16384]
    )
    p.add_argument("--run-s", type=float, default=0.0, help="time more intervals to S s a side")
    p.add_argument("--dcn", action="store_true", help="the MLPerf DCNv2 shapes instead")
    p.add_argument("--dcn-cap", type=int, default=40_000_000, help="rows of the largest")
    p.add_argument("--dcn-batch", type=int, default=8192, help="--dcn: rows per step")
    p.add_argument("--uvm-rows", type=int, default=1_000_000, help="UVM-cache larger tables")
    p.add_argument("--uvm-precision", choices=("fp32", "fp16"), default="fp32")
    a = common.parse(p, argv)
    if a.warmup_steps % a.log_every or (a.steps - a.warmup_steps) % a.log_every:
        p.error("--warmup-steps and --steps - --warmup-steps must be multiples of --log-every")
    return a


def config(a: argparse.Namespace, batch_size: int) -> TrainConfig:
    """One rank with the pipeline, on the GPU if there is one: a DLRM of ``--model``'s tables x
    rows x dim, or with ``--dcn`` MLPerf's DCNv2 shapes."""
    from raytrec.config.model import ModelConfig, criteo_tables

    cfg = common.dlrm_job(
        a.model, batch_size=batch_size, world_size=1, use_gpu=torch.cuda.is_available(),
        train_pipeline="sparse_dist", num_steps=a.steps, log_every=a.log_every,
        storage_path="unused",
    )  # fmt: skip
    if not a.dcn:
        return cfg
    uvm = dict(compute_kernel="fused_uvm_caching", precision=a.uvm_precision)
    rows = [min(n, a.dcn_cap) for n in MLPERF_ROWS]
    tables = tuple(
        t.model_copy(update=uvm | {"cache_load_factor": CACHE_LOAD_FACTOR})
        if t.num_embeddings > a.uvm_rows
        else t
        for t in criteo_tables(num_embeddings=rows, embedding_dim=128)
    )
    model = ModelConfig(
        arch="dlrm_dcn", tables=tables, dense_arch_layers=(512, 256, 128),
        over_arch_layers=(1024, 1024, 512, 256, 1), dcn_num_layers=3, dcn_low_rank_dim=512,
    )  # fmt: skip
    return cfg.replace(model=model)


def check_managed_memory(cfg: TrainConfig) -> None:
    """FBGEMM keeps UVM tables in CUDA managed memory; asking for more of it than the GPU has
    free can hang the GPU on some drivers, so this benchmark does not (fp16 halves it)."""
    managed = sum(
        t.num_embeddings * t.embedding_dim * (2 if t.precision == "fp16" else 4)
        for t in cfg.model.tables
        if t.compute_kernel != "fused"
    )
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 2**40
    if managed > free * (1 - CACHE_LOAD_FACTOR):
        raise SystemExit(
            f"--dcn: the UVM tables take {managed / 2**30:.1f} GiB of managed memory, more than "
            f"the GPU's free {free / 2**30:.1f} GiB less their cache: lower --dcn-cap or use "
            "--uvm-precision fp16"
        )


def side(
    name: str, cfg: TrainConfig, plan: Any, batches: list[Any], every: int
) -> tuple[Interval, Interval]:
    """One side, built: ``(interval, close)``; ``interval()`` trains ``every`` steps and reads
    what that side reads at an interval's end. Build raytrec's first when both are up: plain
    TorchRec's then shares its process group (one rank: nothing to communicate)."""
    import torch.distributed as dist

    from raytrec.engine.rank_engine import StepInput
    from raytrec.engine.stepping import StepResult
    from raytrec.observability.rec_metrics import RankMetrics

    device = torch.device("cuda", 0) if cfg.scaling.use_gpu else torch.device("cpu")
    stream = itertools.cycle(batches)
    num_dense = batches[0].dense_features.shape[1]
    if name == "raytrec":
        engine, close = common.rank_engine(cfg, plan, num_dense)
        trained: list[tuple[int, Any]] = []  # what a rank reports at an interval's end
        inputs = (StepInput(batch) for batch in stream)

        def interval() -> None:
            metrics, losses = RankMetrics(), []
            for event in engine.train_steps(inputs, every):
                if isinstance(event, StepResult):
                    trained.append((event.step, event.batch_id))
                    losses.append(event.loss)
                    metrics.update(event.logits, event.labels)
            torch.stack(losses).tolist()
            metrics.state()
            trained.clear()

        return interval, close

    from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist

    if cfg.scaling.use_gpu:
        torch.cuda.set_device(device)
    own_group = not dist.is_initialized()
    if own_group:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        backend = "nccl" if cfg.scaling.use_gpu else "gloo"
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    dmp, dense = common.plain_torchrec(cfg, num_dense, device, plan)
    pipeline = TrainPipelineSparseDist(dmp, dense, device, execute_all_batches=True)

    def plain_interval() -> None:
        for _ in range(every):
            loss, _, _ = pipeline.progress(stream)
        float(loss)

    def plain_close() -> None:
        if own_group:
            dist.destroy_process_group()

    return plain_interval, plain_close


def timed_intervals(sides: dict[str, Interval], a: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds of each side's timed intervals, the sides taking turns an interval at a time
    (mirrored every other round), after the warmup; at least ``--steps - --warmup-steps`` steps
    a side, and more whole rounds until ``--run-s`` seconds a side have passed."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(a.warmup_steps // a.log_every):
        for interval in sides.values():
            interval()
    sync()
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    rounds, started, least = 0, time.perf_counter(), (a.steps - a.warmup_steps) // a.log_every
    while rounds < least or time.perf_counter() - started < a.run_s * len(sides):
        for name in list(sides)[:: 1 if rounds % 2 == 0 else -1]:
            t0 = time.perf_counter()
            sides[name]()
            sync()
            seconds[name].append(time.perf_counter() - t0)
        rounds += 1
    return seconds


def repeat(
    cfg: TrainConfig, plan: Any, batches: list[Any], a: argparse.Namespace, r: int
) -> tuple[dict[str, list[float]], list[float]]:
    """One repeat: each side's interval seconds, and the paired ratios (per interval; with
    ``--dcn``, of the repeat, each side built alone). Each side is freed before the next."""
    got: dict[str, list[float]] = {}
    for group in [[s] for s in SIDES[:: 1 - 2 * (r % 2)]] if a.dcn else [list(SIDES)]:
        built = {name: side(name, cfg, plan, batches, a.log_every) for name in group}
        try:
            got |= timed_intervals({s: f for s, (f, _) in built.items()}, a)
        finally:
            for name in reversed(group):
                built[name][1]()  # close
            del built  # the last references to the models
            _free()
    if a.dcn:
        return got, [sum(got["plain"]) / sum(got["raytrec"])]
    return got, [x / y for x, y in zip(got["plain"], got["raytrec"], strict=True)]


def runs(a: argparse.Namespace) -> str:
    """Each configuration on both sides, as a table."""
    from raytrec.data.from_config import synthetic_source
    from raytrec.engine.plan import job_plan
    from raytrec.models import build_train_model

    gpu = torch.cuda.is_available()
    memory = torch.cuda.get_device_properties(0).total_memory if gpu else 2**40
    batch_sizes = [a.dcn_batch] if a.dcn else a.batch_sizes
    rows = []
    for b in batch_sizes:
        label, cfg = f"{'DCNv2' if a.dcn else 'DLRM'}, {b:,}", config(a, b)
        if a.dcn:
            check_managed_memory(cfg)
        source = synthetic_source(cfg)
        batches = list(itertools.islice(source.split(1)[0].batches(b), 16))
        batches = [x.pin_memory() if gpu else x for x in batches]
        plan = job_plan(cfg, source.dense_features, build_train_model, device_memory=memory)
        seconds: dict[str, list[float]] = {name: [] for name in SIDES}
        paired, per_repeat = [], []
        for r in range(a.repeats):
            got, pairs = repeat(cfg, plan, batches, a, r)
            paired += pairs
            per_repeat.append(sum(got["plain"]) / sum(got["raytrec"]))
            for s in SIDES:
                seconds[s] += got[s]
            print(f"{label} repeat {r}: raytrec / TorchRec {per_repeat[-1]:.3f}", flush=True)
        rate = {s: a.log_every * b * len(seconds[s]) / sum(seconds[s]) for s in SIDES}
        rates = [f"{rate['plain']:,.0f}", f"{rate['raytrec']:,.0f}"]
        ratios = [f"**{rate['raytrec'] / rate['plain']:.3f}**"]
        ratios.append(common.ratio_ci(paired, ".3f", "({} - {})"))
        rows.append([label, *rates, *ratios, ", ".join(f"{x:.3f}" for x in per_repeat)])
    heads = "model, rows per step | TorchRec + pipeline samples/s | raytrec 1x1 + pipeline "
    heads += "samples/s | raytrec / TorchRec | paired ratio: median (95% CI) | per-repeat ratios"
    return common.md_table(heads, rows)


def _free() -> None:
    """Frees a side's model before the next is built (its pipeline and engine refer to each
    other, so only the collector frees them): two DCNv2 models of 40M-row tables do not fit."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    model, order = (
        "DLRM {} tables x {:,} x {}".format(*a.model),
        f"both sides up, taking turns of one {a.log_every}-step interval; paired: the intervals",
    )
    if a.dcn:
        model = (
            f"DCNv2, the largest tables capped at {a.dcn_cap:,} rows, those over {a.uvm_rows:,} "
            f"rows UVM-cached ({a.uvm_precision}, load factor {CACHE_LOAD_FACTOR:g})"
        )
        order = "each side built alone, the sides in turns; paired: the repeats"
    shape = (
        f"{'One GPU' if torch.cuda.is_available() else 'One CPU rank (no GPU here)'}, "
        f"{a.repeats} repeats of {a.steps} steps a side ({a.warmup_steps} of warmup"
        f"{f', or more, to {a.run_s:g} s a side' if a.run_s else ''}), {order}; {model}"
    )
    name = "pipeline-dcn" if a.dcn else "pipeline"
    common.publish(a, f"- {shape}.\n\n{runs(a)}", name=name, heading=f"## {name}", gpu=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
