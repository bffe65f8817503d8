"""``sync.rows: touched`` against ``sync.rows: all`` on real engines, on gloo.

Two gangs x two ranks, for every fused embedding optimizer FBGEMM runs on CPU (sgd, adagrad,
rowwise_adagrad) x the CPU sharding types (table-wise, column-wise), and fp16 tables: each
combination trains the same 8 steps twice from the same seed, once per mode, with the gangs on
different batches, syncing every 2 steps and carrying optimizer state every 4 (so weights-only
and state syncs both take the touched path). The final states must be bit for bit the same in
both modes, the two gangs must agree (the syncs did average), and the touched syncs must have
averaged fewer rows than the shards hold.

Four gangs x one rank under a hierarchical schedule (groups of 2 every 2 steps, all every 4)
then go through a loss and a heal in both modes: gang 3 leaves after step 8, gangs 0-2 train
and sync in generation 1, gang 3 rejoins in generation 2 with a full copy of gang 0's state
(``broadcast_state``), and all four train on. The modes must agree within float tolerance
(with more than two members a mean of equal values can round), each level's first sync of a new
generation and the first after the heal must be full averages, and the job must end with every
gang holding the same state.

These tables are far below :data:`~raytrec.engine.touched_rows.WHOLE_SYNC_BELOW_BYTES`, under
which a touched sync averages a rank's shards whole; those runs lower it to 0 in their
processes (``whole_sync_below``). The ``mixed/`` runs keep it: two gangs x two ranks, one table
above it (its rank syncs touched rows) and one below (its rank syncs whole, in the collectives
of ``sync.rows: all``: one all-reduce, with dense gradients averaged every step); both modes
must again end bit for bit the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

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
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.engine import touched_rows
from raytrec.engine.rank_engine import RankEngine, RankSpec, StepInput, StoreAddress
from raytrec.sync.schedule import plan_sync
from simulation.gloo_job import (
    count_sync_collectives,
    engine_for,
    make_plan_for,
    run_gang_job,
    whole_sync_below,
)

pytestmark = pytest.mark.multiprocess

BATCH = 8
MODES = ("all", "touched")
SOURCE = SyntheticCriteo(num_dense=4, num_sparse=2, num_embeddings=(200, 300), seed=7)
DIM = 8
# One table whose shard (weights and row-wise Adagrad's one float a row) is twice the
# threshold, and one far below it.
LARGE_ROWS = 2 * touched_rows.WHOLE_SYNC_BELOW_BYTES // (4 * DIM + 4)
MIXED = SyntheticCriteo(num_dense=4, num_sparse=2, num_embeddings=(LARGE_ROWS, 300), seed=7)
COMBOS = [
    *(
        f"{e}-{s}-fp32"
        for e, s in itertools.product(
            ("sgd", "adagrad", "rowwise_adagrad"), ("table_wise", "column_wise")
        )
    ),
    "rowwise_adagrad-table_wise-fp16",
]


def config(
    combo: str,
    rows: str,
    *,
    gangs: int,
    gang_size: int,
    source: SyntheticCriteo = SOURCE,
    **sync: Any,
) -> TrainConfig:
    embedding, sharding, precision = combo.split("-")
    dim = 256 if sharding == "column_wise" else DIM  # column-wise: two 128-column shards
    return TrainConfig(
        model=ModelConfig(
            tables=tuple(
                TableConfig(
                    name=f"t{i}",
                    num_embeddings=n,
                    embedding_dim=dim,
                    features=(f,),
                    precision=precision,  # type: ignore[arg-type]
                )
                for i, (n, f) in enumerate(
                    zip(source.embedding_sizes, source.sparse_features, strict=True)
                )
            ),
            dense_arch_layers=(8, dim),
            over_arch_layers=(4, 1),
        ),
        optimizer=OptimizerConfig(embedding=embedding, embedding_lr=0.05),  # type: ignore[arg-type]
        sharding=ShardingConfig(sharding_type=sharding),  # type: ignore[arg-type]
        scaling=ScalingConfig(num_workers=gangs * gang_size, gang_size=gang_size),
        sync=SyncConfig(**({"rows": rows, "dense": "with_schedule"} | sync)),
        data=DataConfig(batch_size=BATCH),
        seed=4,
    )


# -- rank side -------------------------------------------------------------------------------


def digest(e: RankEngine) -> dict[str, str]:
    def sha(ts: list[torch.Tensor]) -> str:
        h = hashlib.sha256()
        for t in ts:
            h.update(t.detach().cpu().numpy().tobytes())
        return h.hexdigest()

    return {"shards": sha(e.shard_state()), "dense": sha(e.dense_state())}


def arrays(e: RankEngine) -> list[np.ndarray]:
    return [t.detach().float().numpy().copy() for t in e.shard_state() + e.dense_state()]


def inputs(
    stream: int, rank: int, ranks: int, source: SyntheticCriteo = SOURCE
) -> Iterator[StepInput]:
    """Stream ``stream`` (0 or 1) of job rank ``rank``: every rank's batches differ."""
    return (StepInput(b) for b in source.split(2 * ranks)[stream * ranks + rank].batches(BATCH))


