"""Hierarchical sync on gloo: 4 gangs x 1 rank of :class:`RankEngine` in spawned processes.

Schedule: groups of 2 gangs every 2 steps, all gangs every 4 (``levels=((2, 2),),
sync_every=4``), with locality putting gangs 0 and 2 on one host and 1 and 3 on
another, so the lowest groups are (0, 2) and (1, 3). After the level-0 sync
the two members of each group hold the mean of their pre-sync embedding
weights and optimizer state while the groups still differ; after the
job-wide sync all four hold the mean of all four. Dense state follows the
mode: identical everywhere every step (``every_step``) or averaged with the
schedule (``with_schedule``). Then gang 3 leaves: generation 1 is planned for
gangs 0, 1, 2, where the remainder rule makes the level-0 group all three. Last, gang 1
rolls back (``sync_without``): every gang then holds the mean of gangs 0 and 2 alone, dense
state included.

Means are computed here with numpy from the states captured just before
each sync. One launch runs both dense modes, each in a gang world of its own.

A second launch runs gangs of two ranks (4 gangs x 2 ranks, tables sharded over each gang)
with ``sync.warmup_steps=2`` under ``levels=((2, 2),), sync_every=8``: steps 1 and 2 sync
job-wide (warmup overrides level 0, due at step 2), step 3 nothing, step 4 level 0. Each
replica group (rank k of every gang) is checked against the means of its members, and the two
ranks of a gang against each other for the dense state they must share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from raytrec.config import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ScalingConfig,
    SyncConfig,
    TableConfig,
    TrainConfig,
)
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.engine.rank_engine import RankEngine, RankSpec, StoreAddress
from raytrec.sync.schedule import plan_sync
from simulation.gloo_job import engine_for, make_plan_for, run_gang_job

pytestmark = pytest.mark.multiprocess

G, L = 4, 1
NUM_DENSE = 4
BATCH = 8
LOCALITY = {0: (0,), 1: (1,), 2: (0,), 3: (1,)}  # gangs 0 and 2 share host 0
LOW_GROUPS = ((0, 2), (1, 3))
MODES = ("with_schedule", "every_step")
KINDS = ("weights", "states", "dense", "dense_opt")
SOURCE = SyntheticCriteo(
    num_dense=NUM_DENSE,
    num_sparse=3,
    num_embeddings=(16, 24, 20),
    mean_length=2.5,
    max_length=5,
    empty_fraction=0.1,
    seed=5,
)


def job_config(dense: str, *, gang_size: int = L, **sync: Any) -> TrainConfig:
    tables = tuple(
        TableConfig(name=f"t{i}", num_embeddings=n, embedding_dim=8, features=(feature,))
        for i, (n, feature) in enumerate(
            zip(SOURCE.embedding_sizes, SOURCE.sparse_features, strict=True)
        )
    )
    return TrainConfig(
        model=ModelConfig(tables=tables, dense_arch_layers=(16, 8), over_arch_layers=(8, 1)),
        optimizer=OptimizerConfig(embedding="adagrad", dense="adagrad"),
        scaling=ScalingConfig(num_workers=G * gang_size, gang_size=gang_size),
        sync=SyncConfig(**{"sync_every": 4, "levels": ((2, 2),), "dense": dense, **sync}),
        data=DataConfig(batch_size=BATCH),
        seed=3,
    )


# -- rank side ------------------------------------------------------------------------------


def snapshot(engine: RankEngine) -> dict[str, list[np.ndarray]]:
    def arrays(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
        return [t.detach().numpy().copy() for t in tensors]

    return {
        "weights": arrays(engine.embedding_weights()),
        "states": arrays(engine.embedding_optimizer_states()),
        "dense": arrays([p for p in engine.dense_params.values()]),
        "dense_opt": arrays(engine.dense_optimizer_state()),
    }


def train_and_sync(engine: RankEngine, batches: Any, steps: range, out: dict[str, Any]) -> None:
    """Each step: train, snapshot, carry out the plan's decision, snapshot again."""
    assert engine.sync_plan is not None
    for step in steps:
        engine.train_step(next(batches))
        assert engine.step == step
        out[f"pre{step}"] = snapshot(engine)
        decision = engine.sync_plan.decide(step)
        out[f"decision{step}"] = (decision.level, decision.groups, decision.optimizer_state)
        engine.sync(decision)
        out[f"post{step}"] = snapshot(engine)


