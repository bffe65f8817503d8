"""What needs two or more GPUs: NCCL replica groups of two, gangs of two GPU ranks.

The GPU cases are skipped unless the host has at least 2 CUDA devices (4 for the 2 x 2 job);
run them with ``pytest -m gpu tests/gpu/test_gpu_multi.py`` (docs/gpu.md). The same test with CPU
ranks on gloo (2 x 2) runs everywhere, so that this code keeps up with the engine where CI
cannot reach a GPU. Each rank is a spawned process that
sees only its own GPU (``CUDA_VISIBLE_DEVICES``, as Ray sets it for a rank actor) and trains on
NCCL. For each layout, tests/multiprocess/test_pipeline.py's scenario runs with
``train_pipeline='off'`` and
``'sparse_dist'``, with and without a failed step holding batches in flight:

* the pipelined runs train what the synchronous ones train (``torch.testing.assert_close``);
* every batch is trained exactly once, the failed step's in-flight batches left unstarted;
* after the last sync, rank k of every gang holds the same shards as rank k of every other
  gang (the replica groups' NCCL average and the gangs' NCCL all-to-alls agree; a job of one
  gang has no replica group of two), and every rank of the job holds the same dense
  parameters (inside a gang, the gang's NCCL all-reduce of dense gradients).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any

import numpy as np
import pytest
import torch  # noqa: F401 (the skip conditions below are evaluated in this namespace)
from test_engine_2d import NUM_DENSE, SOURCE, job_config
from test_pipeline import FAIL_AT, RUNS, STEPS, _assert_same_run, _train

from raytrec.config import ScalingConfig, TrainConfig
from raytrec.engine.plan import job_plan
from raytrec.engine.rank_engine import RankEngine, RankSpec
from raytrec.models import build_train_model
from simulation.gloo_job import run_gang_job


def gpus(n: int) -> pytest.MarkDecorator:
    # A condition as a string: pytest evaluates it when it collects, in its own process. The
    # rank processes import this module too, and must not touch CUDA before they pick their GPU.
    return pytest.mark.skipif(f"torch.cuda.device_count() < {n}", reason=f"needs {n} CUDA devices")


CASES = [
    # an NCCL replica group of two gangs of one
    pytest.param((2, 1), True, marks=[pytest.mark.gpu, gpus(2)], id="gpu-2x1"),
    # one gang of two GPU ranks: NCCL all-to-alls
    pytest.param((1, 2), True, marks=[pytest.mark.gpu, gpus(2)], id="gpu-1x2"),
    pytest.param((2, 2), True, marks=[pytest.mark.gpu, gpus(4)], id="gpu-2x2"),
    pytest.param((2, 2), False, marks=pytest.mark.multiprocess, id="cpu-2x2"),
]


def config_for(num_gangs: int, gang_size: int, *, use_gpu: bool) -> TrainConfig:
    scaling = ScalingConfig(num_workers=num_gangs * gang_size, gang_size=gang_size, use_gpu=use_gpu)
    return job_config(embedding="rowwise_adagrad", sync_every=3, scaling=scaling)


def multi_gpu_job(spec: RankSpec, stores: list[Any]) -> dict[Any, Any]:
    if spec.config.scaling.use_gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(spec.rank)  # before this process touches CUDA
    world = spec.config.scaling.world_size
    batches = list(itertools.islice(SOURCE.split(world)[spec.rank].batches(8), STEPS))
    out = {}
    for (pipeline, fail), store in zip(RUNS, [spec.store, *stores], strict=True):
        run = dataclasses.replace(
            spec, config=spec.config.replace(train_pipeline=pipeline), store=store
        )
        engine = RankEngine(run)
        try:
            engine.build()
            engine.join_replica_plane(
                generation=0, member_rank=spec.gang, size=spec.config.scaling.num_gangs
            )
            report = _train(engine, batches, fail=fail)
            engine.sync()  # one more job-wide sync: every replica group identical
            shards = [
                t.detach().cpu().float().numpy()
                for t in engine.embedding_weights() + engine.embedding_optimizer_states()
            ]
            dense = [t.detach().cpu().float().numpy() for t in engine.dense_state()]
            out[pipeline, fail] = report | {
                "synced": shards,
                "dense": dense,
                "device": str(engine.device),
            }
        finally:
            engine.close()
    return out


@pytest.mark.parametrize(("layout", "use_gpu"), CASES)
def test_pipelined_2d_training_on_several_ranks(layout: tuple[int, int], use_gpu: bool) -> None:
    num_gangs, gang_size = layout
    config = config_for(num_gangs, gang_size, use_gpu=use_gpu)
    results = run_gang_job(
        multi_gpu_job,
        num_gangs=num_gangs,
        gang_size=gang_size,
        config=config,
        plan=job_plan(config, NUM_DENSE, build_train_model),
        num_dense=NUM_DENSE,
        timeout_s=600.0,
        extra_stores=len(RUNS) - 1,
    )
    for rank, runs in results.items():
        assert runs["off", False]["device"] == ("cuda:0" if use_gpu else "cpu")
        for fail in (False, True):
            plain, piped = runs["off", fail], runs["sparse_dist", fail]
            assert plain["started"] == piped["started"] == list(range(STEPS)), (rank, fail)
            _assert_same_run(plain, piped)
        assert runs["sparse_dist", True]["unstarted"] == [FAIL_AT, FAIL_AT + 1]
    world = num_gangs * gang_size
    assert sorted(results) == list(range(world))
    # Rank k of gang g is job rank g * gang_size + k: the same shard in every other gang.
    replicas = [(r, p) for r in results for p in range(r % gang_size, world, gang_size) if p != r]
    assert len(replicas) == world * (num_gangs - 1)
    for key in RUNS:
        for rank, peer in replicas:
            mine, theirs = results[rank][key]["synced"], results[peer][key]["synced"]
            assert len(mine) == len(theirs) > 0, (rank, peer)
            for a, b in zip(mine, theirs, strict=True):
                np.testing.assert_array_equal(a, b)
        first = results[0][key]["dense"]
        assert first, "the model has dense parameters"
        for rank in range(1, world):
            for a, b in zip(first, results[rank][key]["dense"], strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"dense state of rank {rank}")
