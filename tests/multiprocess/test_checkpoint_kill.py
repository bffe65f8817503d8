"""A writer killed in the middle of a save leaves the previous checkpoint as the latest.

A rank process (a gang of one) trains 2 steps, saves (committed), records
its full state, trains a third step and starts another save whose storage
writer, once its data file is written and before DCP's metadata, the
manifest or the commit marker exist, reports and then hangs; the test
SIGKILLs the process there. What is left on disk is a hidden, uncommitted
directory holding a data file. Listing must ignore it, and a new rank
process must resume from step 2 with exactly the recorded state, then save
step 3 properly, which also clears the dead save's leftovers.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torchrec.distributed.types import ShardingPlan

from raytrec.checkpoint.errors import CheckpointError
from raytrec.checkpoint.layout import CheckpointStore, read_manifest
from raytrec.checkpoint.state import load_checkpoint, save_checkpoint
from raytrec.config import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ScalingConfig,
    TrainConfig,
    criteo_tables,
)
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.engine.rank_engine import RankEngine, RankSpec, StoreAddress
from simulation.gloo_job import engine_for, make_plan_for, run_gang_job, run_steps

pytestmark = pytest.mark.multiprocess

NUM_DENSE = 13
BATCH = 32
CONFIG = TrainConfig(
    model=ModelConfig(
        tables=criteo_tables(num_features=4, num_embeddings=20_000, embedding_dim=32),
        dense_arch_layers=(32, 32),
        over_arch_layers=(16, 1),
    ),
    optimizer=OptimizerConfig(embedding="rowwise_adagrad", dense="adam"),
    scaling=ScalingConfig(num_workers=1, gang_size=1),
    data=DataConfig(batch_size=BATCH),
    seed=5,
)
SOURCE = SyntheticCriteo(num_sparse=4, num_embeddings=20_000, seed=1)


def full_state(engine: RankEngine) -> dict[str, np.ndarray]:
    """Every tensor of the rank's state (one rank holds every shard whole)."""
    out = {f"w{i}": w.detach().numpy().copy() for i, w in enumerate(engine.embedding_weights())}
    out |= {
        f"s{i}": s.detach().numpy().copy()
        for i, s in enumerate(engine.embedding_optimizer_states())
    }
    out |= {f"d{i}": t.detach().numpy().copy() for i, t in enumerate(engine.dense_state())}
    return out


class HangAfterData(FileSystemWriter):
    """Writes this rank's data file, reports, then hangs before the save can finish."""

    def __init__(self, path: str, flag: str) -> None:
        super().__init__(path)
        self.flag = flag

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        done = super().write_data(plan, planner)
        done.wait()
        Path(self.flag).write_text(str(os.getpid()))
        time.sleep(3600)
        raise AssertionError("not reached: the process is killed while it hangs")


def victim(plan: ShardingPlan, root: str, flag: str, snapshot: str) -> None:
    """A gang of one on its own store: save step 2, then die in the save of step 3."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    spec = RankSpec(
        rank=0,
        gang=0,
        gang_rank=0,
        gang_size=1,
        config=CONFIG,
        plan=plan,
        num_dense=NUM_DENSE,
        store=StoreAddress(host="127.0.0.1", port=store.port),
    )
    with engine_for(spec) as engine:
        batches = SOURCE.split(1)[0].batches(BATCH)
        run_steps(engine, batches, 2)
        save_checkpoint(engine, root, generation=0, extra={"next_step": 2})
        np.savez(snapshot, **full_state(engine))
        run_steps(engine, batches, 1)
        save_checkpoint(
            engine,
            root,
            generation=0,
            extra={"next_step": 3},
            writer_factory=lambda uri: HangAfterData(uri, flag),
        )


def resume(spec: RankSpec, *, root: str) -> dict[str, Any]:
    """Resumes from the latest checkpoint, trains the step the dead save had, saves it."""
    store = CheckpointStore(root)
    with engine_for(spec) as engine:
        before = full_state(engine)
        latest = store.latest()
        assert latest is not None
        loaded = load_checkpoint(engine, latest)
        state = full_state(engine)
        run_steps(
            engine, SOURCE.split(1)[0].batches(BATCH, start_step=loaded.extra["next_step"]), 1
        )
        ref = save_checkpoint(engine, store, generation=1, extra={"next_step": 3})
        return {
            "latest": latest.step,
            "step": loaded.step,
            "extra": dict(loaded.extra),
            "before": before,
            "state": state,
            "saved": ref.step,
        }


def test_killed_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    plan = make_plan_for(CONFIG, NUM_DENSE)
    root, flag, snapshot = str(tmp_path / "ckpt"), str(tmp_path / "flag"), tmp_path / "s2.npz"
    proc = mp.get_context("spawn").Process(
        target=victim, args=(plan, root, flag, str(snapshot)), daemon=True
    )
    proc.start()
    try:
        deadline = time.monotonic() + 180
        while not os.path.exists(flag):
            assert proc.is_alive(), f"the writer exited early (code {proc.exitcode})"
            assert time.monotonic() < deadline, "the writer never reached the second save"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)

    # On disk: step 2 committed; step 3's data file under a hidden name, never committed.
    store = CheckpointStore(root)
    assert [r.step for r in store.committed()] == [2]
    (partial,) = store.uncommitted()
    assert partial.startswith(".checkpoint_0000000003.tmp-")
    left = sorted(p.name for p in Path(root, partial).iterdir())
    assert left == ["__0_0.distcp"] and Path(root, partial, "__0_0.distcp").stat().st_size > 10e6
    with pytest.raises(CheckpointError, match="no commit marker"):
        read_manifest(str(Path(root, partial)))

    result = run_gang_job(
        resume, num_gangs=1, gang_size=1, config=CONFIG, plan=plan, num_dense=NUM_DENSE, root=root
    )[0]
    assert (result["latest"], result["step"], result["extra"]) == (2, 2, {"next_step": 2})
    saved = dict(np.load(snapshot))
    assert saved.keys() == result["state"].keys()
    for key, value in saved.items():
        assert value.dtype == result["state"][key].dtype, key
        assert np.array_equal(value, result["state"][key]), key
    # The fresh engine started elsewhere (so the comparison above can fail).
    assert not np.array_equal(result["before"]["w0"], saved["w0"])
    # The new save of step 3 is committed and the dead one's directory is gone.
    assert result["saved"] == 3
    assert [r.step for r in store.committed()] == [2, 3] and store.uncommitted() == []