def pair_run(spec: RankSpec, source: SyntheticCriteo = SOURCE) -> dict[str, Any]:
    """8 steps, syncing every 2 (the job-wide schedule); the traffic of each sync and the
    replica-plane collectives it ran."""
    counts = count_sync_collectives()
    with engine_for(spec) as e:
        feed = inputs(0, spec.rank, spec.config.scaling.num_workers, source)
        traffic, collectives = [], []
        for _ in range(4):
            before = len(counts)
            list(e.train_steps(feed, 2))
            traffic.append(e.replicas.last_traffic)
            collectives.append(counts[before:])
        return {
            "digest": digest(e),
            "traffic": traffic,
            "collectives": collectives,
            "rows": sum(w.shape[0] for w in e.embedding_weights()),
            "bytes": touched_rows.shard_bytes(e.state.tables, optimizer_state=True),
        }


def train_and_sync(e: RankEngine, feed: Iterator[StepInput], steps: range) -> list[Any]:
    assert e.sync_plan is not None
    traffic = []
    for step in steps:
        e.train_step(next(feed).batch)
        decision = e.sync_plan.decide(step)
        e.sync(decision)
        traffic.append((step, decision.level, e.replicas.last_traffic if decision.due else None))
    return traffic


def loss_and_heal_run(spec: RankSpec) -> dict[str, Any]:
    cfg = spec.config
    out: dict[str, Any] = {}
    with engine_for(spec) as e:
        e.join_sync_plan(plan_sync(cfg.sync, generation=0, live_gangs=range(4)))
        feed = inputs(1, spec.rank, 4)
        out["gen0"] = train_and_sync(e, feed, range(1, 9))
        if spec.gang != 3:  # gang 3 is lost after step 8
            live = [0, 1, 2]
            e.join_replica_plane(generation=1, member_rank=spec.gang, size=3)
            e.join_sync_plan(plan_sync(cfg.sync, generation=1, live_gangs=live))
            out["gen1"] = train_and_sync(e, feed, range(9, 13))
        # Generation 2: gang 3 rejoins with a full copy of gang 0's state.
        e.join_replica_plane(generation=2, member_rank=spec.gang, size=4)
        e.join_sync_plan(plan_sync(cfg.sync, generation=2, live_gangs=range(4)))
        e.broadcast_state(src=0)
        e.step = 12
        out["gen2"] = train_and_sync(e, feed, range(13, 21))
        out["digest"] = digest(e)
        out["arrays"] = arrays(e)
        out["rows"] = sum(w.shape[0] for w in e.embedding_weights())
    return out


def worker(
    spec: RankSpec, *, runs: list[tuple[str, TrainConfig, Any]], stores: list[StoreAddress]
) -> dict[str, Any]:
    """Every run in turn, each in a gang world of its own: the 2 x 2 runs as launched, the
    ``four/`` runs with each process a gang of one."""
    out = {}
    for (name, cfg, plan), store in zip(runs, [spec.store, *stores], strict=True):
        run_spec = dataclasses.replace(spec, config=cfg, plan=plan, store=store)
        if name.startswith("mixed/"):  # the threshold in force
            out[name] = pair_run(run_spec, MIXED)
            continue
        with whole_sync_below(0):  # tiny tables, synced by touched rows all the same
            if name.startswith("four/"):
                one = dataclasses.replace(run_spec, gang=spec.rank, gang_rank=0, gang_size=1)
                out[name] = loss_and_heal_run(one)
            else:
                out[name] = pair_run(run_spec)
    return out


# -- test side -------------------------------------------------------------------------------

FOUR = "rowwise_adagrad-table_wise-fp32"


