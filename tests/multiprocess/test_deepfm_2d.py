"""DeepFM on the 2D engine (gloo, 2 gangs x 2 ranks): weighted ids, per-table dims and
per-table sharding types (one table table-wise, one column-wise) train exactly as one plain
PyTorch process does on the union of all ranks' batches, as
tests/multiprocess/test_engine_2d.py checks for DLRM."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_engine_2d import dense_params, gather_tables, load_tables, local_shards, max_diff
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from raytrec.config import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ScalingConfig,
    SyncConfig,
    TableConfig,
    TrainConfig,
)
from raytrec.data.source import Batch
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.engine.rank_engine import RankSpec
from raytrec.models import DeepFM, build_model
from simulation.gloo_job import engine_for, make_plan_for, run_gang_job, run_steps

pytestmark = pytest.mark.multiprocess

G, L = 2, 2
T = G * L
NUM_DENSE = 3
BATCH = 8
STEPS = 3
TOL = 1e-5
EBC = "model.sparse_arch.embedding_bag_collection"
SOURCE = SyntheticCriteo(
    num_dense=NUM_DENSE,
    num_sparse=3,
    num_embeddings=(16, 24, 20),
    mean_length=2.5,
    max_length=5,
    empty_fraction=0.2,
    seed=5,
)
# cat_0 in a table of width 4, cat_1 and cat_2 (weighted) in one of width 8 cut in two
# column-wise shards of 4.
TABLES = (
    TableConfig(name="t0", num_embeddings=16, embedding_dim=4, features=("cat_0",)),
    TableConfig(
        name="t1",
        num_embeddings=24,
        embedding_dim=8,
        features=("cat_1", "cat_2"),
        weighted=True,
        sharding_types=("column_wise",),
        min_partition=4,
    ),
)
CONFIG = TrainConfig(
    model=ModelConfig(
        arch="deepfm",
        tables=TABLES,
        dense_arch_layers=(8, 6),
        over_arch_layers=(8, 1),
        deep_fm_dimension=5,
    ),
    optimizer=OptimizerConfig(embedding="sgd", embedding_lr=1.0, dense="sgd", dense_lr=0.5),
    scaling=ScalingConfig(num_workers=T, gang_size=L),
    sync=SyncConfig(sync_every=1),
    data=DataConfig(batch_size=BATCH),
    seed=3,
)


def weighted(batch: Batch) -> Batch:
    """``batch`` with a weight on every id, a function of the id and its position."""
    kjt = batch.sparse_features
    values = kjt.values()
    weights = 0.25 + (values % 7).float() / 4 + torch.arange(len(values)) % 3 / 8
    kjt = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths(), weights=weights)
    return Batch(batch.dense_features, kjt, batch.labels)


def rank_batches(rank: int) -> Iterator[Batch]:
    return map(weighted, SOURCE.split(T)[rank].batches(BATCH))


def worker(spec: RankSpec, *, tables: dict[str, np.ndarray]) -> dict[str, Any]:
    with engine_for(spec) as engine:
        load_tables(engine, tables)
        out: dict[str, Any] = {"dense": [dense_params(engine)], "shards": [local_shards(engine)]}
        batches = rank_batches(spec.rank)
        out["losses"] = []
        for _ in range(STEPS):
            out["losses"] += run_steps(engine, batches, 1)
            out["dense"].append(dense_params(engine))
            out["shards"].append(local_shards(engine))
        logits, _ = engine.score(next(batches))
        out["scores"] = logits.numpy().copy()
        return out


class Reference(nn.Module):
    """The job's DeepFM in one process: ``nn.EmbeddingBag`` tables (weighted sums) feeding the
    dense modules ``build_model`` seeds from the job's seed."""

    def __init__(self, tables: dict[str, np.ndarray]) -> None:
        super().__init__()
        model = build_model(CONFIG.model, NUM_DENSE, torch.device("cpu"), CONFIG.seed)
        assert isinstance(model, DeepFM)
        self.dense_arch, self.inter_arch, self.over_arch = (
            model.dense_arch,
            model.inter_arch,
            model.over_arch,
        )
        self.bags = nn.ParameterDict(
            {n: nn.Parameter(torch.from_numpy(w.copy())) for n, w in tables.items()}
        )

    def logits(self, batch: Batch) -> torch.Tensor:
        jagged = batch.sparse_features.to_dict()
        pooled = [
            F.embedding_bag(
                jagged[f].values(),
                self.bags[t.name],
                jagged[f].offsets()[:-1].long(),
                mode="sum",
                per_sample_weights=jagged[f].weights(),  # 1 where the feature is unweighted
            )
            for t in TABLES
            for f in t.features
        ]
        assert self.dense_arch is not None
        dense = self.dense_arch(batch.dense_features)
        x = torch.cat([dense, *pooled], dim=1)
        deep = self.inter_arch.deep_fm(embeddings=[x])
        fm = self.inter_arch.fm(embeddings=[x])
        return self.over_arch(torch.cat([dense, deep, fm], dim=1)).squeeze(-1)

    def sgd_step(
        self, batches: list[Batch], *, embedding_lr: float, dense_lr: float
    ) -> list[float]:
        self.zero_grad()
        losses = [F.binary_cross_entropy_with_logits(self.logits(b), b.labels) for b in batches]
        torch.stack(losses).mean().backward()
        with torch.no_grad():
            for name, p in self.named_parameters():
                p -= (embedding_lr if name.startswith("bags.") else dense_lr) * p.grad
        return [float(x.detach()) for x in losses]

    def dense_named(self) -> dict[str, np.ndarray]:
        return {
            f"model.{n}": p.detach().numpy().copy()
            for n, p in self.named_parameters()
            if not n.startswith("bags.")
        }

    def tables(self) -> dict[str, np.ndarray]:
        return {n: p.detach().numpy().copy() for n, p in self.bags.items()}


