"""Exactly once under a hierarchical schedule (pure, milliseconds): which survivors of a loss
roll back (:mod:`raytrec.elastic.group_rollback`), the decision when all of them do, the
accounting of their batches, and, against an independent model of the averaging, that the rule
leaves every batch in the model once where the old rule (replay the lost gangs' batches only)
does not."""

from __future__ import annotations

import dataclasses
import random
from fractions import Fraction

import pytest

from raytrec.cluster.topology import Topology
from raytrec.config import SyncConfig
from raytrec.elastic.accounting import BatchAccounting
from raytrec.elastic.boundary import JobState, Observations, decide
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.decisions import Continue, Fail, RollbackPoint, TotalLoss
from raytrec.elastic.dense import FailedStepSettlement
from raytrec.elastic.group_rollback import no_clean_survivor, rolled_back_gangs
from raytrec.elastic.membership import Membership
from raytrec.elastic.report import RankReport
from raytrec.sync.schedule import SyncPlan, plan_sync

TWO_LEVEL = SyncConfig(sync_every=4, levels=((2, 2),))


def plan(config: SyncConfig, gangs: int) -> SyncPlan:
    return plan_sync(config, generation=0, live_gangs=range(gangs))


def test_a_lower_level_group_of_all_live_gangs_is_a_job_wide_sync() -> None:
    four, three = plan(TWO_LEVEL, 4), plan(TWO_LEVEL, 3)
    assert [four.decide(s).job_wide for s in (1, 2, 4, 6, 8)] == [False, False, True, False, True]
    # Three live gangs, groups of 2: one group of all (the remainder rule).
    assert [three.decide(s).job_wide for s in (1, 2, 4, 6)] == [False, True, True, True]
    warm = plan(SyncConfig(sync_every=4, levels=((2, 2),), warmup_steps=3), 4)
    assert [warm.decide(s).job_wide for s in (1, 2, 3, 6)] == [True, True, True, False]


def test_only_survivors_that_averaged_with_a_lost_gang_since_the_job_wide_sync_roll_back() -> None:
    p = plan(TWO_LEVEL, 4)  # groups {0, 1} and {2, 3} at steps 2, 6, 10, ...; all at 4, 8, ...
    assert rolled_back_gangs(p, lost=[1], last_sync_step=4, through=5) == ()  # no lower sync yet
    assert rolled_back_gangs(p, lost=[1], last_sync_step=4, through=6) == (0,)
    assert rolled_back_gangs(p, lost=[1], last_sync_step=4, through=7) == (0,)
    # The job-wide sync at the failed step 8 did not complete: it mixes nothing.
    assert rolled_back_gangs(p, lost=[1], last_sync_step=4, through=8) == (0,)
    assert rolled_back_gangs(p, lost=[0, 1], last_sync_step=4, through=7) == ()  # a node's group
    assert rolled_back_gangs(p, lost=[1, 2], last_sync_step=4, through=7) == (0, 3)
    assert rolled_back_gangs(p, lost=[], last_sync_step=4, through=7) == ()
    # Three gangs in groups of 2 are one group: every lower-level sync is job-wide.
    assert rolled_back_gangs(plan(TWO_LEVEL, 3), lost=[1], last_sync_step=6, through=7) == ()


def test_the_widest_group_due_since_the_job_wide_sync_rolls_back_at_4096_gangs() -> None:
    # The seed's schedule: groups of 8 every 2 steps, of 32 every 4, all every 8.
    config = SyncConfig(sync_every=8, levels=((2, 8), (4, 32)))
    p = plan(config, 4096)
    lost = [9, 2000]
    first = rolled_back_gangs(p, lost=lost, last_sync_step=8, through=11)  # step 10: level 0
    assert first == tuple(g for g in [*range(8, 16), *range(2000, 2008)] if g not in lost)
    wider = rolled_back_gangs(p, lost=lost, last_sync_step=8, through=13)  # step 12: level 1
    assert wider == tuple(g for g in [*range(0, 32), *range(1984, 2016)] if g not in lost)


def test_no_clean_survivor_is_a_total_loss_or_a_failure_naming_the_checkpoint() -> None:
    assert no_clean_survivor(survivors=[0, 3], rolled_back=[0], last_sync_step=4) is None
    why = no_clean_survivor(survivors=[0, 3], rolled_back=[0, 3], last_sync_step=4)
    assert why is not None and "every surviving gang [0, 3]" in why and "step 4" in why

    topo = Topology(world_size=4, gang_size=1, ranks_per_host=4)
    elastic = ElasticConfig(min_gangs=1, max_gangs=4)
    s = JobState(
        membership=Membership.initial(topo), step=7, end_step=20, max_gangs=4, elastic=elastic
    )
    s = dataclasses.replace(s, sync_every=4)
    both = Observations(survivor_steps=(7, 7), dropping=(1, 2), rolled_back=(0, 3))
    (fail,) = decide(s, both, 0.0)
    assert isinstance(fail, Fail) and fail.needs_checkpoint and "no live copy" in fail.reason
    point = RollbackPoint(uri="/runs/a/checkpoints/checkpoint_0000000004", step=4, accounting={})
    (whole,) = decide(dataclasses.replace(s, point=point), both, 0.0)
    assert isinstance(whole, TotalLoss) and whole.point == point and whole.lost_gangs == (1, 2)
    some = Observations(survivor_steps=(7, 7), dropping=(1, 2), rolled_back=(0,))
    assert isinstance(decide(s, some, 0.0)[0], Continue)