@pytest.fixture(scope="module")
def job() -> dict[int, Any]:
    """One launch of 4 processes runs every case (a launch costs seconds of imports)."""
    runs = [
        (
            f"{combo}/{rows}",
            config(combo, rows, gangs=2, gang_size=2, sync_every=2, optimizer_state_every=4),
        )
        for combo in COMBOS
        for rows in MODES
    ] + [
        (f"four/{rows}", config(FOUR, rows, gangs=4, gang_size=1, sync_every=4, levels=((2, 2),)))
        for rows in MODES
    ]
    mixed = dict(source=MIXED, sync_every=2, optimizer_state_every=4, dense="every_step")
    runs += [(f"mixed/{rows}", config(FOUR, rows, gangs=2, gang_size=2, **mixed)) for rows in MODES]
    planned = [(name, cfg, make_plan_for(cfg, SOURCE.num_dense)) for name, cfg in runs]
    return run_gang_job(
        worker,
        num_gangs=2,
        gang_size=2,
        config=planned[0][1],
        plan=planned[0][2],
        num_dense=SOURCE.num_dense,
        timeout_s=300,
        extra_stores=len(planned) - 1,
        runs=planned,
    )


@pytest.mark.parametrize("combo", COMBOS)
def test_touched_equals_all_bit_for_bit(job: dict[int, Any], combo: str) -> None:
    for rank, by_run in job.items():
        full, touched = by_run[f"{combo}/all"], by_run[f"{combo}/touched"]
        assert touched["digest"] == full["digest"], f"rank {rank}"
        # The syncs averaged: rank k of each gang holds the same state.
        assert (
            by_run[f"{combo}/touched"]["digest"]
            == job[(rank + 2) % 4][f"{combo}/touched"]["digest"]
        )
        # The first sync (and the first with optimizer state, step 4) averaged every row; steps 6
        # and 8 only the touched ones, which the small batches keep under half of each shard.
        first, state_first, weights, state = touched["traffic"]
        assert first.whole_shards == first.shards and state_first.whole_shards == first.shards
        for t in (weights, state):
            assert t.whole_shards == 0 and 0 < t.rows < touched["rows"], t
            assert t.bytes_sent < full["traffic"][2].bytes_sent


def test_four_gangs_through_a_loss_and_a_heal(job: dict[int, Any]) -> None:
    by_gang = {g: {rows: job[g][f"four/{rows}"] for rows in MODES} for g in range(4)}
    for gang in range(4):
        for x, y in zip(
            by_gang[gang]["all"]["arrays"], by_gang[gang]["touched"]["arrays"], strict=True
        ):
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6)
    for rows in MODES:
        assert len({by_gang[g][rows]["digest"]["shards"] for g in range(4)}) == 1, rows
    touched = by_gang[0]["touched"]
    assert [s for s, lv, t in touched["gen2"] if t is not None] == [14, 16, 18, 20]
    syncs = {
        gen: [(s, lv, t) for s, lv, t in touched[gen] if t is not None]
        for gen in ("gen0", "gen1", "gen2")
    }
    # In each generation the first sync of each level averages every row (generation 2 also
    # follows the heal); the later ones (steps 6, 8, 18, 20) only the touched rows.
    for gen in ("gen0", "gen1", "gen2"):
        seen: set[int] = set()
        for step, level, t in syncs[gen]:
            if level not in seen:
                assert t.whole_shards == t.shards, (gen, step)
                seen.add(level)
            else:
                assert t.whole_shards == 0 and t.rows < touched["rows"], (
                    gen,
                    step,
                )


def test_a_rank_below_the_threshold_syncs_whole_and_one_above_by_touched_rows(
    job: dict[int, Any],
) -> None:
    """With the threshold in force: the rank holding the small table syncs it in the same
    collectives as ``sync.rows: all`` (one, for a weights-only sync), the rank holding the
    large one by touched rows, and both modes end bit for bit alike."""
    threshold = touched_rows.WHOLE_SYNC_BELOW_BYTES
    kinds = []
    for rank, by_run in job.items():
        full, touched = by_run["mixed/all"], by_run["mixed/touched"]
        assert touched["digest"] == full["digest"], f"rank {rank}"
        assert touched["digest"] == job[(rank + 2) % 4]["mixed/touched"]["digest"]
        # Steps 2 and 4 (the first with optimizer state) average every row in either mode.
        syncs = [sum(c) for c in touched["collectives"]]
        whole = [sum(c) for c in full["collectives"]]
        assert whole[2] == 1, whole  # all: one all-reduce of the weights (step 6)
        if touched["bytes"] < threshold:
            kinds.append("whole")
            assert syncs == whole, (rank, syncs, whole)
            assert touched["traffic"] == full["traffic"], rank
        else:
            kinds.append("touched")
            for t, s, w in zip(touched["traffic"][2:], syncs[2:], whole[2:], strict=True):
                assert t.whole_shards == 0 and 0 < t.rows < touched["rows"], (rank, t)
                assert t.bytes_sent < full["traffic"][2].bytes_sent / 10, (rank, t)
                assert s > w, (rank, syncs, whole)  # the agreement's collectives
    assert sorted(kinds) == ["touched", "touched", "whole", "whole"], kinds
