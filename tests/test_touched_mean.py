"""``sync.merge: touched_mean`` on real engines, on gloo, against a closed form.

Two and four gangs of one rank, each on batches of its own, sync every 2 steps and carry
optimizer state every 4. Every sync's pre- and post-sync state of every member is compared
with a reference computed here from the members' pre-sync state and the ids of the batches
each trained since that level's last sync (weights) or its last sync with optimizer state
(the fused optimizer's state): a row's new value is the mean over the members that looked it
up; rows nobody looked up are unchanged. The first sync of the weights (step 2) and of the
optimizer state (step 4) have no touched sets yet and must be plain means of every member.
After step 8 every member takes gang 0's full state (a heal, ``broadcast_state``): the next
syncs (steps 10 and 12) again have no touched sets and must be plain means. Both transports
(``sync.rows: all`` and ``touched``) are run. With two gangs, rows both looked up must equal a
``merge: mean`` run's rows bit for bit. A hierarchical run (four gangs, groups of two every 2
steps, all every 4) checks each group's sync, a level's sets counting from its own or a higher
level's last sync.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

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
from raytrec.engine import touched_rows
from raytrec.engine.rank_engine import RankSpec, StoreAddress
from raytrec.sync.schedule import plan_sync
from simulation.gloo_job import (
    count_sync_collectives,
    engine_for,
    make_plan_for,
    run_gang_job,
    whole_sync_below,
)

pytestmark = pytest.mark.multiprocess

BATCH = 16
STEPS = 12
HEAL = 8  # after this step's sync every member takes gang 0's state
SOURCE = SyntheticCriteo(num_dense=4, num_sparse=2, num_embeddings=(200, 300), seed=11)
FEATURES = SOURCE.sparse_features
# name -> (gangs, fused optimizer, sync.merge, sync.rows)
RUNS = {
    "two/touched_mean/touched": (2, "rowwise_adagrad", "touched_mean", "touched"),
    "two/touched_mean/all": (2, "rowwise_adagrad", "touched_mean", "all"),
    "two/mean/all": (2, "rowwise_adagrad", "mean", "all"),
    "four/touched_mean/touched": (4, "adagrad", "touched_mean", "touched"),
    "four/touched_mean/all": (4, "adagrad", "touched_mean", "all"),
    # Groups of two every 2 steps, all four every 4; optimizer state with every sync.
    "hier/touched_mean/touched": (4, "rowwise_adagrad", "touched_mean", "touched"),
}
WEIGHTED = [name for name, run in RUNS.items() if run[2] == "touched_mean"]
# These tables are far below WHOLE_SYNC_BELOW_BYTES, under which sync.rows: touched sends every
# row as `all` does: the runs above lower it to 0 in their processes, this one keeps it.
WHOLE = {"whole/touched_mean/touched": (2, "rowwise_adagrad", "touched_mean", "touched")}


def config(gangs: int, embedding: str, merge: str, rows: str, *, hier: bool) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(
            tables=tuple(
                TableConfig(name=f"t{i}", num_embeddings=n, embedding_dim=8, features=(f,))
                for i, (n, f) in enumerate(zip(SOURCE.embedding_sizes, FEATURES, strict=True))
            ),
            dense_arch_layers=(8, 8),
            over_arch_layers=(4, 1),
        ),
        optimizer=OptimizerConfig(embedding=embedding, embedding_lr=0.05),  # type: ignore[arg-type]
        scaling=ScalingConfig(num_workers=gangs, gang_size=1),
        sync=SyncConfig(
            merge=merge,  # type: ignore[arg-type]
            rows=rows,  # type: ignore[arg-type]
            dense="with_schedule",
            **(
                {"sync_every": 4, "levels": ((2, 2),)}
                if hier
                else {"sync_every": 2, "optimizer_state_every": 4}
            ),
        ),
        data=DataConfig(batch_size=BATCH),
        seed=3,
    )


# -- rank side -------------------------------------------------------------------------------


def snapshot(e: Any) -> dict[str, list[np.ndarray]]:
    """Each table's weights and fused optimizer state, by table name (a gang of one holds
    every table whole, so local rows are the table's ids)."""
    names = {n: f"t{i}" for i, n in enumerate(SOURCE.embedding_sizes)}
    return {
        names[shard[0].shape[0]]: [t.detach().clone().numpy() for t in shard]
        for shard in e.state.table_shards(optimizer_state=True)
    }


