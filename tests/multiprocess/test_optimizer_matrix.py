"""Every optimizer through every state movement, on real engines: 2 gangs x 2 ranks on gloo.

For each dense optimizer (sgd, adagrad, adam, adamw) x fused embedding optimizer (sgd, adagrad,
rowwise_adagrad; FBGEMM has no CPU Adam) x sharding (table-wise, column-wise), one engine per
rank runs, in this order:

(b) heal: gang 0 trains while gang 1 has never stepped; gang 1 receives gang 0's state over the
    replica plane; both gangs then train the same batches and must stay bitwise identical
    (Adam's step counts and moments came across, not only the weights);
(a) sync: the gangs train different batches, then average: every shard's weights, fused state,
    step counters, dense parameters and dense optimizer state equal the mean of the two
    replicas' values before the sync (computed here), and the copies are identical;
(c) checkpoint: gang 0 saves, then trains on (the uninterrupted run); gang 1 trains a step of
    its own, loads gang 0's checkpoint and trains the same batches: bit for bit gang 0's run;
(d) replay after a loss, from one start state: a step whose dense all-reduce failed and was
    finished after re-forming equals an ordinary step; a replayed batch (``dense=False`` on
    every rank) applies the dense optimizer with a zero gradient, as a plain torch optimizer
    loaded with the same state does, and still trains its embedding rows.

FBGEMM's step counter (``iter``, what fused Adam's bias correction reads; not in TorchRec's
fused optimizer state) exists on CPU but no CPU optimizer reads it. Row-wise Adagrad's kernel
advances it every step, so under rowwise_adagrad the test marks it as state the way FBGEMM does
for Adam (a persistent buffer) and checks that heal, sync, checkpoint and scoring carry it.

One launch runs every combination, each in a fresh gang world of its own.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torchrec.distributed.types import ShardingPlan

from raytrec.checkpoint.layout import CheckpointStore
from raytrec.checkpoint.state import load_checkpoint, save_checkpoint
from raytrec.config import (
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
from raytrec.engine.dense_optimizer import DENSE_OPTIMIZERS, dense_optimizer_kwargs
from raytrec.engine.rank_engine import RankEngine, RankSpec, StoreAddress
from raytrec.engine.replica_plane import ReplicaPlaneError
from simulation.gloo_job import engine_for, make_plan_for, run_gang_job

pytestmark = pytest.mark.multiprocess

G, L = 2, 2
BATCH = 8
DENSE = ("sgd", "adagrad", "adam", "adamw")
EMBEDDING = ("sgd", "adagrad", "rowwise_adagrad")
SHARDING = ("table_wise", "column_wise")
COMBOS = [f"{d}-{e}-{s}" for d, e, s in itertools.product(DENSE, EMBEDDING, SHARDING)]
SOURCE = SyntheticCriteo(num_dense=4, num_sparse=2, num_embeddings=(16, 24), seed=9)
HEAL_STEPS = 2  # gang 0 alone, then both gangs on the same batches again
RESUME_STEPS = 2


def combo_config(name: str) -> TrainConfig:
    dense, embedding, sharding = name.split("-")
    # Column-wise shards are cut in blocks of 128 columns: dim 256 gives two per table.
    dim = 256 if sharding == "column_wise" else 8
    return TrainConfig(
        model=ModelConfig(
            tables=tuple(
                TableConfig(name=f"t{i}", num_embeddings=n, embedding_dim=dim, features=(f,))
                for i, (n, f) in enumerate(
                    zip(SOURCE.embedding_sizes, SOURCE.sparse_features, strict=True)
                )
            ),
            dense_arch_layers=(8, dim),
            over_arch_layers=(4, 1),
        ),
        optimizer=OptimizerConfig(
            embedding=embedding,  # type: ignore[arg-type]
            embedding_lr=0.05,
            dense=dense,  # type: ignore[arg-type]
            dense_lr=0.05,
        ),
        sharding=ShardingConfig(sharding_type=sharding),  # type: ignore[arg-type]
        scaling=ScalingConfig(num_workers=G * L, gang_size=L),
        # Dense state averaged at syncs (not every step): gangs train on their own between
        # syncs, so the sync averages dense parameters and dense optimizer state too.
        sync=SyncConfig(sync_every=1000, dense="with_schedule"),
        data=DataConfig(batch_size=BATCH),
        seed=4,
    )


# -- rank side -------------------------------------------------------------------------------


def batches(stream: int, rank: int) -> Iterator[Batch]:
    """Batch stream ``stream`` (0-3) of rank position ``rank`` (a job rank or a gang rank)."""
    return SOURCE.split(4 * G * L)[stream * G * L + rank].batches(BATCH)


def snapshot(e: RankEngine) -> dict[str, Any]:
    def arrays(ts: list[torch.Tensor]) -> list[np.ndarray]:
        return [t.detach().cpu().numpy().copy() for t in ts]

    return {
        "weights": arrays(e.embedding_weights()),
        "states": arrays(e.embedding_optimizer_states()),
        "counters": arrays(e.embedding_step_counters()),
        "dense": arrays(e.dense_state()),
        "step": e.step,
    }


def train(e: RankEngine, source: Iterator[Batch], steps: int) -> None:
    for _ in range(steps):
        e.train_step(next(source))


def barrier(e: RankEngine) -> None:
    """Every member of this rank's replica group has reached this point."""
    assert e.replica is not None
    e.replica.average_([torch.zeros(1)])


