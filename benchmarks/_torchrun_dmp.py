"""Baseline worker: plain TorchRec ``DistributedModelParallel`` under ``torchrun``.

Launched by ``benchmarks/throughput_vs_torchrun.py`` as::

    torchrun --standalone --nproc-per-node T benchmarks/_torchrun_dmp.py --out RESULT.json ...

Every rank builds the same DLRM as a raytrec rank (:func:`raytrec.model.build_dlrm`, the
fused embedding optimizer of :func:`raytrec.engine.plan.apply_embedding_optimizer`, a plan
from :func:`raytrec.engine.plan.make_plan` for all T ranks), wraps it in DMP over the whole
world (so DDP averages dense gradients over all T ranks; there is no replica plane) and
trains on shard ``RANK`` of the same :class:`~raytrec.data.synthetic.SyntheticCriteo`
source. The step is the one :class:`raytrec.engine.rank.RankEngine` runs: next batch from
the shard iterator, forward, backward, dense optimizer step, zero_grad, read the loss.

Timing: ``--warmup-steps`` steps, a barrier, the clock starts, ``--steps - --warmup-steps``
steps, a barrier, the clock stops. Rank 0 writes rows/s (rows trained by all ranks per
wall-clock second of that loop) to ``--out``.

The job's configuration is built by :func:`build_config` here, which the benchmark driver
imports too, so both sides train exactly the same :class:`~raytrec.config.TrainConfig`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from raytrec.config import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ScalingConfig,
    ShardingConfig,
    SyncConfig,
    TrainConfig,
    criteo_tables,
)

__all__ = ["BaselineWorker", "add_model_args", "build_config", "main", "model_argv"]


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags that define the model, data and optimizers (shared with the driver)."""
    p.add_argument("--batch-size", type=int, default=256, help="rows per rank per step")
    p.add_argument("--num-embeddings", type=int, default=10_000, help="rows per table")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--num-tables", type=int, default=26, help="sparse features, one table each")
    p.add_argument("--embedding-optimizer", default="rowwise_adagrad")
    p.add_argument("--dense-optimizer", default="adagrad")
    p.add_argument("--sharding-type", default="table_wise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu", action="store_true", help="CUDA ranks on NCCL, one GPU per rank")


def rank_niceness(text: str) -> int | None:
    """``--rank-niceness``: an integer, or ``ray`` for Ray's default for workers (15)."""
    if text == "ray":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer or 'ray'") from None


def add_rank_niceness_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rank-niceness",
        type=rank_niceness,
        default=0,
        metavar="N|ray",
        help="raytrec's scaling.rank_niceness: the ranks' nice value (raytrec's default 0; "
        "'ray': Ray's 15 for workers)",
    )


def model_argv(a: argparse.Namespace) -> list[str]:
    """``add_model_args`` values back as command-line flags (for the torchrun workers)."""
    return [
        f"--batch-size={a.batch_size}",
        f"--num-embeddings={a.num_embeddings}",
        f"--embedding-dim={a.embedding_dim}",
        f"--num-tables={a.num_tables}",
        f"--embedding-optimizer={a.embedding_optimizer}",
        f"--dense-optimizer={a.dense_optimizer}",
        f"--sharding-type={a.sharding_type}",
        f"--seed={a.seed}",
        *(["--gpu"] if a.gpu else []),
    ]


def build_config(
    a: argparse.Namespace,
    *,
    num_workers: int,
    gang_size: int,
    steps: int,
    log_every: int,
    sync_every: int = 4,
    storage_path: str = "runs",
    name: str = "raytrec",
) -> TrainConfig:
    """The job both sides train (the same shape as ``python -m jobs.train``'s)."""
    return TrainConfig(
        model=ModelConfig(
            tables=criteo_tables(
                num_features=a.num_tables,
                num_embeddings=a.num_embeddings,
                embedding_dim=a.embedding_dim,
            ),
            dense_arch_layers=(64, a.embedding_dim),
        ),
        optimizer=OptimizerConfig(embedding=a.embedding_optimizer, dense=a.dense_optimizer),
        sharding=ShardingConfig(sharding_type=a.sharding_type),
        scaling=ScalingConfig(
            num_workers=num_workers,
            gang_size=gang_size,
            use_gpu=a.gpu,
            rank_niceness=getattr(a, "rank_niceness", 0),
        ),
        sync=SyncConfig(sync_every=sync_every),
        data=DataConfig(batch_size=a.batch_size, read_ahead=getattr(a, "read_ahead", "auto")),
        num_steps=steps,
        log_every=log_every,
        seed=a.seed,
        storage_path=storage_path,
        name=name,
    )


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--steps", type=int, required=True, help="all steps, warmup included")
    p.add_argument("--warmup-steps", type=int, required=True)
    p.add_argument("--log-every", type=int, default=25, help="per-interval timing granularity")
    p.add_argument("--out", required=True, help="rank 0 writes its JSON result here")
    p.add_argument(
        "--marks-file",
        default=None,
        help="rank 0 also appends 'step time.perf_counter()' here every --log-every timed "
        "steps, as it goes (for throughput_turns.py, which pauses and resumes the workers)",
    )
    p.add_argument(
        "--train-pipeline",
        action="store_true",
        help="step with TorchRec's TrainPipelineSparseDist (the next batch's input all-to-all "
        "overlapping this one's compute), fed log_every batches at a time, as a raytrec rank "
        "is; for comparison with the plain loop",
    )
    return p.parse_args(argv)