def mode_run(spec: RankSpec) -> dict[str, Any]:
    cfg = spec.config
    out: dict[str, Any] = {}
    with engine_for(spec) as engine:  # joins generation 0's job-wide plane
        engine.join_sync_plan(
            plan_sync(cfg.sync, generation=0, live_gangs=range(G), locality=LOCALITY)
        )
        assert engine.levels is not None
        out["level_groups"] = engine.levels.groups
        out["level_prefix"] = [p.level_group for p in engine.levels.planes]
        engine.broadcast_state(src=0)
        out["init"] = snapshot(engine)
        batches = SOURCE.split(G * L)[spec.rank].batches(BATCH)
        train_and_sync(engine, batches, range(1, 5), out)
        if cfg.sync.dense == "every_step" or spec.gang == 3:
            return out  # gang 3 leaves after step 4
        # Generation 1 without gang 3: rebuild the planes among gangs 0, 1, 2.
        live = [0, 1, 2]
        engine.join_replica_plane(generation=1, member_rank=live.index(spec.gang), size=3)
        assert engine.sync_plan is None and engine.levels is None
        plan = plan_sync(cfg.sync, generation=1, live_gangs=live, locality=LOCALITY)
        engine.join_sync_plan(plan)
        out["gen1_groups"] = [lv.groups for lv in plan.levels]
        train_and_sync(engine, batches, range(5, 7), out)
        # A step with no sync due, then gang 1 rolls back (raytrec.elastic.group_rollback): it
        # takes the mean of gangs 0 and 2 and adds nothing of its own.
        engine.train_step(next(batches))
        out["pre_rollback"] = snapshot(engine)
        engine.replicas.sync_without((live.index(1),))
        out["post_rollback"] = snapshot(engine)
        return out