def run(spec: RankSpec) -> dict[str, Any]:
    """12 steps on this gang's own batches with a heal after step 8; the state around every
    sync and the ids trained."""
    gangs = spec.config.scaling.num_gangs
    counts = count_sync_collectives()
    with engine_for(spec) as e:
        if spec.config.sync.levels:
            e.join_sync_plan(plan_sync(spec.config.sync, generation=0, live_gangs=range(gangs)))
        feed = SOURCE.split(gangs)[spec.gang].batches(BATCH)
        ids: dict[int, dict[str, np.ndarray]] = {}
        syncs: dict[int, dict[str, Any]] = {}
        healed: dict[str, list[np.ndarray]] = {}
        for step in range(1, STEPS + 1):
            batch = next(feed)
            kjt = batch.sparse_features
            ids[step] = {f"t{i}": kjt[f].values().numpy().copy() for i, f in enumerate(FEATURES)}
            e.train_step(batch)
            decision = e.decide(step)
            if decision.due:
                pre = snapshot(e)
                before = len(counts)
                e.sync(decision)
                syncs[step] = {
                    "pre": pre,
                    "post": snapshot(e),
                    "state": decision.optimizer_state,
                    "level": decision.level,
                    "group": decision.group_of(spec.gang),
                    "traffic": e.replicas.last_traffic,
                    "collectives": sum(counts[before:]),
                }
            if step == HEAL:
                e.broadcast_state(src=0)
                healed = snapshot(e)
        return {"ids": ids, "syncs": syncs, "healed": healed}


def worker(
    spec: RankSpec, *, runs: list[tuple[str, TrainConfig, Any]], stores: list[StoreAddress]
) -> dict[str, Any]:
    """Every run in turn on a fresh store; a two-gang run on ranks 0 and 1 only."""
    out = {}
    for (name, cfg, plan), store in zip(runs, [spec.store, *stores], strict=True):
        if spec.rank < cfg.scaling.num_gangs:
            with whole_sync_below(touched_rows.WHOLE_SYNC_BELOW_BYTES if name in WHOLE else 0):
                out[name] = run(dataclasses.replace(spec, config=cfg, plan=plan, store=store))
    return out


# -- test side -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job() -> dict[int, Any]:
    """One launch of 4 processes runs every case."""
    planned = []
    for name, args in (RUNS | WHOLE).items():
        cfg = config(*args, hier=name.startswith("hier/"))
        planned.append((name, cfg, make_plan_for(cfg, SOURCE.num_dense)))
    return run_gang_job(
        worker,
        num_gangs=4,
        gang_size=1,
        config=planned[0][1],
        plan=planned[0][2],
        num_dense=SOURCE.num_dense,
        timeout_s=300,
        extra_stores=len(planned) - 1,
        runs=planned,
    )


def touched_since(ids: dict[int, dict[str, np.ndarray]], table: str, after: int, upto: int) -> set:
    return {int(i) for s in range(after + 1, upto + 1) for i in ids[s][table]}


def reference(members: list[dict[str, Any]], step: int) -> tuple[dict[str, list], int]:
    """Every table's expected post-sync tensors at ``step``, from the members' pre-sync state
    and ids; and how many rows only some (not all, not none) of the members looked up."""
    # A heal overwrites the state: touched sets count from the first sync after it. A level's
    # sets count from its last sync or a higher level's (whose groups contain its groups).
    at = members[0]["syncs"]
    syncs = [
        s for s in sorted(at) if (s > HEAL) == (step > HEAL) and at[s]["level"] >= at[step]["level"]
    ]
    state_syncs = [s for s in syncs if members[0]["syncs"][s]["state"]]
    carries_state = members[0]["syncs"][step]["state"]
    last = max((s for s in syncs if s < step), default=None)
    last_state = max((s for s in state_syncs if s < step), default=None)
    # The touched sets count from the last sync (of optimizer state, for a sync that carries
    # it); before the first such sync they are unknown and the sync is a plain mean.
    known = (last_state if carries_state else last) is not None
    g = len(members)
    expected: dict[str, list] = {}
    partial = 0
    for table, tensors in members[0]["syncs"][step]["pre"].items():
        out = []
        for j in range(len(tensors)):
            pres = [m["syncs"][step]["pre"][table][j] for m in members]
            since = last if j == 0 else last_state
            if j > 0 and not carries_state:
                out.append(None)  # a weights-only sync leaves the state as it is
                continue
            if not known:
                touching = [set(range(len(pres[0])))] * g
            else:
                assert since is not None
                touching = [touched_since(m["ids"], table, since, step) for m in members]
            value = pres[0].copy()
            for r in range(len(value)):
                who = [i for i in range(g) if r in touching[i]]
                if who:
                    total = pres[who[0]][r].copy()
                    for i in who[1:]:
                        total = total + pres[i][r]
                    value[r] = total / np.float32(len(who))
                    partial += int(len(who) < g)
            out.append(value)
        expected[table] = out
    return expected, partial