def test_deepfm_with_weights_and_mixed_sharding_matches_one_process() -> None:
    plan = make_plan_for(CONFIG, NUM_DENSE)
    t0, t1 = plan.plan[EBC]["t0"], plan.plan[EBC]["t1"]  # type: ignore[index]
    assert t0.sharding_type == "table_wise" and t1.sharding_type == "column_wise"  # type: ignore[union-attr]
    assert len(t1.sharding_spec.shards) == 2  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(11)
    shapes = {t.name: (t.num_embeddings, t.embedding_dim) for t in TABLES}
    init = {n: (0.5 * torch.randn(s, generator=gen)).numpy() for n, s in shapes.items()}
    results = run_gang_job(
        worker,
        num_gangs=G,
        gang_size=L,
        config=CONFIG,
        plan=plan,
        num_dense=NUM_DENSE,
        tables=init,
    )
    ref = Reference(init)
    lrs = {"embedding_lr": CONFIG.optimizer.embedding_lr, "dense_lr": CONFIG.optimizer.dense_lr}
    dense0 = ref.dense_named()
    for rank in range(T):
        assert max(max_diff(results[rank]["dense"][0], dense0).values()) == 0.0
    iters = [rank_batches(r) for r in range(T)]
    for step in range(1, STEPS + 1):
        ref_losses = ref.sgd_step([next(it) for it in iters], **lrs)
        job_losses = [results[r]["losses"][step - 1] for r in range(T)]
        np.testing.assert_allclose(job_losses, ref_losses, rtol=0, atol=TOL)
        for g in range(G):
            diff = max_diff(gather_tables(results, g, step, shapes), ref.tables())
            assert max(diff.values()) <= TOL, (step, g, diff)
        for rank in range(T):
            diff = max_diff(results[rank]["dense"][step], ref.dense_named())
            assert max(diff.values()) <= TOL, (step, rank, diff)
    for rank, it in enumerate(iters):
        with torch.no_grad():
            want = ref.logits(next(it)).numpy()
        np.testing.assert_allclose(results[rank]["scores"], want, rtol=0, atol=TOL)
    # The comparison can fail: every table and dense parameter moved far beyond the tolerance.
    assert min(max_diff(ref.tables(), init).values()) > 100 * TOL
    assert min(max_diff(ref.dense_named(), dense0).values()) > 100 * TOL