def job_worker(
    spec: RankSpec, *, configs: list[tuple[TrainConfig, Any]], stores: list[StoreAddress]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for (config, plan), store in zip(configs, [spec.store, *stores], strict=True):
        mode_spec = dataclasses.replace(spec, config=config, plan=plan, store=store)
        out[config.sync.dense] = mode_run(mode_spec)
    return out


# -- test side ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[int, dict[str, Any]]]:
    configs = [job_config(mode) for mode in MODES]
    plans = [make_plan_for(c, NUM_DENSE) for c in configs]
    results = run_gang_job(
        job_worker,
        num_gangs=G,
        gang_size=L,
        config=configs[0],
        plan=plans[0],
        num_dense=NUM_DENSE,
        timeout_s=150.0,
        extra_stores=len(MODES) - 1,
        configs=list(zip(configs, plans, strict=True)),
    )
    return {mode: {gang: results[gang][mode] for gang in range(G)} for mode in MODES}


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def differ(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return not same(a, b)


def mean_of(snaps: list[dict[str, list[np.ndarray]]], kind: str) -> list[np.ndarray]:
    return [np.mean(np.stack(xs), axis=0) for xs in zip(*(s[kind] for s in snaps), strict=True)]


def assert_mean(post: list[np.ndarray], expect: list[np.ndarray], exact: bool) -> None:
    assert len(post) == len(expect) > 0
    for x, y in zip(post, expect, strict=True):
        if exact:  # two members: (a + b) / 2 rounds the same in gloo and numpy
            assert np.array_equal(x, y.astype(x.dtype))
        else:
            np.testing.assert_allclose(x, y, rtol=2e-6, atol=1e-7)


def dense_kinds(mode: str) -> tuple[str, ...]:
    return ("dense", "dense_opt") if mode == "with_schedule" else ()


@pytest.mark.parametrize("mode", MODES)
def test_plan_and_planes(runs: dict[str, dict[int, dict[str, Any]]], mode: str) -> None:
    by_gang = runs[mode]
    for gang, r in by_gang.items():
        low = next(g for g in LOW_GROUPS if gang in g)
        assert r["level_groups"] == (low, (0, 2, 1, 3))  # locality order
        assert r["level_prefix"] == [(0, LOW_GROUPS.index(low)), None]
        assert [r[f"decision{s}"] for s in range(1, 5)] == [
            (None, (), False),
            (0, LOW_GROUPS, True),
            (None, (), False),
            (1, ((0, 2, 1, 3),), True),
        ]
        # Every rank started from gang 0's state.
        for kind in KINDS:
            assert same(r["init"][kind], by_gang[0]["init"][kind]), (gang, kind)
    # The states hold something to compare: Adagrad sums per element, dense Adagrad state.
    init = by_gang[0]["init"]
    assert [s.shape for s in init["states"]] == [w.shape for w in init["weights"]]
    assert len(init["dense_opt"]) == 2 * len(init["dense"]) > 0


@pytest.mark.parametrize("mode", MODES)
def test_level_syncs_average_within_groups_only(
    runs: dict[str, dict[int, dict[str, Any]]], mode: str
) -> None:
    by_gang = runs[mode]
    synced_kinds = ("weights", "states", *dense_kinds(mode))
    for step in (1, 3):
        # No sync: every gang trained on its own batches and drifted apart.
        for a in range(G):
            for b in range(a + 1, G):
                for kind in ("weights", "states", *dense_kinds(mode)):
                    assert differ(by_gang[a][f"post{step}"][kind], by_gang[b][f"post{step}"][kind])
    # Step 2, level 0: each group holds the mean of its members' pre-sync state...
    for group in LOW_GROUPS:
        pre = [by_gang[g]["pre2"] for g in group]
        for kind in synced_kinds:
            expect = mean_of(pre, kind)
            for g in group:
                assert_mean(by_gang[g]["post2"][kind], expect, exact=True)
            assert differ(pre[0][kind], pre[1][kind]), kind  # so the sync changed something
    # ... and the two groups still differ.
    for kind in synced_kinds:
        assert differ(by_gang[0]["post2"][kind], by_gang[1]["post2"][kind]), kind
    # Step 4, job-wide: all four hold the mean of all four.
    pre = [by_gang[g]["pre4"] for g in range(G)]
    for kind in synced_kinds:
        expect = mean_of(pre, kind)
        for g in range(G):
            assert_mean(by_gang[g]["post4"][kind], expect, exact=False)
            assert same(by_gang[g]["post4"][kind], by_gang[0]["post4"][kind]), (g, kind)


def test_dense_state_per_mode(runs: dict[str, dict[int, dict[str, Any]]]) -> None:
    # every_step: dense gradients are averaged over all gangs every step, so dense parameters
    # and dense optimizer state are identical everywhere, between syncs too.
    every = runs["every_step"]
    for stage in ("pre1", "post1", "pre2", "post2", "pre3", "post3", "pre4", "post4"):
        for g in range(1, G):
            for kind in ("dense", "dense_opt"):
                assert same(every[g][stage][kind], every[0][stage][kind]), (stage, g, kind)
    assert differ(every[0]["post1"]["dense"], every[0]["init"]["dense"])  # and it trains
    # with_schedule: dense state differs between gangs until the schedule averages it.
    sched = runs["with_schedule"]
    assert differ(sched[0]["pre2"]["dense"], sched[2]["pre2"]["dense"])
    assert same(sched[0]["post2"]["dense"], sched[2]["post2"]["dense"])
    assert differ(sched[0]["post2"]["dense"], sched[1]["post2"]["dense"])
    # Same data, same start: the two modes' dense parameters part ways after one step.
    assert differ(sched[0]["post1"]["dense"], every[0]["post1"]["dense"])


def test_generation_after_a_gang_leaves(runs: dict[str, dict[int, dict[str, Any]]]) -> None:
    """Gangs 0, 1, 2 rebuild their planes; 3 live gangs in groups of 2: one group of all 3."""
    by_gang = runs["with_schedule"]
    assert "pre5" not in by_gang[3]
    for g in range(3):
        assert by_gang[g]["gen1_groups"] == [((0, 2, 1),), ((0, 2, 1),)]
        assert by_gang[g]["decision5"] == (None, (), False)
        assert by_gang[g]["decision6"] == (0, ((0, 2, 1),), True)
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert differ(by_gang[a]["post5"]["weights"], by_gang[b]["post5"]["weights"])
    pre = [by_gang[g]["pre6"] for g in range(3)]
    for kind in KINDS:
        expect = mean_of(pre, kind)
        for g in range(3):
            assert_mean(by_gang[g]["post6"][kind], expect, exact=False)
            assert same(by_gang[g]["post6"][kind], by_gang[0]["post6"][kind]), (g, kind)


def test_a_rolled_back_gang_takes_the_mean_of_the_others(
    runs: dict[str, dict[int, dict[str, Any]]],
) -> None:
    """Gang 1 rolls back after a step apart: every gang holds the mean of gangs 0 and 2 (two
    members: exact), embedding weights, optimizer state and dense state alike."""
    by_gang = runs["with_schedule"]
    pre = [by_gang[g]["pre_rollback"] for g in range(3)]
    for kind in KINDS:
        assert differ(pre[0][kind], pre[1][kind]) and differ(pre[1][kind], pre[2][kind]), kind
        expect = mean_of([pre[0], pre[2]], kind)
        for g in range(3):
            assert_mean(by_gang[g]["post_rollback"][kind], expect, exact=True)


# -- gangs of two ranks, with warmup --------------------------------------------------------

WARM_L = 2
WARMUP = 2
WARM_SYNC = {"sync_every": 8, "warmup_steps": WARMUP}
ALL = ((0, 2, 1, 3),)  # the job-wide group, in locality order


def warmup_worker(spec: RankSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with engine_for(spec) as engine:  # joins replica group `gang_rank` as member `gang`
        plan = plan_sync(spec.config.sync, generation=0, live_gangs=range(G), locality=LOCALITY)
        engine.join_sync_plan(plan)
        out["reasons"] = [plan.decide(s).reason for s in range(1, 5)]
        engine.broadcast_state(src=0)
        out["init"] = snapshot(engine)
        batches = SOURCE.split(G * WARM_L)[spec.rank].batches(BATCH)
        train_and_sync(engine, batches, range(1, 5), out)
    return out


@pytest.fixture(scope="module")
def warm_runs() -> dict[tuple[int, int], dict[str, Any]]:
    """``{(gang, gang rank): what the rank captured}``."""
    config = job_config("with_schedule", gang_size=WARM_L, **WARM_SYNC)
    results = run_gang_job(
        warmup_worker,
        num_gangs=G,
        gang_size=WARM_L,
        config=config,
        plan=make_plan_for(config, NUM_DENSE),
        num_dense=NUM_DENSE,
        timeout_s=150.0,
    )
    return {divmod(rank, WARM_L): out for rank, out in results.items()}


def test_gangs_of_two_shard_the_tables_and_follow_the_warmup_schedule(
    warm_runs: dict[tuple[int, int], dict[str, Any]],
) -> None:
    assert sorted(warm_runs) == [(g, k) for g in range(G) for k in range(WARM_L)]
    # Each rank of a gang holds shards of its own: averaging is per replica group.
    shapes = [[w.shape for w in warm_runs[(0, k)]["init"]["weights"]] for k in range(WARM_L)]
    assert all(shapes) and sum(len(s) for s in shapes) == len(SOURCE.embedding_sizes)
    for (g, k), r in warm_runs.items():
        assert [w.shape for w in r["init"]["weights"]] == shapes[k], (g, k)
        assert [r[f"decision{s}"] for s in range(1, 5)] == [
            (1, ALL, True),  # warmup
            (1, ALL, True),  # warmup, where level 0 is due
            (None, (), False),
            (0, LOW_GROUPS, True),
        ], (g, k)
        assert [x.split(":")[0] for x in r["reasons"][:2]] == ["warmup", "warmup"]
        for kind in KINDS:  # every replica started from gang 0's state
            assert same(r["init"][kind], warm_runs[(0, k)]["init"][kind]), (g, k, kind)


def test_gangs_of_two_average_each_replica_group_as_scheduled(
    warm_runs: dict[tuple[int, int], dict[str, Any]],
) -> None:
    for k in range(WARM_L):
        by_gang = {g: warm_runs[(g, k)] for g in range(G)}
        # Warmup steps 1 and 2: all four gangs hold the mean of the four pre-sync states.
        for step in range(1, WARMUP + 1):
            pre = [by_gang[g][f"pre{step}"] for g in range(G)]
            for kind in KINDS:
                assert differ(pre[0][kind], pre[1][kind]), (k, step, kind)
                expect = mean_of(pre, kind)
                for g in range(G):
                    assert_mean(by_gang[g][f"post{step}"][kind], expect, exact=False)
                    assert same(by_gang[g][f"post{step}"][kind], by_gang[0][f"post{step}"][kind])
        # Step 3: nothing due, so the gangs drift apart.
        for a in range(G):
            for b in range(a + 1, G):
                for kind in KINDS:
                    assert differ(by_gang[a]["post3"][kind], by_gang[b]["post3"][kind])
            for kind in KINDS:
                assert same(by_gang[a]["post3"][kind], by_gang[a]["pre3"][kind])
        # Step 4, level 0: each group holds the exact mean of its two members; groups differ.
        for group in LOW_GROUPS:
            pre = [by_gang[g]["pre4"] for g in group]
            for kind in KINDS:
                assert differ(pre[0][kind], pre[1][kind]), (k, group, kind)
                for g in group:
                    assert_mean(by_gang[g]["post4"][kind], mean_of(pre, kind), exact=True)
        for kind in KINDS:
            assert differ(by_gang[0]["post4"][kind], by_gang[1]["post4"][kind]), (k, kind)


def test_the_ranks_of_a_gang_share_one_dense_state_throughout(
    warm_runs: dict[tuple[int, int], dict[str, Any]],
) -> None:
    """Dense gradients are averaged inside the gang every step and dense state is averaged in
    the same groups by every replica group, so a gang's two ranks never disagree on it."""
    stages = ["init"] + [f"{when}{s}" for s in range(1, 5) for when in ("pre", "post")]
    for g in range(G):
        for stage in stages:
            for kind in ("dense", "dense_opt"):
                a, b = warm_runs[(g, 0)][stage][kind], warm_runs[(g, 1)][stage][kind]
                assert same(a, b), (g, stage, kind)
    assert differ(warm_runs[(0, 0)]["post1"]["dense"], warm_runs[(0, 0)]["init"]["dense"])
