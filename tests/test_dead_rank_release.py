"""A rank SIGKILLed between its backward and its dense all-reduce releases every survivor at once.

2 gangs x 2 ranks on gloo; replica group 0 = ranks {0, 2}, replica group 1 = ranks {1, 3}. Rank 0
dies at step 3, after the gang's all-to-alls of that step and before its replica-plane
all-reduce of the dense gradients. Rank 2 (its replica peer) sees the failure in that
all-reduce; rank 3's all-reduce (with rank 1, alive) succeeds. Without the gang's agreement
after each replica-plane collective, rank 3 would go on into step 4's all-to-all with rank 2,
which has left training, and wait there until its peer's process ends or the collective
timeout. Survivors keep their processes (as rank actors do) for ``HOLD_S`` after failing, so a
rank that is not released stalls that long.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time
from typing import Any

import numpy as np
import pytest
from gloo_job import engine_for, make_plan_for, run_gang_job

from raytrec.config import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ScalingConfig,
    SyncConfig,
    TrainConfig,
    criteo_tables,
)
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.engine.rank import RankSpec

pytestmark = pytest.mark.multiprocess

NUM_DENSE = 13
BATCH = 32
KILL_STEP = 3  # rank 0 dies in this step (1-based), before its dense all-reduce
HOLD_S = 8.0  # how long a survivor keeps its process after failing
CONFIG = TrainConfig(
    model=ModelConfig(
        tables=criteo_tables(num_features=4, num_embeddings=1000, embedding_dim=8),
        dense_arch_layers=(16, 8),
        over_arch_layers=(8, 1),
    ),
    optimizer=OptimizerConfig(embedding="rowwise_adagrad"),
    scaling=ScalingConfig(num_workers=4, gang_size=2),
    sync=SyncConfig(sync_every=100),
    data=DataConfig(batch_size=BATCH),
    seed=3,
)
SOURCE = SyntheticCriteo(num_sparse=4, num_embeddings=1000, seed=1)


def _train_until_failure(spec: RankSpec, *, killed_file: str) -> dict[str, Any]:
    with engine_for(spec) as engine:
        if spec.rank == 0:
            average = engine._average_dense_grads

            def die_in_step() -> None:
                if engine.step + 1 == KILL_STEP:
                    pathlib.Path(killed_file).write_text(repr(time.monotonic()))
                    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does
                average()

            engine._average_dense_grads = die_in_step  # type: ignore[method-assign]
        batches = SOURCE.split(4)[spec.rank].batches(BATCH)
        failed_at, error = None, ""
        try:
            for _ in range(2 * KILL_STEP):
                engine.train_step(next(batches))
        except Exception as e:
            failed_at, error = time.monotonic(), str(e).splitlines()[0]
        holds = engine.abandon_failed_step()
        grads = [
            None if p.grad is None else p.grad.detach().numpy().copy()
            for p in engine.dense_params.values()
        ]
        time.sleep(HOLD_S)  # the process stays, as a rank actor's does
        return {
            "failed_at": failed_at,
            "error": error,
            "step": engine.step,
            "holds": holds,
            "grads": grads,
        }


def test_a_killed_rank_releases_every_survivor_at_once(tmp_path: pathlib.Path) -> None:
    killed_file = str(tmp_path / "killed")
    out = run_gang_job(
        _train_until_failure,
        num_gangs=2,
        gang_size=2,
        config=CONFIG,
        plan=make_plan_for(CONFIG, NUM_DENSE),
        num_dense=NUM_DENSE,
        timeout_s=120.0,
        may_die=frozenset({0}),
        killed_file=killed_file,
    )
    assert out[0] is None
    killed_at = float(pathlib.Path(killed_file).read_text())
    for rank in (1, 2, 3):
        assert out[rank]["failed_at"] is not None, (rank, out[rank])
        stall = out[rank]["failed_at"] - killed_at
        # Released by a failed collective, not by a peer's process ending (HOLD_S) or the
        # collective timeout.
        assert 0 <= stall < 3.0, (rank, stall, out[rank]["error"])
    # The intact gang (ranks 2 and 3) failed in the same step, and both hold that step's dense
    # gradient as the gang's own (rank 3's average with the lost gang was not written back).
    c, d = out[2], out[3]
    assert (c["step"], d["step"], c["holds"], d["holds"]) == (KILL_STEP, KILL_STEP, True, True)
    for gc, gd in zip(c["grads"], d["grads"], strict=True):
        np.testing.assert_array_equal(gc, gd)