class _FailingWork:
    def wait(self) -> None:
        raise RuntimeError("a member of the replica group died")


class _FailingGroup:
    def allreduce(self, tensors: list[torch.Tensor]) -> _FailingWork:
        tensors[0].fill_(float("nan"))  # a failed collective's garbage must not reach the model
        return _FailingWork()


def replay_run(e: RankEngine, spec: RankSpec) -> dict[str, Any]:
    """(d), from one start state restored before each variant."""
    # The dense gradient is averaged over the replica group every step here: the mode whose
    # all-reduce can fail inside a step (the replica side reads the mode at each step).
    e.replicas.config = e.replicas.config.model_copy(update={"dense": "every_step"})
    start = [t.detach().clone() for t in e.shard_state() + e.dense_state()]
    start_step = e.step

    def restore() -> None:
        with torch.no_grad():
            for live, saved in zip(e.shard_state() + e.dense_state(), start, strict=True):
                live.copy_(saved)
        e.shard_state_written()
        e.step = start_step

    batch = next(batches(0, spec.rank))
    out: dict[str, Any] = {}
    e.train_step(batch)
    out["ordinary"] = snapshot(e)
    restore()

    assert e.replica is not None
    e.replica = dataclasses.replace(e.replica, pg=_FailingGroup())
    try:
        e.train_step(batch)
    except ReplicaPlaneError:
        pass
    else:
        raise AssertionError("the step's dense all-reduce should have failed")
    assert e.abandon_failed_step()
    e.join_replica_plane(generation=1, member_rank=spec.gang, size=G)
    e.settle_failed_step(finish=True)
    out["finished"] = snapshot(e)
    restore()

    # The reference of a replay: a plain torch optimizer, loaded with the start state, stepped
    # with a zero gradient.
    params = [p.detach().clone().requires_grad_(True) for p in e.dense_params.values()]
    name = e.cfg.optimizer.dense
    reference = DENSE_OPTIMIZERS[name](params, **dense_optimizer_kwargs(e.cfg.optimizer))
    reference.load_state_dict(copy.deepcopy(e.dense_optimizer._optimizer.state_dict()))
    for p in params:
        p.grad = torch.zeros_like(p)
    reference.step()
    out["replay_reference"] = [p.detach().numpy().copy() for p in params]
    counters = [c.clone() for c in e.embedding_step_counters()]
    e.score(batch)  # scoring leaves the step counters where training had them
    out["score_kept_counters"] = all(
        torch.equal(a, b) for a, b in zip(counters, e.embedding_step_counters(), strict=True)
    )
    e.train_step(batch, dense=False)
    out["replay"] = snapshot(e)
    return out


