"""Training throughput: raytrec ``fit()`` against plain TorchRec DMP under ``torchrun``.

    .venv/bin/python -m benchmarks.throughput [--repeats 20] [--gpu] [--write docs/benchmarks.md]
    .venv/bin/python -m benchmarks.throughput --turns [--rounds 40] [--window-s 12]
    .venv/bin/python -m benchmarks.throughput --pipeline [--batch-sizes 512,4096,16384] [--dcn]

Both train :func:`build_config`'s job, one torch thread per rank: torchrun timed in its workers
between two barriers, raytrec by its coordinator's ``elapsed_s`` after the warmup (Ray's round
trips included). Repeats take turns, mirrored every other repeat, each raytrec run paired with
its repeat's torchrun run. ``--turns`` keeps both up, taking turns of ``--window-s`` (the other
one SIGSTOPped); each raytrec window is compared with the torchrun windows around it.

``--pipeline`` (one GPU) compares the pipelined step: in one process, both up and taking turns
an interval at a time (:func:`pipeline_runs`), raytrec's rank engine
(``RankEngine.train_steps``, the loop a rank actor runs, with
``train_pipeline='sparse_dist'``, its losses and metric states read every ``--log-every`` steps
as a rank reports them) against plain TorchRec (``DistributedModelParallel`` stepped by
``TrainPipelineSparseDist``, its loss read every ``--log-every`` steps), on the same plan and
the same batches, made on the CPU beforehand, at each of ``--batch-sizes``. ``--dcn`` runs the
MLPerf DLRM-DCNv2 shapes instead (26 Criteo tables of dimension 128, the largest capped at
``--dcn-cap`` rows, those over ``--uvm-rows`` rows UVM-cached) at ``--dcn-batch`` rows.
``--profile DIR`` adds one untimed interval of each side under ``torch.profiler``: where their
time differs, printed, and their traces.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, bootstrap_median_ci, dlrm, parse, parser, publish
from raytrec.cluster.local import session_pids, stop_session
from raytrec.config import (
    DataConfig,
    OptimizerConfig,
    ScalingConfig,
    ShardingConfig,
    SyncConfig,
    TrainConfig,
)

FOREVER = 10**8  # steps of a --turns job: this script stops it


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = argparse.ArgumentDefaultsHelpFormatter
    p = parser(__doc__, "throughput", "docs/benchmarks.md", formatter_class=defaults)
    p.add_argument("--world-size", type=int, default=2, help="T: ranks a side; raytrec 1xT, 2xT/2")
    p.add_argument("--steps", type=int, default=400, help="steps per run, warmup included")
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--log-every", type=int, default=25, help="raytrec's metrics interval")
    p.add_argument("--sync-every", type=int, default=4, help="raytrec's embedding sync period")
    p.add_argument("--batch-size", type=int, default=256, help="rows per rank per step")
    p.add_argument("--num-embeddings", type=int, default=10_000, help="rows per table")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--num-tables", type=int, default=26)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu", action="store_true", help="CUDA ranks on NCCL, one GPU per rank")
    p.add_argument(
        "--rank-niceness",
        type=lambda x: None if x == "ray" else int(x),
        default=0,
        metavar="N|ray",
        help="raytrec ranks' nice value; ray: Ray's 15",
    )
    p.add_argument("--read-ahead", choices=("auto", "background", "inline"), default="auto")
    p.add_argument("--repeats", type=int, default=3, help="runs of every configuration")
    p.add_argument("--turns", action="store_true", help="both systems up at once, taking turns")
    p.add_argument("--rounds", type=int, default=40, help="--turns: raytrec windows")
    p.add_argument("--window-s", type=float, default=12.0, help="--turns: seconds per turn")
    p.add_argument("--settle-s", type=float, default=3.0, help="--turns: left out of a window")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--pipeline", action="store_true", help="one GPU: the pipelined step, in turns")
    p.add_argument(
        "--batch-sizes",
        type=lambda x: tuple(int(b) for b in x.split(",")),
        default=(512, 4096, 16384),
        help="--pipeline: rows per step, comma-separated",
    )
    p.add_argument("--dcn", action="store_true", help="--pipeline: the MLPerf DCNv2 shapes instead")
    p.add_argument("--dcn-cap", type=int, default=40_000_000, help="--dcn: rows of the largest")
    p.add_argument("--uvm-rows", type=int, default=1_000_000, help="--dcn: UVM-cache larger ones")
    p.add_argument("--cache-load-factor", type=float, default=0.2, help="--dcn: of UVM tables")
    p.add_argument(
        "--uvm-precision", choices=("fp32", "fp16"), default="fp32", help="--dcn: of UVM tables"
    )
    p.add_argument("--dcn-batch", type=int, default=8192, help="--dcn: rows per step")
    p.add_argument(
        "--run-s",
        type=float,
        default=0.0,
        help="--pipeline: time whole intervals until this many seconds have passed "
        "(at least --steps - --warmup-steps steps)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="--pipeline: also profile one interval of each side per size (first repeat; not "
        "timed) and print where their time differs; Chrome traces into DIR",
    )
    p.add_argument("--torchrun-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--marks-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--driver", type=Path, help=argparse.SUPPRESS)
    a = parse(p, argv)
    t = a.world_size
    a.layouts = [(1, t)] + ([(2, t // 2)] if t % 2 == 0 and not a.turns else [])
    if a.warmup_steps % a.log_every or (a.steps - a.warmup_steps) % a.log_every:
        p.error("--warmup-steps and --steps - --warmup-steps must be multiples of --log-every")
    if a.turns and (a.gpu or not 0 <= a.settle_s < a.window_s / 2):
        p.error("--turns runs CPU ranks, with --settle-s below half of --window-s")
    if a.profile is not None and (not a.pipeline or a.dcn):
        p.error("--profile compares the two sides up at once: --pipeline without --dcn")
    return a


def build_config(a: argparse.Namespace, *, gang_size: int, steps: int, run_dir: str) -> TrainConfig:
    """The job both sides train (the shape of ``python -m jobs.train``'s)."""
    return TrainConfig(
        model=dlrm(a.num_tables, a.num_embeddings, a.embedding_dim),
        optimizer=OptimizerConfig(embedding="rowwise_adagrad", dense="adagrad"),
        sharding=ShardingConfig(sharding_type="table_wise"),
        scaling=ScalingConfig(
            num_workers=a.world_size,
            gang_size=gang_size,
            use_gpu=a.gpu,
            rank_niceness=a.rank_niceness,
        ),
        sync=SyncConfig(sync_every=a.sync_every),
        data=DataConfig(batch_size=a.batch_size, read_ahead=a.read_ahead),
        num_steps=steps,
        log_every=a.log_every,
        seed=a.seed,
        storage_path=run_dir,
        name="throughput",
    )


def torchrun_worker(a: argparse.Namespace) -> int:
    """One torchrun rank: DMP over the whole world, the step a raytrec rank runs (next batch,
    forward, backward with the fused embedding update, dense optimizer step, read the loss)."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from raytrec._quiet import quiet_known_warnings
    from raytrec.api import _plan, default_source
    from raytrec.engine.plan import apply_embedding_optimizer, sharders
    from raytrec.engine.rank_engine import _DENSE_OPTIMIZERS, dense_optimizer_kwargs
    from raytrec.models import build_dlrm

    quiet_known_warnings()
    torch.set_num_threads(1)  # what a CPU raytrec rank does (cpus_per_rank=1)
    device = torch.device("cpu")
    if a.gpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if a.gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = build_config(a, gang_size=world, steps=a.steps, run_dir="unused")
    source = default_source(cfg)
    model = build_dlrm(cfg.model, source.dense_features, device, cfg.seed)
    apply_embedding_optimizer(model, cfg.optimizer)
    plan = [None if rank else _plan(cfg, source.dense_features, build_dlrm)]
    dist.broadcast_object_list(plan, src=0)  # every rank shards alike, as collective_plan does
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    dmp = DistributedModelParallel(model, env, device, plan=plan[0], sharders=sharders())
    dense_cls = _DENSE_OPTIMIZERS[cfg.optimizer.dense]
    kwargs = dense_optimizer_kwargs(cfg.optimizer)
    params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense = KeyedOptimizerWrapper(params, lambda ps: dense_cls(ps, **kwargs))
    batches = source.split(world)[rank].batches(cfg.data.batch_size)

    def step() -> float:
        loss, _ = dmp(next(batches).to(device))
        loss.backward()
        dense.step()
        dense.zero_grad(set_to_none=False)
        return float(loss.detach())

    for _ in range(a.warmup_steps):
        step()
    dist.barrier()
    marks = [time.perf_counter()]
    measured = a.steps - a.warmup_steps
    out = open(a.marks_file, "a") if a.marks_file and rank == 0 else None  # noqa: SIM115
    for i in range(1, measured + 1):
        step()
        if i % a.log_every == 0:
            marks.append(time.perf_counter())
            if out is not None:
                out.write(f"{i} {marks[-1]} {marks[-1]}\n")
                out.flush()
    dist.barrier()
    seconds = time.perf_counter() - marks[0]
    if rank == 0 and a.out:
        intervals = [y - x for x, y in itertools.pairwise(marks)]
        rows = measured * a.batch_size * world
        a.out.write_text(json.dumps({"rows": rows, "seconds": seconds, "intervals": intervals}))
    dist.destroy_process_group()
    return 0


def torchrun_cmd(a: argparse.Namespace, *extra: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node T -m benchmarks.throughput ARGS``"""
    torchrun = f"-m torch.distributed.run --standalone --nproc-per-node={a.world_size} -m"
    worker = [x for x in a.argv if x != "--turns"] + ["--torchrun-worker", *extra]
    return [sys.executable, *torchrun.split(), "benchmarks.throughput", *worker]


def child_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_torchrun(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out = tmp / "torchrun.json"
    cmd = torchrun_cmd(a, f"--out={out}")
    done = subprocess.run(
        cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=a.timeout_s
    )
    if done.returncode or not out.exists():
        raise RuntimeError(f"torchrun exited {done.returncode}:\n{done.stdout[-3000:]}")
    return {"label": "torchrun + DMP", **json.loads(out.read_text())}


def run_raytrec(a: argparse.Namespace, layout: tuple[int, int], tmp: Path) -> dict[str, Any]:
    from raytrec.api import fit

    cfg = build_config(a, gang_size=layout[1], steps=a.steps, run_dir=str(tmp))
    history = fit(cfg, shutdown_ray=False, on_progress=lambda _m: None).history
    skip = a.warmup_steps // a.log_every
    timed = history[skip:]
    steps = sum(m.steps for m in timed)
    if history[skip - 1].step != a.warmup_steps or steps != a.steps - a.warmup_steps:
        raise RuntimeError(f"unexpected metrics history: {[m.step for m in history]}")
    return {
        "label": f"raytrec {layout[0]}x{layout[1]}",
        "rows": steps * a.world_size * a.batch_size,
        "seconds": history[-1].elapsed_s - history[skip - 1].elapsed_s,
        "intervals": [m.seconds for m in timed],
    }


def repeats(a: argparse.Namespace) -> str:
    import ray

    from raytrec.cluster import connect

    runs: list[dict[str, Any]] = []
    for r in range(a.repeats):
        with tempfile.TemporaryDirectory(prefix="rt-throughput-") as tmp:
            order: list[Any] = ["torchrun", *a.layouts]
            for what in order if r % 2 == 0 else order[::-1]:  # mirrored (module doc)
                if what == "torchrun":
                    run = run_torchrun(a, Path(tmp))
                else:
                    if not ray.is_initialized():
                        connect(None, num_cpus=a.world_size)
                    run = run_raytrec(a, what, Path(tmp))
                    if what == a.layouts[-1 if r % 2 == 0 else 0]:
                        ray.shutdown()
                run |= {"repeat": r, "rows_per_s": run["rows"] / run["seconds"]}
                runs.append(run)
                print(f"repeat {r + 1}: {run['label']:<16} {run['rows_per_s']:>10,.0f} rows/s")
    base = {x["repeat"]: x["rows_per_s"] for x in runs if x["label"] == "torchrun + DMP"}
    lines = [
        "| config | rows/s (median) | min - max | median interval rows/s | median over median "
        "| median per-repeat ratio (95% CI) | per-repeat ratios |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for label in dict.fromkeys(x["label"] for x in runs):
        mine = [x for x in runs if x["label"] == label]
        rates = [x["rows_per_s"] for x in mine]
        per = [x["rows"] / len(x["intervals"]) / s for x in mine for s in x["intervals"]]
        ratio = f"**{statistics.median(rates) / statistics.median(base.values()):.3f}**"
        paired = [x["rows_per_s"] / base[x["repeat"]] for x in mine]
        lo, hi = bootstrap_median_ci(paired)
        pair = f"**{statistics.median(paired):.3f}** ({lo:.3f} - {hi:.3f})"
        listed = ", ".join(f"{p:.3f}" for p in paired)
        if label.startswith("torchrun"):
            ratio, pair, listed = "1 (baseline)", "-", "-"
        lines.append(
            f"| {label} | {statistics.median(rates):,.0f} | {min(rates):,.0f} - {max(rates):,.0f} "
            f"| {statistics.median(per):,.0f} | {ratio} | {pair} | {listed} |"
        )
    return "\n".join(lines)


def run_driver(a: argparse.Namespace) -> int:
    """The raytrec job of ``--turns`` (a process of its own): writes 'step elapsed_s
    perf_counter' per metrics row to ``--driver`` until it is stopped."""
    from raytrec.api import fit

    cfg = build_config(a, gang_size=a.layouts[0][1], steps=FOREVER, run_dir=str(a.driver.parent))
    with open(a.driver, "a") as out:

        def progress(m: Any) -> None:
            out.write(f"{m.step} {m.elapsed_s} {time.perf_counter()}\n")
            out.flush()

        fit(cfg, on_progress=progress)
    return 0


class Side:
    """One system: a process in a session of its own, and every process it starts."""

    def __init__(self, cmd: list[str], records: Path) -> None:
        self.records, self.log = records, records.with_suffix(".log")
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=child_env(),
                start_new_session=True,
            )

    def signal(self, sig: int) -> None:
        """Signals every process of the session (a child that re-parented included)."""
        for pid in session_pids(self.proc.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)

    def records_now(self) -> list[tuple[int, float, float]]:
        text = self.records.read_text() if self.records.exists() else ""
        return [(int(s), float(t), float(w)) for s, t, w in (x.split() for x in text.splitlines())]

    def wait_for_step(self, step: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while max((r[0] for r in self.records_now()), default=0) < step:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no step {step}:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop_all(self) -> None:
        self.signal(signal.SIGCONT)  # a stopped process would not see the SIGTERM
        stop_session(self.proc.pid, grace_s=15)


def window_rates(
    records: list[tuple[int, float, float]],
    windows: list[tuple[float, float]],
    rows_per_step: int,
    *,
    gap_s: float,
    settle_s: float,
) -> list[float | None]:
    """rows/s of each window ((start, end) in ``time.perf_counter``) from the records (step, t,
    perf_counter at which the record was written or seen). Records closer than ``gap_s`` in
    ``t`` are one stretch of running, assigned to the window most of its records were seen in;
    its records in the first ``settle_s`` are left out (a side coming back from a pause)."""
    out: list[float | None] = [None] * len(windows)
    stretches: list[list[tuple[int, float, float]]] = []
    for rec in records:
        if not stretches or rec[1] - stretches[-1][-1][1] > gap_s:
            stretches.append([])
        stretches[-1].append(rec)
    for run in stretches:
        run = [r for r in run if r[1] >= run[0][1] + settle_s]
        if len(run) < 3:  # too few whole intervals to time
            continue
        seen_at = statistics.median(r[2] for r in run)
        for i, (start, end) in enumerate(windows):
            if start <= seen_at <= end + gap_s:
                out[i] = (run[-1][0] - run[0][0]) * rows_per_step / (run[-1][1] - run[0][1])
                break
    return out


def turns(a: argparse.Namespace) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="rt-turns-"))
    t_rec, r_rec = tmp / "t.rec", tmp / "r.rec"  # each side's progress records
    forever = ["--steps", str(FOREVER + a.warmup_steps)]
    commands = [
        (torchrun_cmd(a, *forever, f"--marks-file={t_rec}"), t_rec),
        ([sys.executable, "-m", "benchmarks.throughput", *a.argv, f"--driver={r_rec}"], r_rec),
    ]
    sides: list[Side] = []
    windows: dict[int, list[tuple[float, float]]] = {0: [], 1: []}
    try:
        for cmd, records in commands:  # each up and past its warmup, then stopped
            sides.append(Side(cmd, records))
            sides[-1].wait_for_step(a.warmup_steps, a.timeout_s)
            sides[-1].signal(signal.SIGSTOP)
        for i in [0, 1] * a.rounds + [0]:
            sides[i].signal(signal.SIGCONT)
            start = time.perf_counter()
            time.sleep(a.window_s)
            sides[i].signal(signal.SIGSTOP)
            windows[i].append((start, time.perf_counter()))
            print(f"window {len(windows[0]) + len(windows[1])} of {2 * a.rounds + 1}", flush=True)
    finally:
        for side in sides:
            side.stop_all()
    gap_s, per_step = a.window_s / 2, a.world_size * a.batch_size
    t, r = (
        window_rates(s.records_now(), windows[i], per_step, gap_s=gap_s, settle_s=a.settle_s)
        for i, s in enumerate(sides)
    )
    ratios = [x / ((b + c) / 2) for x, b, c in zip(r, t, t[1:], strict=False) if x and b and c]
    if not ratios:
        raise RuntimeError(f"no round timed on both sides; records in {tmp}")
    shutil.rmtree(tmp, ignore_errors=True)  # kept above, where the records explain a failure
    lo, hi = bootstrap_median_ci(ratios)
    t_ok, r_ok = [x for x in t if x], [x for x in r if x]
    return "\n".join(
        [
            "| side | mean window rows/s | median window rows/s |",
            "|---|---:|---:|",
            f"| torchrun + DMP | {statistics.fmean(t_ok):,.0f} | {statistics.median(t_ok):,.0f} |",
            f"| raytrec {a.layouts[0][0]}x{a.layouts[0][1]} | {statistics.fmean(r_ok):,.0f} "
            f"| {statistics.median(r_ok):,.0f} |",
            "",
            f"raytrec / torchrun per round: median **{statistics.median(ratios):.3f}** (95% CI "
            f"{lo:.3f} - {hi:.3f}), raytrec ahead in {sum(x > 1 for x in ratios)} of {len(ratios)} "
            "rounds. Per-round ratios: " + ", ".join(f"{x:.3f}" for x in ratios) + ".",
        ]
    )


#: The MLPerf DLRM-DCNv2 (Criteo 1TB) tables' rows, as its reference caps them at 40 million.
MLPERF_ROWS = (
    40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000, 3_067_956,
    405_282, 10, 2_209, 11_938, 155, 4, 976, 14, 40_000_000, 40_000_000, 40_000_000, 590_152,
    12_973, 108, 36,
)  # fmt: skip


def pipeline_config(a: argparse.Namespace, batch_size: int, *, dcn: bool) -> TrainConfig:
    """One GPU rank with the pipeline: the throughput job's model, or MLPerf's DCNv2 shapes."""
    import torch

    from raytrec.config.model import ModelConfig, criteo_tables

    # Without a GPU the same comparison runs on a CPU rank (a check of this script, no more).
    cfg = build_config(a, gang_size=1, steps=a.steps, run_dir="unused").replace(
        scaling=ScalingConfig(num_workers=1, gang_size=1, use_gpu=torch.cuda.is_available()),
        data=DataConfig(batch_size=batch_size),
        train_pipeline="sparse_dist",
    )
    if not dcn:
        return cfg
    uvm = {
        "compute_kernel": "fused_uvm_caching",
        "cache_load_factor": a.cache_load_factor,
        "precision": a.uvm_precision,
    }
    rows = [min(n, a.dcn_cap) for n in MLPERF_ROWS]
    tables = tuple(
        t.model_copy(update=uvm) if t.num_embeddings > a.uvm_rows else t
        for t in criteo_tables(num_embeddings=rows, embedding_dim=128)
    )
    model = ModelConfig(
        arch="dlrm_dcn", tables=tables, dense_arch_layers=(512, 256, 128),
        over_arch_layers=(1024, 1024, 512, 256, 1), dcn_num_layers=3, dcn_low_rank_dim=512,
    )  # fmt: skip
    return cfg.replace(model=model)


def pipeline_side(
    side: str, cfg: TrainConfig, plan: Any, batches: list[Any], a: argparse.Namespace
) -> tuple[Callable[[], None], Callable[[], None]]:
    """One side, built: ``(interval, close)``. ``interval()`` trains ``a.log_every`` steps and
    reads what that side reads at an interval's end. Build raytrec's side first when both are up:
    plain TorchRec's then shares its process group (one rank: nothing to communicate)."""
    import torch
    import torch.distributed as dist

    from raytrec.engine.rank_engine import RankEngine, RankSpec, StepInput, StoreAddress
    from raytrec.observability.rec_metrics import RankMetrics

    gpu = cfg.scaling.use_gpu
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    stream = itertools.cycle(batches)
    num_dense = batches[0].dense_features.shape[1]
    if side == "raytrec":
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        spec = RankSpec(
            rank=0, gang=0, gang_rank=0, gang_size=1, config=cfg, plan=plan, num_dense=num_dense,
            store=StoreAddress(host="127.0.0.1", port=store.port),
        )  # fmt: skip
        engine = RankEngine(spec)
        engine.build()
        engine.join_replica_plane(generation=0, member_rank=0, size=1)
        trained: list[tuple[int, Any]] = []

        def take() -> StepInput:
            return StepInput(next(stream))

        def begin(item: StepInput) -> None:
            trained.append((engine.step + 1, item.tag))

        def interval() -> None:
            metrics, losses = RankMetrics(), []
            for loss in engine.train_steps(take, a.log_every, begin):
                losses.append(loss)
                assert engine.last_output is not None
                metrics.update(*engine.last_output)
            torch.stack(losses).tolist()
            metrics.state()
            trained.clear()

        def close() -> None:
            engine.close()
            store.set("closed", "1")  # the store's server (this object) lives until here

        return interval, close

    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from raytrec.engine.plan import apply_embedding_optimizer, sharders
    from raytrec.engine.rank_engine import _DENSE_OPTIMIZERS, dense_optimizer_kwargs
    from raytrec.models import build_train_model

    if gpu:
        torch.cuda.set_device(device)
    own_group = not dist.is_initialized()
    if own_group:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        dist.init_process_group("nccl" if gpu else "gloo", store=store, rank=0, world_size=1)
    model = build_train_model(cfg.model, num_dense, device, cfg.seed)
    apply_embedding_optimizer(model, cfg.optimizer)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    dmp = DistributedModelParallel(model, env, device, plan=plan, sharders=sharders())
    dense_cls, kwargs = (
        _DENSE_OPTIMIZERS[cfg.optimizer.dense],
        dense_optimizer_kwargs(cfg.optimizer),
    )
    params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense = KeyedOptimizerWrapper(params, lambda ps: dense_cls(ps, **kwargs))
    pipeline = TrainPipelineSparseDist(dmp, dense, device, execute_all_batches=True)

    def plain_interval() -> None:
        for _ in range(a.log_every):
            loss, _, _ = pipeline.progress(stream)
        float(loss)

    def plain_close() -> None:
        if own_group:
            dist.destroy_process_group()

    return plain_interval, plain_close


def timed_intervals(
    sides: dict[str, Callable[[], None]], a: argparse.Namespace, sync: Callable[[], None]
) -> dict[str, list[float]]:
    """Seconds of each side's timed intervals, the sides taking turns an interval at a time
    (mirrored every other round), after the warmup; at least ``a.steps - a.warmup_steps`` steps
    a side, and more whole rounds until ``a.run_s`` seconds a side have passed."""
    for _ in range(a.warmup_steps // a.log_every):
        for interval in sides.values():
            interval()
    sync()
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    rounds, started = 0, time.perf_counter()
    while rounds < (
        a.steps - a.warmup_steps
    ) // a.log_every or time.perf_counter() - started < a.run_s * len(sides):
        for name in list(sides)[:: 1 if rounds % 2 == 0 else -1]:
            t0 = time.perf_counter()
            sides[name]()
            sync()
            seconds[name].append(time.perf_counter() - t0)
        rounds += 1
    return seconds


def pipeline_runs(a: argparse.Namespace) -> str:
    """Each configuration on both sides, as a table. Both sides are up at once and take turns an
    interval at a time, so that drift of the machine's speed falls on both alike; with ``--dcn``
    two models do not fit at once, so each side trains alone, the sides in turns (mirrored every
    other repeat), each one freed before the next is built."""
    import torch

    from raytrec.data.from_config import synthetic_source
    from raytrec.engine.plan import job_plan
    from raytrec.models import build_train_model

    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    memory = torch.cuda.get_device_properties(0).total_memory if gpu else 2**40
    configs = [(f"DLRM, {b:,}", pipeline_config(a, b, dcn=False)) for b in a.batch_sizes]
    if a.dcn:
        configs = [(f"DCNv2, {a.dcn_batch:,}", pipeline_config(a, a.dcn_batch, dcn=True))]
        # FBGEMM keeps UVM tables in CUDA managed memory; asking for more of it than the GPU has
        # free can hang the GPU on some drivers, so this benchmark does not (fp16 halves it).
        managed = sum(
            t.num_embeddings * t.embedding_dim * (2 if t.precision == "fp16" else 4)
            for t in configs[0][1].model.tables
            if t.compute_kernel != "fused"
        )
        free = torch.cuda.mem_get_info()[0] if gpu else 2**40
        if managed > free * (1 - a.cache_load_factor):
            raise SystemExit(
                f"--dcn: the UVM tables take {managed / 2**30:.1f} GiB of managed memory, more "
                f"than the GPU's free {free / 2**30:.1f} GiB less their cache: lower --dcn-cap "
                "or use --uvm-precision fp16"
            )
    sides = ("raytrec", "plain")  # raytrec's first: see pipeline_side
    lines = [
        "| model, rows per step | TorchRec + pipeline samples/s | raytrec 1x1 + pipeline "
        "samples/s | raytrec / TorchRec | paired ratio: median (95% CI) | per-repeat ratios |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for label, cfg in configs:
        source = synthetic_source(cfg)
        batches = list(itertools.islice(source.split(1)[0].batches(cfg.data.batch_size), 16))
        batches = [b.pin_memory() if gpu else b for b in batches]
        plan = job_plan(cfg, source.dense_features, build_train_model, device_memory=memory)
        rows = a.log_every * cfg.data.batch_size
        seconds: dict[str, list[float]] = {side: [] for side in sides}
        paired, per_repeat = [], []
        for r in range(a.repeats):
            got: dict[str, list[float]] = {}
            if a.dcn:
                for side in sides[:: 1 if r % 2 == 0 else -1]:
                    interval, close = pipeline_side(side, cfg, plan, batches, a)
                    if gpu:  # the UVM tables' caches are in here, their rows are not
                        held = torch.cuda.memory_allocated() / 2**30
                        print(f"{label} {side}: {held:.1f} GiB allocated on the GPU", flush=True)
                    try:
                        got |= timed_intervals({side: interval}, a, sync)
                    finally:
                        close()
                        del interval, close  # the last references to this side's model
                        _free()
                paired.append(sum(got["plain"]) / sum(got["raytrec"]))
            else:
                built = {side: pipeline_side(side, cfg, plan, batches, a) for side in sides}
                try:
                    got = timed_intervals({s: f for s, (f, _) in built.items()}, a, sync)
                    if a.profile is not None and r == 0:
                        profile_sides({s: f for s, (f, _) in built.items()}, label, a.profile)
                finally:
                    for side in reversed(sides):
                        built[side][1]()  # close
                    del built  # the last references to the two models
                    _free()
                paired += [x / y for x, y in zip(got["plain"], got["raytrec"], strict=True)]
            per_repeat.append(sum(got["plain"]) / sum(got["raytrec"]))
            for side in sides:
                seconds[side] += got[side]
            print(
                f"{label} repeat {r}: "
                + ", ".join(f"{s} {rows * len(got[s]) / sum(got[s]):,.0f}" for s in sides)
                + " samples/s",
                flush=True,
            )
        rate = {side: rows * len(seconds[side]) / sum(seconds[side]) for side in sides}
        if len(paired) > 2:
            low, high = bootstrap_median_ci(paired)
            bracket = f"{low:.3f} - {high:.3f}"
        else:  # too few pairs for an interval: their range
            bracket = f"range {min(paired):.3f} - {max(paired):.3f}"
        lines.append(
            f"| {label} | {rate['plain']:,.0f} | {rate['raytrec']:,.0f} | "
            f"**{rate['raytrec'] / rate['plain']:.3f}** | "
            f"{statistics.median(paired):.3f} ({bracket}) | "
            + ", ".join(f"{x:.3f}" for x in per_repeat)
            + " |"
        )
    return "\n".join(lines)


def profile_sides(sides: dict[str, Callable[[], None]], label: str, out: Path) -> None:
    """One interval of each side under ``torch.profiler``: a gzipped Chrome trace of each into
    ``out``, and printed, each side's wall time and totals, and the operators and kernels whose
    own time differs most: device time on a GPU, and CPU time (what a loop bound by its host
    spends)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    out.mkdir(parents=True, exist_ok=True)
    own: dict[str, dict[str, tuple[float, float, int]]] = {}
    for name, interval in sides.items():
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            interval()
            if gpu:
                torch.cuda.synchronize()
            wall = (time.perf_counter() - started) * 1e3
        trace = out / f"{label.lower().replace(',', '').replace(' ', '-')}-{name}.json"
        prof.export_chrome_trace(str(trace))
        with trace.open("rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)  # Perfetto opens .json.gz
        trace.unlink()
        own[name] = {}
        # The kernels' and copies' own events: a CPU operator's device time is its kernels'
        # again, so the total counts only these.
        device = (
            sum(
                e.self_device_time_total
                for e in prof.key_averages()
                if e.device_type != DeviceType.CPU
            )
            / 1e3
        )
        for e in prof.key_averages():
            key = re.sub(r"^## (.*) \d+ ##$", r"## \1 ##", e.key)  # "## forward 152 ##"
            on_device, on_host, count = own[name].get(key, (0.0, 0.0, 0))
            own[name][key] = (
                on_device + e.self_device_time_total / 1e3,
                on_host + e.self_cpu_time_total / 1e3,
                count + e.count,
            )
        launches = sum(c for k, (_, _, c) in own[name].items() if "LaunchKernel" in k)
        host = sum(t for _, t, _ in own[name].values())
        print(
            f"{label} {name}: {wall:.1f} ms wall (profiled), {host:.1f} ms own CPU time, "
            f"{device:.1f} ms in kernels and copies, {launches} kernel launches",
            flush=True,
        )
    ours, plain = own["raytrec"], own["plain"]
    for what, i in (("device", 0), ("CPU", 1))[0 if gpu else 1 :]:
        print(f"{label}: own {what} time, largest differences", flush=True)
        keys = sorted(
            set(ours) | set(plain),
            key=lambda k: -abs(ours.get(k, (0, 0, 0))[i] - plain.get(k, (0, 0, 0))[i]),
        )
        for k in keys[:15]:
            (t1, c1), (t0, c0) = (
                (side.get(k, (0.0, 0.0, 0))[i], side.get(k, (0.0, 0.0, 0))[2])
                for side in (ours, plain)
            )
            print(f"  {k[:70]:70s} raytrec {t1:8.2f} ms x{c1:<5d} plain {t0:8.2f} ms x{c0}")


def _free() -> None:
    """Frees a side's model before the next is built (its pipeline and engine refer to each
    other, so only the collector frees them): two DCNv2 models of 40M-row tables do not fit."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.torchrun_worker:
        return torchrun_worker(a)
    if a.pipeline:
        import torch

        model = (
            f"DCNv2, the largest tables capped at {a.dcn_cap:,} rows, those over {a.uvm_rows:,} "
            f"rows UVM-cached ({a.uvm_precision}, load factor {a.cache_load_factor:g})"
            if a.dcn
            else f"DLRM {a.num_tables} tables x {a.num_embeddings:,} x {a.embedding_dim}"
        )
        timed = f", or more, to {a.run_s:g} s a side" if a.run_s else ""
        order = (
            "each side built alone, the sides in turns; paired: the repeats"
            if a.dcn
            else f"both sides up, taking turns of one {a.log_every}-step interval; paired: "
            "the intervals"
        )
        rank = "One GPU" if torch.cuda.is_available() else "One CPU rank (no GPU here)"
        shape = (
            f"{rank}, {a.repeats} repeats of {a.steps} steps a side ({a.warmup_steps} of "
            f"warmup{timed}), {order}; {model}"
        )
        table = pipeline_runs(a)
        name = "throughput-pipeline-dcn" if a.dcn else "throughput-pipeline"
        publish(a, f"- {shape}.\n\n{table}", name=name, heading=f"## {name}", gpu=True)
        return 0
    if a.driver:
        return run_driver(a)
    table = turns(a) if a.turns else repeats(a)
    shape = (
        f"T = {a.world_size} ranks a side, batch {a.batch_size} per rank, DLRM {a.num_tables} "
        f"tables x {a.num_embeddings:,} x {a.embedding_dim}, raytrec ranks at nice "
        f"{'15 (Ray)' if a.rank_niceness is None else a.rank_niceness}; "
        + (
            f"{a.rounds} rounds of {a.window_s:g} s windows, {a.settle_s:g} s settling left out."
            if a.turns
            else f"{a.steps} steps per run, {a.warmup_steps} of warmup, {a.repeats} repeats."
        )
    )
    name = "throughput-turns" if a.turns else "throughput-gpu" if a.gpu else "throughput-cpu"
    publish(a, f"- {shape}\n\n{table}", name=name, heading=f"## {name}", gpu=a.gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