class BaselineWorker:
    """One rank of the baseline, built once in a process whose default process group is up:
    the DLRM sharded by DMP over the whole world, its dense optimizer and the rank's shard of
    the data. :meth:`step` is one training step. ``benchmarks/ray_hosting.py`` hosts it too."""

    def __init__(self, a: argparse.Namespace, *, device: torch.device) -> None:
        # Imported here so that the driver can import build_config without torchrec/ray.
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.types import ShardingEnv, ShardingPlan
        from torchrec.optim.keyed import KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        from raytrec._quiet import quiet_known_warnings
        from raytrec.api import default_source
        from raytrec.engine.plan import apply_embedding_optimizer, make_plan, sharders
        from raytrec.engine.rank import _DENSE_OPTIMIZERS
        from raytrec.model import build_dlrm

        quiet_known_warnings()
        rank, world = dist.get_rank(), dist.get_world_size()
        cfg = build_config(a, num_workers=world, gang_size=world, steps=1, log_every=1)
        source = default_source(cfg)
        self.device = device
        self.batch_size = cfg.data.batch_size

        model = build_dlrm(cfg.model, source.dense_features, device, cfg.seed)
        apply_embedding_optimizer(model, cfg.optimizer)
        # The same planner call raytrec makes on its driver, here for all T ranks. Rank 0's
        # plan is broadcast so every rank shards identically (what collective_plan does).
        plan_box: list[ShardingPlan | None] = [None]
        if rank == 0:
            plan_box[0] = make_plan(
                model,
                gang_size=world,
                device_type=device.type,
                sharding=cfg.sharding,
                tables=cfg.model.tables,
                batch_size=cfg.data.batch_size,
            )
        dist.broadcast_object_list(plan_box, src=0)
        plan = plan_box[0]
        assert plan is not None
        self.dmp = DistributedModelParallel(
            module=model,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=device,
            plan=plan,
            sharders=sharders(),
        )
        dense_cls = _DENSE_OPTIMIZERS[cfg.optimizer.dense]
        dense_kwargs: dict[str, Any] = {"lr": cfg.optimizer.dense_lr}
        if cfg.optimizer.dense != "sgd":
            dense_kwargs["eps"] = cfg.optimizer.eps
        dense_params = dict(in_backward_optimizer_filter(self.dmp.named_parameters()))
        self.dense_optimizer = KeyedOptimizerWrapper(
            dense_params, lambda ps: dense_cls(ps, **dense_kwargs)
        )
        self.batches = source.split(world)[rank].batches(cfg.data.batch_size)

    def step(self) -> float:
        batch = next(self.batches).to(self.device)
        loss, _ = self.dmp(batch)
        loss.backward()
        self.dense_optimizer.step()
        self.dense_optimizer.zero_grad(set_to_none=False)
        return float(loss.detach())


def main(argv: Sequence[str] | None = None) -> int:
    a = _parse(argv)
    torch.set_num_threads(1)  # what a CPU raytrec rank does (cpus_per_rank=1)
    if a.gpu:  # what a GPU raytrec rank does: its own device, NCCL
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend="nccl" if a.gpu else "gloo")  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    worker = BaselineWorker(a, device=device)
    step = worker.step

    if a.train_pipeline:
        step = _pipelined_step(
            worker.dmp, worker.dense_optimizer, device, worker.batches, a.log_every
        )

    losses: list[float] = []
    for _ in range(a.warmup_steps):
        losses.append(step())
    dist.barrier()
    start = time.perf_counter()
    marks = [start]
    measured = a.steps - a.warmup_steps
    marks_file = open(a.marks_file, "a") if a.marks_file and rank == 0 else None  # noqa: SIM115
    for i in range(measured):
        losses.append(step())
        if (i + 1) % a.log_every == 0 or i + 1 == measured:
            marks.append(time.perf_counter())
            if marks_file is not None:
                marks_file.write(f"{i + 1} {marks[-1]}\n")
                marks_file.flush()
    if marks_file is not None:
        marks_file.close()
    dist.barrier()
    seconds = time.perf_counter() - start

    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, {"rank": rank, "seconds": seconds, "pid": os.getpid()})
    if rank == 0:
        rows = measured * worker.batch_size * world
        result = {
            "system": "torchrun+DMP",
            "world_size": world,
            "batch_size": worker.batch_size,
            "steps": a.steps,
            "warmup_steps": a.warmup_steps,
            "measured_steps": measured,
            "rows": rows,
            "seconds": seconds,
            "rows_per_s": rows / seconds,
            # Rank 0's own time per log_every steps (no barriers), for comparison with
            # raytrec's per-interval rows.
            "interval_seconds": [b - a_ for a_, b in itertools.pairwise(marks)],
            "first_loss": losses[0],
            "final_loss": losses[-1],
            "per_rank": per_rank,
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        }
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _pipelined_step(
    dmp: Any, dense_optimizer: Any, device: torch.device, batches: Any, chunk: int
) -> Any:
    """A step function running TorchRec's TrainPipelineSparseDist. The pipeline is given
    ``chunk`` batches at a time and drains at the end of each chunk, as it would inside a
    raytrec interval (whose batches are prepared before it starts)."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    class DenseStep:  # the pipeline calls zero_grad() and step(); embeddings update in backward
        def zero_grad(self, set_to_none: bool = False) -> None:
            dense_optimizer.zero_grad(set_to_none=False)

        def step(self) -> None:
            dense_optimizer.step()

    pipeline = TrainPipelineSparseDist(dmp, DenseStep(), device, execute_all_batches=True)
    current: list[Any] = [iter(())]
    left = [0]

    def step() -> float:
        if left[0] == 0:
            current[0] = iter([next(batches) for _ in range(chunk)])
            left[0] = chunk
        output = pipeline.progress(current[0])  # DLRMTrain's (loss, logits, labels)
        left[0] -= 1
        return float(output[0])

    return step


if __name__ == "__main__":
    sys.exit(main())