def combo_run(spec: RankSpec, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with engine_for(spec) as e:
        if spec.config.optimizer.embedding == "rowwise_adagrad":
            for tbe in e.state.tables:  # as FBGEMM registers it for fused Adam (see the docstring)
                tbe._non_persistent_buffers_set.discard("iter")
        own = batches(1, spec.rank)  # this rank's own batches (differ across gangs)
        same = batches(2, spec.gang_rank)  # the same batches in both gangs

        # (b) heal into a gang that has never stepped.
        if spec.gang == 0:
            train(e, same, HEAL_STEPS)
        else:
            for _ in range(HEAL_STEPS):
                next(same)
        out["before_heal"] = snapshot(e)
        e.broadcast_state(src=0)
        e.step = HEAL_STEPS  # as the coordinator sets a healed gang's step
        out["healed"] = snapshot(e)
        train(e, same, HEAL_STEPS)
        out["trained_after_heal"] = snapshot(e)

        # (a) sync after the gangs trained different batches.
        train(e, own, 2)
        out["pre_sync"] = snapshot(e)
        e.sync(optimizer_state=True)
        out["post_sync"] = snapshot(e)

        # (c) checkpoint: gang 0 saves and trains on; gang 1 moves away, loads, trains the same.
        uri = ""
        if spec.gang == 0:
            uri = save_checkpoint(e, root, generation=0).uri
            out["saved"] = snapshot(e)
        else:
            train(e, own, 1)
        barrier(e)  # gang 0's checkpoint is committed
        if spec.gang == 1:
            latest = CheckpointStore(root).latest()
            assert latest is not None
            uri = load_checkpoint(e, latest).uri
            out["loaded"] = snapshot(e)
        out["uri"] = uri
        train(e, batches(3, spec.gang_rank), RESUME_STEPS)
        out["resumed"] = snapshot(e)
        barrier(e)

        out["replay"] = replay_run(e, spec)
    return out


def matrix_worker(
    spec: RankSpec,
    *,
    combos: list[tuple[str, TrainConfig, ShardingPlan]],
    root: str,
    stores: list[StoreAddress] | None = None,
) -> dict[str, Any]:
    results = {}
    for (name, config, plan), store in zip(combos, [spec.store, *(stores or [])], strict=True):
        combo_spec = dataclasses.replace(spec, config=config, plan=plan, store=store)
        results[name] = combo_run(combo_spec, f"{root}/{name}")
    return results


# -- test side -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    configs = {name: combo_config(name) for name in COMBOS}
    plans = {name: make_plan_for(c, SOURCE.num_dense) for name, c in configs.items()}
    first = COMBOS[0]
    return run_gang_job(
        matrix_worker,
        num_gangs=G,
        gang_size=L,
        config=configs[first],
        plan=plans[first],
        num_dense=SOURCE.num_dense,
        timeout_s=600,
        extra_stores=len(COMBOS) - 1,
        combos=[(name, configs[name], plans[name]) for name in COMBOS],
        root=str(tmp_path_factory.mktemp("ckpt")),
    )


KINDS = ("weights", "states", "counters", "dense")


def same(a: dict[str, Any], b: dict[str, Any], kinds: tuple[str, ...] = KINDS) -> list[str]:
    """The kinds of state that differ between two snapshots (bitwise)."""
    return [
        k
        for k in kinds
        if len(a[k]) != len(b[k])
        or not all(np.array_equal(x, y) for x, y in zip(a[k], b[k], strict=True))
    ]


def mean(a: list[np.ndarray], b: list[np.ndarray]) -> list[np.ndarray]:
    return [
        (x + y) / 2 if np.issubdtype(x.dtype, np.floating) else (x + y) // 2
        for x, y in zip(a, b, strict=True)
    ]


def runs(matrix: dict[int, dict[str, Any]], name: str) -> dict[int, dict[str, Any]]:
    return {rank: r[name] for rank, r in matrix.items()}


def peers() -> list[tuple[int, int]]:
    """(gang 0 rank, gang 1 rank) of each replica group."""
    return [(k, L + k) for k in range(L)]


def test_every_combination_ran(matrix: dict[int, dict[str, Any]]) -> None:
    assert sorted(matrix) == list(range(G * L))
    assert all(sorted(r) == sorted(COMBOS) for r in matrix.values())


@pytest.mark.parametrize("name", COMBOS)
def test_heal_into_a_never_stepped_gang(matrix: dict[int, dict[str, Any]], name: str) -> None:
    dense, embedding, _ = name.split("-")
    r = runs(matrix, name)
    for a, b in peers():
        peer, joiner = r[a], r[b]
        # The joiner had never stepped; the peer had (its state moved, Adam's step counts too).
        assert joiner["before_heal"]["step"] == 0 and peer["before_heal"]["step"] == HEAL_STEPS
        assert same(peer["before_heal"], joiner["before_heal"]), name
        if embedding == "rowwise_adagrad":
            assert [int(c[0]) for c in peer["before_heal"]["counters"]] == [HEAL_STEPS] * len(
                peer["before_heal"]["counters"]
            )
            assert all(int(c[0]) == 0 for c in joiner["before_heal"]["counters"])
        if dense in ("adam", "adamw"):
            steps = [x for x in peer["before_heal"]["dense"] if x.shape == ()]
            assert steps and all(float(s) == HEAL_STEPS for s in steps)
        assert same(peer["healed"], joiner["healed"]) == [], (name, a, b)
        assert same(peer["healed"], peer["before_heal"]) == []  # the peer gave, kept its own
        # The same batches afterwards: still bitwise the same, and they moved.
        assert same(peer["trained_after_heal"], joiner["trained_after_heal"]) == [], (name, a)
        assert "weights" in same(peer["trained_after_heal"], peer["healed"])


@pytest.mark.parametrize("name", COMBOS)
def test_sync_sets_the_exact_mean(matrix: dict[int, dict[str, Any]], name: str) -> None:
    embedding = name.split("-")[1]
    r = runs(matrix, name)
    for a, b in peers():
        pre_a, pre_b = r[a]["pre_sync"], r[b]["pre_sync"]
        differ = same(pre_a, pre_b)
        assert "weights" in differ and "dense" in differ, name  # the mean is not a copy
        if embedding != "sgd":
            assert "states" in differ
        for k in KINDS:
            assert all(
                np.array_equal(x, y)
                for x, y in zip(r[a]["post_sync"][k], mean(pre_a[k], pre_b[k]), strict=True)
            ), (name, a, k)
        assert same(r[a]["post_sync"], r[b]["post_sync"]) == [], (name, a)
    # Dense state: the same on every rank of the job after the sync.
    for rank in range(1, G * L):
        assert same(r[0]["post_sync"], r[rank]["post_sync"], ("dense",)) == [], (name, rank)


@pytest.mark.parametrize("name", COMBOS)
def test_checkpoint_resumes_bit_for_bit(matrix: dict[int, dict[str, Any]], name: str) -> None:
    r = runs(matrix, name)
    for a, b in peers():
        saver, loader = r[a], r[b]
        assert loader["uri"] == saver["uri"] != ""
        assert loader["loaded"]["step"] == saver["saved"]["step"]
        assert same(loader["loaded"], saver["saved"]) == [], (name, a)
        assert same(loader["resumed"], saver["resumed"]) == [], (name, a)
        assert "weights" in same(saver["resumed"], saver["saved"])


@pytest.mark.parametrize("name", COMBOS)
def test_replay_after_a_loss(matrix: dict[int, dict[str, Any]], name: str) -> None:
    embedding = name.split("-")[1]
    r = {rank: res["replay"] for rank, res in runs(matrix, name).items()}
    for rank, res in r.items():
        # A step whose dense all-reduce failed, finished after re-forming: an ordinary step.
        assert same(res["finished"], res["ordinary"]) == [], (name, rank)
        # A replayed batch: the dense optimizer stepped with a zero gradient.
        n = len(res["replay_reference"])
        got = res["replay"]["dense"][:n]
        assert all(
            np.array_equal(x, y) for x, y in zip(got, res["replay_reference"], strict=True)
        ), (name, rank)
        # Its embedding rows trained (as the ordinary step's did).
        assert same(res["replay"], res["ordinary"], ("weights",)) == []
        assert res["score_kept_counters"]
        if embedding == "rowwise_adagrad":
            assert res["replay"]["counters"]
            assert same(res["replay"], res["ordinary"], ("counters",)) == []
    for rank in range(1, G * L):  # every rank applied the same dense update
        assert same(r[0]["ordinary"], r[rank]["ordinary"], ("dense",)) == []
        assert same(r[0]["replay"], r[rank]["replay"], ("dense",)) == []