def test_a_rolled_back_survivors_batches_are_replayed_embedding_only_where_dense_has_them() -> None:
    gangs = {0: (0,), 1: (1,), 2: (2,)}
    acc = BatchAccounting(gangs, stream_id=lambda shard, k: shard * 100 + k)
    for r in range(3):
        acc.add_rank(r, shard=r, step=0)
    # Steps 1..3 on gangs 0 and 2 (gang 1 is lost at step 3; its batches come from its stream).
    reports = [
        RankReport(rank=r, step=3, trained=tuple((s, r * 100 + s - 1) for s in (1, 2, 3)))
        for r in (0, 2)
    ]
    reports += acc.lost_rank_reports([1], fail_step=3)
    acc.record(
        reports,
        gang_of=lambda r: r,
        live_gangs=[0, 1, 2],
        last_sync_step=0,
        is_job_wide_sync=lambda s: s % 4 == 0,
        completed_through=2,
    )
    # Dense gradients averaged every step; step 3's all-reduce failed and is finished.
    settled = FailedStepSettlement(step=3, dense_through=2, source=0, finish=True)
    assert settled.survivors_through == 3
    replay = acc.apply_drop(
        acc.plan_drop(
            [1],
            [0, 2],
            ranks_of=lambda g: gangs[g],
            dense_through=settled.dense_through,
            rolled_back=[0],
            rolled_back_dense_through=settled.survivors_through,
        )
    )
    replayed = sorted(i for ids in replay.values() for i in ids)
    assert replayed == [0, 1, 2, 100, 101, 102]  # gang 0's own and the lost gang 1's
    # Gang 1's step 3 never reached the dense parameters; gang 0's did, when it was finished.
    assert sorted(acc.embedding_only(replayed)) == [0, 1, 2, 100, 101]
    acc.commit([0, 2])  # the re-forming's sync: gang 2's own batches only
    assert sorted(i for a, b in acc.committed() for i in range(a, b)) == [200, 201, 202]
    assert sorted(i for a, b in acc.replayed() for i in range(a, b)) == replayed


# -- against a model of the averaging -------------------------------------------------------

Copy = dict[int, Fraction]  # batch id -> its share of the batch's update in this gang's copy


def _average(copies: list[Copy]) -> None:
    mean: Copy = {}
    for c in copies:
        for b, w in c.items():
            mean[b] = mean.get(b, Fraction(0)) + w / len(copies)
    for c in copies:
        c.clear()
        c.update(mean)


def _train_and_lose(
    rng: random.Random, config: SyncConfig, gangs: int, *, roll_back: bool
) -> tuple[dict[int, Fraction], dict[int, Fraction]]:
    """Trains ``gangs`` gangs one batch a step under ``config``'s schedule, loses some gangs at a
    random step, re-forms (rolling back by the rule, or replaying the lost gangs' batches only),
    trains the replays and ends on a job-wide sync. Returns each batch's value in the final
    (identical) copies, and the value it would have with its update counted once at the
    weight of the job-wide sync that brought it in."""
    p = plan(config, gangs)
    copies: dict[int, Copy] = {g: {} for g in range(gangs)}
    pending: dict[int, list[int]] = {g: [] for g in range(gangs)}
    want: dict[int, Fraction] = {}
    last_sync, fail = 0, rng.randrange(1, 3 * config.sync_every)
    for step in range(1, fail + 1):
        for g in range(gangs):
            batch = step * 1000 + g
            copies[g][batch] = Fraction(1)  # this gang's copy took the whole update
            pending[g].append(batch)
        if step == fail:
            break  # the failure strikes during the failed step's sync
        decision = p.decide(step)
        for group in decision.groups:
            _average([copies[g] for g in group])
        if decision.job_wide:
            for g in range(gangs):
                want.update({b: Fraction(1, gangs) for b in pending[g]})
                pending[g] = []
            last_sync = step
    lost = rng.sample(range(gangs), rng.randrange(1, gangs))
    survivors = [g for g in range(gangs) if g not in lost]
    back = (
        rolled_back_gangs(p, lost=lost, last_sync_step=last_sync, through=fail) if roll_back else ()
    )
    clean = [g for g in survivors if g not in back]
    if not clean:
        return want, want  # a total loss: rebuilt from a checkpoint, outside this model
    # The re-forming's sync: the mean of the clean survivors' copies, everywhere.
    _average([copies[g] for g in clean])
    for g in back:
        copies[g].clear()
        copies[g].update(copies[clean[0]])
    for g in clean:
        want.update({b: Fraction(1, len(clean)) for b in pending[g]})
    replays = [b for g in [*lost, *back] for b in pending[g]]
    for k, batch in enumerate(replays):  # round robin over the survivors, then a sync
        copies[survivors[k % len(survivors)]][batch] = (
            copies[survivors[k % len(survivors)]].get(batch, Fraction(0)) + 1
        )
        want[batch] = Fraction(1, len(survivors))
    _average([copies[g] for g in survivors])
    return copies[survivors[0]], want


@pytest.mark.parametrize(
    ("config", "gangs"),
    [
        (TWO_LEVEL, 4),
        (TWO_LEVEL, 6),
        (SyncConfig(sync_every=8, levels=((2, 2), (4, 4))), 8),
        (SyncConfig(sync_every=8, levels=((2, 2), (4, 4))), 7),
    ],
)
def test_the_rule_leaves_every_batch_in_the_model_once(config: SyncConfig, gangs: int) -> None:
    rng = random.Random(f"{config.levels}/{gangs}")
    broke = 0
    for _ in range(40):
        state = rng.getstate()
        got, want = _train_and_lose(rng, config, gangs, roll_back=True)
        assert got == want
        rng.setstate(state)
        old, want = _train_and_lose(rng, config, gangs, roll_back=False)
        broke += old != want
    assert broke > 4  # the old rule (replaying the lost gangs' batches only) counts wrong