def check_group(name: str, members: list[dict[str, Any]], step: int) -> int:
    """The sync at ``step`` of one group of ``members`` against the closed form; how many rows
    only some of them looked up."""
    g = len(members)
    expected, partial = reference(members, step)
    for table, tensors in expected.items():
        for j, want in enumerate(tensors):
            for i, m in enumerate(members):
                got = m["syncs"][step]["post"][table][j]
                pre = m["syncs"][step]["pre"][table][j]
                where = f"{name} step {step} table {table} tensor {j} member {i}"
                if want is None:
                    np.testing.assert_array_equal(got, pre, err_msg=where)
                    continue
                if g == 2:  # one or two terms: exact
                    np.testing.assert_array_equal(got, want, err_msg=where)
                else:  # three or four terms: the ring's order of the sum may round
                    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8, err_msg=where)
                # Every member holds the same result.
                np.testing.assert_array_equal(got, members[0]["syncs"][step]["post"][table][j])
    return partial


@pytest.mark.parametrize("name", WEIGHTED)
def test_each_row_is_the_mean_over_the_members_that_touched_it(
    job: dict[int, Any], name: str
) -> None:
    members = [job[r][name] for r in range(RUNS[name][0])]
    assert sorted(members[0]["syncs"]) == [2, 4, 6, 8, 10, 12]
    for m in members:  # the heal copied gang 0's state
        for table, tensors in m["healed"].items():
            for x, y in zip(tensors, members[0]["healed"][table], strict=True):
                np.testing.assert_array_equal(x, y)
    partial_rows = 0
    for step in (2, 4, 6, 8, 10, 12):
        for group in {m["syncs"][step]["group"] for m in members}:
            partial = check_group(name, [members[r] for r in group], step)
            partial_rows += partial if step in (6, 8) else 0
    # The touched syncs were not plain means in disguise: rows looked up by only some members.
    assert partial_rows > 20, partial_rows
    for step in (2, 4, 10, 12):  # no touched sets: every row of every shard
        t = members[0]["syncs"][step]["traffic"]
        assert t.whole_shards == t.shards, (step, t)
    traffic = members[0]["syncs"][8]["traffic"]
    rows = sum(t[0].shape[0] for t in members[0]["syncs"][8]["post"].values())
    if RUNS[name][3] == "touched":
        assert traffic.whole_shards == 0 and 0 < traffic.rows < rows, traffic
    else:
        assert traffic.whole_shards == traffic.shards and traffic.rows == rows, traffic


def test_rows_untouched_by_every_member_are_left_alone(job: dict[int, Any]) -> None:
    for name in [n for n in WEIGHTED if not n.startswith("hier/")]:
        g = RUNS[name][0]
        members = [job[r][name] for r in range(g)]
        untouched = 0
        for step, since in ((6, 4), (8, 6)):
            for table in members[0]["syncs"][step]["pre"]:
                seen = set().union(*(touched_since(m["ids"], table, since, step) for m in members))
                rest = np.array(sorted(set(range(SOURCE.embedding_sizes[int(table[1])])) - seen))
                untouched += len(rest)
                for m in members:
                    pre, post = (
                        m["syncs"][step]["pre"][table][0],
                        m["syncs"][step]["post"][table][0],
                    )
                    np.testing.assert_array_equal(post[rest], pre[rest])
        assert untouched > 100, (name, untouched)


def test_two_members_that_both_touched_a_row_get_the_plain_mean_bit_for_bit(
    job: dict[int, Any],
) -> None:
    """Step 6 is the first touched sync; before it both runs trained and synced alike."""
    for rows in ("touched", "all"):
        weighted = [job[r][f"two/touched_mean/{rows}"]["syncs"][6] for r in range(2)]
        plain = [job[r]["two/mean/all"]["syncs"][6] for r in range(2)]
        ids = [job[r]["two/mean/all"]["ids"] for r in range(2)]
        both = 0
        for table in plain[0]["pre"]:
            shared = sorted(touched_since(ids[0], table, 4, 6) & touched_since(ids[1], table, 4, 6))
            both += len(shared)
            for w, p in zip(weighted, plain, strict=True):
                np.testing.assert_array_equal(w["pre"][table][0], p["pre"][table][0])
                np.testing.assert_array_equal(
                    w["post"][table][0][shared], p["post"][table][0][shared]
                )
        assert both > 5, both


def test_small_tables_send_every_row_as_all_does(job: dict[int, Any]) -> None:
    """Below the threshold in force, ``rows: touched`` syncs as ``rows: all`` does: the same
    collectives, the same traffic and the same tables, bit for bit."""
    for r in range(2):
        small, full = job[r]["whole/touched_mean/touched"], job[r]["two/touched_mean/all"]
        assert sorted(small["syncs"]) == sorted(full["syncs"]) == [2, 4, 6, 8, 10, 12]
        for step, sync in small["syncs"].items():
            other = full["syncs"][step]
            assert sync["traffic"] == other["traffic"], step
            assert sync["traffic"].whole_shards == sync["traffic"].shards, step
            assert sync["collectives"] == other["collectives"], step
            for table, tensors in sync["post"].items():
                for x, y in zip(tensors, other["post"][table], strict=True):
                    np.testing.assert_array_equal(x, y)
