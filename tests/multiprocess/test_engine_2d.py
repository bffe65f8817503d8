"""The 2D engine on gloo: 2 gangs x 2 ranks of :class:`RankEngine` in spawned processes.

* Reference parity: with SGD everywhere and a sync every step, the sharded
  2D job computes exactly what one plain PyTorch process computes on the
  union of all ranks' batches (``nn.EmbeddingBag`` tables, no TorchRec
  sharding, DMP or FBGEMM), step after step.
* Sync identity: right after a sync every replica of every shard holds the
  same weights and fused-optimizer state (the mean of the replicas' values),
  between syncs they drift apart, and dense state is identical everywhere.
* Config refusals for what FBGEMM/TorchRec cannot run on CPU.

A launch of 4 processes costs ~10 s of imports, so one module-scoped launch
runs the parity job and then every sync variant (each in a fresh gang world
on a store of its own); the tests read their part of its results.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.types import ShardingPlan

from raytrec.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ScalingConfig,
    ShardingConfig,
    SyncConfig,
    TableConfig,
    TrainConfig,
)
from raytrec.data.source import Batch
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.engine.rank_engine import RankEngine, RankSpec, StoreAddress
from raytrec.models import build_dlrm
from simulation.gloo_job import engine_for, make_plan_for, run_gang_job, run_steps

pytestmark = pytest.mark.multiprocess

G, L = 2, 2  # gangs x ranks per gang
T = G * L
NUM_DENSE = 4
BATCH = 8
TOL = 1e-5
EBC = "model.sparse_arch.embedding_bag_collection"

# Small id ranges, multi-hot lists, empty lists: ids repeat within and across batches.
SOURCE = SyntheticCriteo(
    num_dense=NUM_DENSE,
    num_sparse=4,
    num_embeddings=(16, 24, 32, 20),
    mean_length=2.5,
    max_length=5,
    empty_fraction=0.2,
    seed=7,
)


def job_config(
    *,
    embedding: str,
    sharding: str = "table_wise",
    dim: int = 8,
    dense: str = "sgd",
    sync_every: int = 1,
    embedding_lr: float = 0.05,
    dense_lr: float = 0.05,
    scaling: ScalingConfig | None = None,
) -> TrainConfig:
    tables = tuple(
        TableConfig(name=f"t{i}", num_embeddings=n, embedding_dim=dim, features=(feature,))
        for i, (n, feature) in enumerate(
            zip(SOURCE.embedding_sizes, SOURCE.sparse_features, strict=True)
        )
    )
    return TrainConfig(
        model=ModelConfig(tables=tables, dense_arch_layers=(16, dim), over_arch_layers=(8, 1)),
        optimizer=OptimizerConfig(
            embedding=embedding,  # type: ignore[arg-type]
            embedding_lr=embedding_lr,
            dense=dense,  # type: ignore[arg-type]
            dense_lr=dense_lr,
        ),
        sharding=ShardingConfig(sharding_type=sharding),  # type: ignore[arg-type]
        scaling=scaling or ScalingConfig(num_workers=T, gang_size=L),
        sync=SyncConfig(sync_every=sync_every),
        data=DataConfig(batch_size=BATCH),
        seed=3,
    )


def rank_batches(rank: int) -> Iterator[Batch]:
    return SOURCE.split(T)[rank].batches(BATCH)


def replica(rank: int) -> int:
    """The rank holding the same shards as ``rank`` in the other gang (G == 2)."""
    return (rank + L) % T


# -- rank-side helpers (run in the spawned processes) -------------------------


def sharded_tables(engine: RankEngine) -> dict[str, ShardedTensor]:
    return {
        key.split(".")[-2]: value
        for key, value in engine.model.state_dict().items()
        if isinstance(value, ShardedTensor)
    }


def load_tables(engine: RankEngine, tables: dict[str, np.ndarray]) -> None:
    """Copies the full ``tables`` into this rank's shards, in place."""
    views = {w.data_ptr() for w in engine.embedding_weights()}
    with torch.no_grad():
        for name, st in sharded_tables(engine).items():
            for shard in st.local_shards():
                # The state dict's shards must be views of the FBGEMM weights the engine trains.
                assert shard.tensor.data_ptr() in views, name
                (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(torch.from_numpy(tables[name][r0 : r0 + nr, c0 : c0 + nc]))


def local_shards(engine: RankEngine) -> dict[str, list[tuple[int, int, np.ndarray]]]:
    """``{table: [(row offset, column offset, values)]}`` for this rank's shards."""
    return {
        name: [
            (*shard.metadata.shard_offsets, shard.tensor.detach().numpy().copy())
            for shard in st.local_shards()
        ]
        for name, st in sharded_tables(engine).items()
    }


def dense_params(engine: RankEngine) -> dict[str, np.ndarray]:
    return {name: p.detach().numpy().copy() for name, p in engine.dense_params.items()}


def snapshot(engine: RankEngine) -> dict[str, list[np.ndarray]]:
    def arrays(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
        return [t.detach().numpy().copy() for t in tensors]

    return {
        "weights": arrays(engine.embedding_weights()),
        "states": arrays(engine.embedding_optimizer_states()),
        "dense": arrays(engine.dense_state()),
    }


def parity_run(spec: RankSpec, tables: dict[str, np.ndarray], steps: int) -> dict[str, Any]:
    """Loads ``tables`` and trains ``steps`` steps, syncing after each (sync_every=1)."""
    with engine_for(spec) as engine:
        assert spec.config.sync.sync_every == 1
        load_tables(engine, tables)
        out: dict[str, Any] = {"dense": [dense_params(engine)], "shards": [local_shards(engine)]}
        batches = rank_batches(spec.rank)
        losses = []
        for _ in range(steps):
            losses += run_steps(engine, batches, 1)
            out["dense"].append(dense_params(engine))
            out["shards"].append(local_shards(engine))
        out["losses"] = losses
        # Scoring (held-out evaluation) the next batch: logits, and a state left untouched.
        logits, labels = engine.score(next(batches))
        out["scores"] = (logits.numpy().copy(), labels.numpy().copy())
        out["after_score"] = {"dense": dense_params(engine), "shards": local_shards(engine)}
        # Whether to run an interval queued on the ranks: all say yes, then one says no.
        out["agree"] = [engine.gang_agrees(True), engine.gang_agrees(spec.gang_rank != 1)]
        return out


def sync_run(spec: RankSpec) -> dict[str, dict[str, list[np.ndarray]]]:
    """Trains 4 steps with sync_every=2 and snapshots every stage."""
    with engine_for(spec) as e:
        assert spec.config.sync.sync_every == 2
        e.broadcast_state(src=0)
        snaps = {"init": snapshot(e)}
        batches = rank_batches(spec.rank)
        run_steps(e, batches, 1)  # step 1: no sync
        snaps["step1"] = snapshot(e)
        e.train_step(next(batches))  # step 2, by hand to see the state just before the sync
        snaps["step2_pre_sync"] = snapshot(e)
        e.sync()
        snaps["step2"] = snapshot(e)
        run_steps(e, batches, 1)  # step 3: no sync
        snaps["step3"] = snapshot(e)
        run_steps(e, batches, 1)  # step 4: run() syncs on its own
        snaps["step4"] = snapshot(e)
        return snaps


def job_worker(
    spec: RankSpec,
    *,
    tables: dict[str, np.ndarray],
    variants: list[tuple[str, TrainConfig, ShardingPlan]],
    stores: list[StoreAddress],
) -> dict[str, Any]:
    """The parity run on ``spec``, then each sync variant in a fresh gang world of its own."""
    out: dict[str, Any] = {"parity": parity_run(spec, tables, PARITY_STEPS), "sync": {}}
    for (name, config, plan), store in zip(variants, stores, strict=True):
        variant_spec = dataclasses.replace(spec, config=config, plan=plan, store=store)
        out["sync"][name] = sync_run(variant_spec)
    return out


# -- the single-process reference ---------------------------------------------


class ReferenceDLRM(nn.Module):
    """The job's DLRM in one process: ``nn.EmbeddingBag`` tables and the same dense modules."""

    def __init__(self, config: TrainConfig, tables: dict[str, np.ndarray]) -> None:
        super().__init__()
        # build_dlrm seeds the dense layers from config.seed, as every rank does; its
        # EmbeddingBagCollection (on meta) is not used.
        dlrm = build_dlrm(config.model, NUM_DENSE, torch.device("cpu"), config.seed).model
        self.dense_arch = dlrm.dense_arch
        self.inter_arch = dlrm.inter_arch
        self.over_arch = dlrm.over_arch
        self.features = config.model.features  # the order of DLRM's [B, F, D] sparse input
        self.table_of = {f: t.name for t in config.model.tables for f in t.features}
        self.bags = nn.ModuleDict(
            {
                name: nn.EmbeddingBag.from_pretrained(
                    torch.from_numpy(w.copy()), freeze=False, mode="sum"
                )
                for name, w in tables.items()
            }
        )

    def loss(self, batch: Batch) -> torch.Tensor:
        """Mean binary cross-entropy over ``batch``, as ``DLRMTrain`` computes it."""
        return F.binary_cross_entropy_with_logits(self.logits(batch), batch.labels)

    def logits(self, batch: Batch) -> torch.Tensor:
        """The model's logits on ``batch``, ``[B]``."""
        jagged = batch.sparse_features.to_dict()
        pooled = [
            self.bags[self.table_of[f]](jagged[f].values().long(), jagged[f].offsets()[:-1].long())
            for f in self.features
        ]
        sparse = torch.stack(pooled, dim=1)  # [B, F, D]
        dense = self.dense_arch(batch.dense_features)
        logits = self.over_arch(self.inter_arch(dense_features=dense, sparse_features=sparse))
        return logits.squeeze(-1)

    def dense_named(self) -> dict[str, torch.Tensor]:
        """Dense parameters under the names ``DLRMTrain`` (and so the engine) gives them."""
        return {f"model.{n}": p for n, p in self.named_parameters() if not n.startswith("bags.")}

    def tables(self) -> dict[str, np.ndarray]:
        return {n: bag.weight.detach().numpy().copy() for n, bag in self.bags.items()}

    def sgd_step(
        self, batches: list[Batch], *, embedding_lr: float, dense_lr: float, embedding_scale: float
    ) -> list[float]:
        """One step on all ranks' batches; returns each rank's loss before the update.

        Gradients are those of the mean of the T ranks' losses; embedding
        gradients are further multiplied by ``embedding_scale``.
        """
        self.zero_grad()
        losses = [self.loss(b) for b in batches]
        torch.stack(losses).mean().backward()
        with torch.no_grad():
            for p in self.dense_named().values():
                p -= dense_lr * p.grad
            for bag in self.bags.values():
                bag.weight -= embedding_lr * embedding_scale * bag.weight.grad
        return [float(x.detach()) for x in losses]


# -- gathering job results --------------------------------------------------------


def gather_tables(
    results: dict[int, Any], gang: int, step: int, shapes: dict[str, tuple[int, int]]
) -> dict[str, np.ndarray]:
    """One gang's full tables after ``step``, assembled from its ranks' shards."""
    tables = {name: np.full(shape, np.nan, dtype=np.float32) for name, shape in shapes.items()}
    for rank in range(gang * L, (gang + 1) * L):
        for name, shards in results[rank]["shards"][step].items():
            for r0, c0, values in shards:
                nr, nc = values.shape
                tables[name][r0 : r0 + nr, c0 : c0 + nc] = values
    for name, table in tables.items():
        assert not np.isnan(table).any(), f"gang {gang}: table {name} is not fully covered"
    return tables


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, float]:
    assert a.keys() == b.keys()
    return {k: float(np.abs(a[k] - b[k]).max()) for k in a}


# -- the job: one launch for the parity run and every sync variant ------------------

PARITY_STEPS = 3
PARITY_CONFIG = job_config(embedding="sgd", embedding_lr=1.0, dense_lr=0.5)
SYNC_VARIANTS = {
    "sgd-table_wise": ("sgd", "table_wise", 8),
    "adagrad-table_wise": ("adagrad", "table_wise", 8),
    "rowwise_adagrad-table_wise": ("rowwise_adagrad", "table_wise", 8),
    # The planner cuts column-wise shards in blocks of 128 columns (TorchRec's
    # MIN_CW_DIM; make_plan sets no min_partition), so dim 256 gives 2 real shards.
    "adagrad-column_wise": ("adagrad", "column_wise", 256),
    "rowwise_adagrad-column_wise": ("rowwise_adagrad", "column_wise", 256),
}


def sync_config(name: str) -> TrainConfig:
    embedding, sharding, dim = SYNC_VARIANTS[name]
    # Dense Adagrad: its state (sums, step counts) must match everywhere too.
    return job_config(
        embedding=embedding, sharding=sharding, dim=dim, dense="adagrad", sync_every=2
    )


def table_shapes(config: TrainConfig) -> dict[str, tuple[int, int]]:
    return {t.name: (t.num_embeddings, t.embedding_dim) for t in config.model.tables}


@dataclasses.dataclass(frozen=True)
class Job:
    init_tables: dict[str, np.ndarray]  # the parity run's initial tables
    plans: dict[str, ShardingPlan]  # "parity" and each sync variant
    results: dict[int, Any]


@pytest.fixture(scope="module")
def job() -> Job:
    gen = torch.Generator().manual_seed(11)
    init = {
        name: (0.5 * torch.randn(shape, generator=gen)).numpy()
        for name, shape in table_shapes(PARITY_CONFIG).items()
    }
    plans = {"parity": make_plan_for(PARITY_CONFIG, NUM_DENSE)}
    plans.update({name: make_plan_for(sync_config(name), NUM_DENSE) for name in SYNC_VARIANTS})
    results = run_gang_job(
        job_worker,
        num_gangs=G,
        gang_size=L,
        config=PARITY_CONFIG,
        plan=plans["parity"],
        num_dense=NUM_DENSE,
        extra_stores=len(SYNC_VARIANTS),
        tables=init,
        variants=[(name, sync_config(name), plans[name]) for name in SYNC_VARIANTS],
    )
    return Job(init_tables=init, plans=plans, results=results)


def assert_plan(plan: ShardingPlan, config: TrainConfig) -> None:
    """Table-wise puts each whole table on one rank; column-wise really splits them."""
    sharding = config.sharding.sharding_type
    owners = set()
    for t in config.model.tables:
        ps = plan.plan[EBC][t.name]  # type: ignore[index]
        assert ps.sharding_type == sharding, t.name  # type: ignore[union-attr]
        shards = ps.sharding_spec.shards  # type: ignore[union-attr]
        if sharding == "column_wise":
            assert [s.shard_offsets for s in shards] == [[0, 0], [0, 128]], t.name
            assert [s.shard_sizes for s in shards] == [[t.num_embeddings, 128]] * 2, t.name
            assert {s.placement.rank() for s in shards} == {0, 1}, t.name
        else:
            assert [s.shard_sizes for s in shards] == [[t.num_embeddings, t.embedding_dim]]
        owners |= {s.placement.rank() for s in shards}
    assert owners == set(range(L))  # lookups really cross ranks through the all-to-all


# -- a) reference parity -------------------------------------------------------------


def test_batches_have_multi_hot_empty_and_repeated_ids() -> None:
    """The data the parity test relies on exercises pooling and duplicate-id merging."""
    batches = [SOURCE.make_batch(r, 0, BATCH) for r in range(T)]
    lengths = torch.cat([b.sparse_features.lengths() for b in batches])
    assert (lengths == 0).any() and (lengths >= 2).any()
    for f in SOURCE.sparse_features:
        ids = [b.sparse_features[f].values() for b in batches]
        assert any(len(x.unique()) < len(x) for x in ids), f  # repeats within a batch
        for other in (1, L):  # and across ranks, in the same gang and in the other
            assert set(ids[0].tolist()) & set(ids[other].tolist()), (f, other)


def test_sgd_matches_single_process_reference(job: Job) -> None:
    """Embedding and dense updates are both SGD on the mean loss over all T ranks' rows; and
    scoring a batch afterwards (a held-out evaluation's step) gives the reference's logits
    and changes no weight.

    DDP averages dense gradients over the gang and the engine over the
    replica group; TorchRec divides the embedding gradients coming back
    through the all-to-all by the gang size (comm_ops.GRADIENT_DIVISION) and
    the per-step sync averages the gangs' tables. So both get the gradient of
    (1/T) * sum_r loss_r, each loss_r being the mean BCE over rank r's batch.
    """
    config, init = PARITY_CONFIG, job.init_tables
    assert_plan(job.plans["parity"], config)
    shapes = table_shapes(config)
    results = {rank: r["parity"] for rank, r in job.results.items()}
    lrs = {"embedding_lr": config.optimizer.embedding_lr, "dense_lr": config.optimizer.dense_lr}
    ref = ReferenceDLRM(config, init)
    summed = ReferenceDLRM(config, init)  # as if the gang's embedding gradients were summed

    ref_dense0 = {n: p.detach().numpy().copy() for n, p in ref.dense_named().items()}
    for rank in range(T):
        assert max(max_diff(results[rank]["dense"][0], ref_dense0).values()) == 0.0
    for g in range(G):
        assert max(max_diff(gather_tables(results, g, 0, shapes), init).values()) == 0.0

    iters = [rank_batches(r) for r in range(T)]
    for step in range(1, PARITY_STEPS + 1):
        batches = [next(it) for it in iters]
        ref_losses = ref.sgd_step(batches, **lrs, embedding_scale=1.0)
        summed.sgd_step(batches, **lrs, embedding_scale=float(L))
        job_losses = [results[r]["losses"][step - 1] for r in range(T)]
        np.testing.assert_allclose(job_losses, ref_losses, rtol=0, atol=TOL)
        ref_tables = ref.tables()
        for g in range(G):
            diff = max_diff(gather_tables(results, g, step, shapes), ref_tables)
            assert max(diff.values()) <= TOL, (step, g, diff)
        ref_dense = {n: p.detach().numpy() for n, p in ref.dense_named().items()}
        for rank in range(T):
            diff = max_diff(results[rank]["dense"][step], ref_dense)
            assert max(diff.values()) <= TOL, (step, rank, diff)
        if step == 1:
            # The summed-gradient hypothesis is measurably wrong.
            off = max_diff(gather_tables(results, 0, step, shapes), summed.tables())
            assert max(off.values()) > 100 * TOL, off

    # Scoring the next batch: the reference's logits, and nothing trained.
    for rank, it in enumerate(iters):
        batch = next(it)
        logits, labels = results[rank]["scores"]
        with torch.no_grad():
            np.testing.assert_allclose(logits, ref.logits(batch).numpy(), rtol=0, atol=TOL)
        np.testing.assert_array_equal(labels, batch.labels.numpy())
        after = results[rank]["after_score"]
        assert max(max_diff(after["dense"], results[rank]["dense"][-1]).values()) == 0.0
        for name, shards in after["shards"].items():
            before = results[rank]["shards"][-1][name]
            assert all(np.array_equal(a[2], b[2]) for a, b in zip(shards, before, strict=True))

    # The test can fail: every table and dense parameter moved far beyond the tolerance.
    moved = max_diff(ref.tables(), init)
    assert min(moved.values()) > 100 * TOL, moved
    moved = max_diff({n: p.detach().numpy() for n, p in ref.dense_named().items()}, ref_dense0)
    assert min(moved.values()) > 100 * TOL, moved


# -- b) sync identity ---------------------------------------------------------------------


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("variant", list(SYNC_VARIANTS))
def test_sync_makes_replicas_identical(job: Job, variant: str) -> None:
    embedding, sharding, _ = SYNC_VARIANTS[variant]
    config = sync_config(variant)
    assert_plan(job.plans[variant], config)
    runs = {rank: r["sync"][variant] for rank, r in job.results.items()}

    # Fused optimizer state: none for SGD, per element for Adagrad, per row for row-wise.
    for rank, run in runs.items():
        weights, states = run["init"]["weights"], run["init"]["states"]
        assert weights, rank
        if sharding == "column_wise":
            assert {w.shape[1] for w in weights} == {128}
        if embedding == "sgd":
            assert states == []
        elif embedding == "adagrad":
            assert [s.shape for s in states] == [w.shape for w in weights]
        else:
            assert [s.shape for s in states] == [(w.shape[0],) for w in weights]

    # Dense state: every dense parameter plus Adagrad's sum and step for it.
    dense_model = build_dlrm(config.model, NUM_DENSE, torch.device("cpu"), config.seed)
    num_dense_params = sum(1 for p in dense_model.parameters() if not p.is_meta)
    assert len(runs[0]["init"]["dense"]) == 3 * num_dense_params

    synced = {"init", "step2", "step4"}
    for stage in ("init", "step1", "step2_pre_sync", "step2", "step3", "step4"):
        # Dense parameters (and dense optimizer state) match on all ranks after every step.
        for rank in range(1, T):
            assert same(runs[rank][stage]["dense"], runs[0][stage]["dense"]), (stage, rank)
        for rank in range(L):
            a, b = runs[rank][stage], runs[replica(rank)][stage]
            for kind in ("weights", "states"):
                if stage in synced:
                    assert same(a[kind], b[kind]), (stage, rank, kind)
                else:
                    # Between syncs every shard (and its accumulator) drifts apart.
                    for x, y in zip(a[kind], b[kind], strict=True):
                        assert not np.array_equal(x, y), (stage, rank, kind)

    # The sync set both replicas to the mean of their pre-sync values, and training moved them.
    for rank in range(L):
        pre_a, pre_b = runs[rank]["step2_pre_sync"], runs[replica(rank)]["step2_pre_sync"]
        post = runs[rank]["step2"]
        for kind in ("weights", "states"):
            means = [(x + y) / 2 for x, y in zip(pre_a[kind], pre_b[kind], strict=True)]
            assert same(post[kind], means), (rank, kind)
        assert not same(post["weights"], runs[rank]["init"]["weights"])
        assert not same(runs[rank]["step4"]["weights"], post["weights"])


# -- gang agreement ------------------------------------------------------------------


def test_a_gang_agrees_only_when_every_rank_says_yes(job: Job) -> None:
    # RankWorker.train runs a queued interval only if every rank of the gang may: a rank that
    # went on alone would wait in the gang's collectives for a peer that stopped.
    for rank, result in job.results.items():
        assert result["parity"]["agree"] == [True, False], rank


# -- c) CPU refusals (no processes) ---------------------------------------------------


def test_fused_adam_is_refused_on_cpu() -> None:
    with pytest.raises(ConfigError, match="Optimizer adam is not supported in CPU mode"):
        TrainConfig(optimizer=OptimizerConfig(embedding="adam"))


@pytest.mark.parametrize("sharding_type", ["row_wise", "table_row_wise"])
def test_row_wise_sharding_is_refused_on_cpu(sharding_type: Any) -> None:
    with pytest.raises(ConfigError, match=r"sharding\.sharding_type"):
        TrainConfig(sharding=ShardingConfig(sharding_type=sharding_type))
