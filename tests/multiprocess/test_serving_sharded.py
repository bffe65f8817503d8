"""Export from a gang whose tables are cut in column blocks across two ranks (gloo).

One gang of 2 ranks trains a DLRM-DCN 3 steps with every table column-wise (two 128-column
shards, one per rank), saves a checkpoint and the final model the way a job does, and scores a
probe batch with the sharded model. The test assembles each full table from the ranks' own
shards and finds it bit for bit in both exports, and finds the sharded model's logits in the
loaded model's (within 1e-5: the sharded forward sums pooled embeddings in another order).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor

from raytrec.checkpoint.state import save_checkpoint
from raytrec.config import (
    DataConfig,
    ModelConfig,
    ScalingConfig,
    ShardingConfig,
    TableConfig,
    TrainConfig,
)
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.engine.rank_engine import RankSpec
from raytrec.serving.export import STATE_FILE, export, load_model
from raytrec.serving.model_spec import ModelSpec, write_model_spec
from simulation.gloo_job import engine_for, make_plan_for, run_gang_job, run_steps

pytestmark = pytest.mark.multiprocess

NUM_DENSE = 4
BATCH = 8
DIM = 256  # the planner cuts column-wise shards in 128-column blocks
SIZES = (16, 24, 32, 20)
SOURCE = SyntheticCriteo(
    num_dense=NUM_DENSE, num_sparse=4, num_embeddings=SIZES, mean_length=2.5, seed=7
)
CONFIG = TrainConfig(
    model=ModelConfig(
        arch="dlrm_dcn",
        tables=tuple(
            TableConfig(name=f"t{i}", num_embeddings=n, embedding_dim=DIM, features=(f,))
            for i, (n, f) in enumerate(zip(SIZES, SOURCE.sparse_features, strict=True))
        ),
        dense_arch_layers=(16, DIM),
        over_arch_layers=(8, 1),
        dcn_low_rank_dim=4,
    ),
    sharding=ShardingConfig(sharding_type="column_wise"),
    scaling=ScalingConfig(num_workers=2, gang_size=2),
    data=DataConfig(batch_size=BATCH, num_dense=NUM_DENSE),
    seed=3,
)
PROBE_STEP = 50  # a batch the gang never trained on


def worker(spec: RankSpec, *, root: str, final: str) -> dict[str, Any]:
    with engine_for(spec) as engine:
        run_steps(engine, SOURCE.split(2)[spec.rank].batches(BATCH), 3)
        save_checkpoint(engine, root, generation=0)
        # What RankWorker.save writes for the final model.
        dcp.save(engine.model.state_dict(), checkpoint_id=final)
        if spec.gang_rank == 0:
            write_model_spec(final, ModelSpec.for_config(spec.config, spec.num_dense))
        probe = next(SOURCE.split(2)[spec.rank].batches(BATCH, start_step=PROBE_STEP))
        with torch.no_grad():
            _, (_, logits, _) = engine.model(probe)
        shards, dense = {}, {}
        for key, value in engine.model.state_dict().items():
            if isinstance(value, ShardedTensor):
                shards[key] = [
                    (tuple(s.metadata.shard_offsets), s.tensor.detach().numpy().copy())
                    for s in value.local_shards()
                ]
            else:
                dense[key] = value.detach().numpy().copy()
        return {"shards": shards, "dense": dense, "logits": logits.numpy().copy()}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("sharded")
    results = run_gang_job(
        worker,
        num_gangs=1,
        gang_size=2,
        config=CONFIG,
        plan=make_plan_for(CONFIG, NUM_DENSE),
        num_dense=NUM_DENSE,
        root=str(tmp / "checkpoints"),
        final=str(tmp / "final_model"),
    )
    return {"tmp": tmp, "results": results}


def full_tables(results: dict[int, Any]) -> dict[str, np.ndarray]:
    """Each table assembled from the shards every rank reported (prefix ``model.`` removed)."""
    out: dict[str, np.ndarray] = {}
    for i, size in enumerate(SIZES):
        key = f"t{i}"
        full = np.full((size, DIM), np.nan, dtype=np.float32)
        blocks = 0
        for result in results.values():
            for name, shards in result["shards"].items():
                if name.split(".")[-2] != key:
                    continue
                for (r0, c0), data in shards:
                    full[r0 : r0 + data.shape[0], c0 : c0 + data.shape[1]] = data
                    blocks += 1
        assert blocks == 2 and not np.isnan(full).any(), key  # two column blocks, one per rank
        out[f"sparse_arch.embedding_bag_collection.embedding_bags.{key}.weight"] = full
    return out


def test_both_exports_hold_the_assembled_tables_and_dense_state(job: dict[str, Any]) -> None:
    tmp, results = job["tmp"], job["results"]
    tables = full_tables(results)
    dense = {k[len("model.") :]: v for k, v in results[0]["dense"].items()}
    assert all(np.array_equal(dense[k], v) for k, v in results[1]["dense"].items() if k in dense)
    checkpoint = str(tmp / "checkpoints" / "checkpoint_0000000003")
    for name, source in (("from_checkpoint", checkpoint), ("from_final", str(tmp / "final_model"))):
        info = export(source, tmp / name, program=False)
        assert info.spec == ModelSpec.for_config(CONFIG, NUM_DENSE)
        state = torch.load(tmp / name / STATE_FILE, weights_only=True)
        assert state.keys() == tables.keys() | dense.keys()
        for key, value in (tables | dense).items():
            assert np.array_equal(state[key].numpy(), value), (name, key)


def test_loaded_model_scores_like_the_sharded_gang(job: dict[str, Any]) -> None:
    tmp, results = job["tmp"], job["results"]
    path = tmp / "scoring"
    export(str(tmp / "final_model"), path, program=False)
    model = load_model(path)
    for rank, result in results.items():
        probe = next(SOURCE.split(2)[rank].batches(BATCH, start_step=PROBE_STEP))
        with torch.no_grad():
            logits = model(probe.dense_features, probe.sparse_features).numpy()
        np.testing.assert_allclose(logits, result["logits"].reshape(logits.shape), atol=1e-5)
        assert float(np.std(logits)) > 1e-4
