"""The pure sync schedule at production sizes (256 and 4096 gangs): no torch, no processes."""

from __future__ import annotations

import random

import pytest

from raytrec.cluster.topology import Topology
from raytrec.config import ConfigError, SyncConfig
from raytrec.sync.schedule import (
    ScheduleError,
    SyncPlan,
    form_groups,
    gang_locality,
    plan_sync,
)

# Seed 002's {2: 8, 4: 32, 8: all}, group sizes in gangs.
SEED_HSGD = SyncConfig(sync_every=8, levels=((2, 8), (4, 32)))


def expected_level(step: int) -> int | None:
    """Seed 002's rule for periods 2, 4, 8, written as congruences."""
    if step % 2:
        return None
    if step % 8 == 0:
        return 2
    if step % 8 == 4:
        return 1
    return 0  # step % 4 == 2


def assert_partition(plan: SyncPlan, live: set[int]) -> None:
    """Every level's groups cover each live gang exactly once and nest in the level below."""
    for level in plan.levels:
        flat = [g for group in level.groups for g in group]
        assert sorted(flat) == sorted(live), level.index
    for lower, upper in zip(plan.levels, plan.levels[1:], strict=False):
        owner = {g: j for j, group in enumerate(lower.groups) for g in group}
        for group in upper.groups:
            # A higher-level group is a union of whole lower-level groups.
            inner = {owner[g] for g in group}
            assert sum(len(lower.groups[j]) for j in inner) == len(group), (upper.index, group)


# -- config -------------------------------------------------------------------------------


def test_backwards_compatible_config() -> None:
    cfg = SyncConfig(sync_every=4)
    assert cfg.levels == () and cfg.periods == (4,) and cfg.dense == "every_step"
    assert cfg.warmup_steps == 0 and cfg.optimizer_state_every is None
    plan = plan_sync(cfg, generation=0, live_gangs=range(256))
    got = [d.level for d in map(plan.decide, range(1, 13))]
    assert got == [None, None, None, 0] * 3
    assert all(plan.decide(s).optimizer_state for s in (4, 8, 12))
    off = plan_sync(SyncConfig(sync_optimizer_state=False), generation=0, live_gangs=range(8))
    assert not off.decide(4).optimizer_state


def test_levels_are_normalised_to_tuples() -> None:
    cfg = SyncConfig(sync_every=8, levels=[[2, 8], (4, 32)])  # type: ignore[arg-type]
    assert cfg.levels == ((2, 8), (4, 32)) and cfg.periods == (2, 4, 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sync_every": 0}, r"sync.sync_every=0: must be greater than 0"),
        ({"levels": 5}, r"sync.levels=5: must be a valid list"),
        ({"levels": ((2, 8, 1),)}, r"sync.levels\[0\]=\[2, 8, 1\]: must have at most 2 items"),
        ({"levels": ((0, 8),)}, r"sync.levels\[0\]\[0\]=0: must be greater than 0"),
        ({"levels": ((2, 1),)}, r"sync.levels\[0\].group_size=1 must be at least 2 gangs"),
        (
            {"levels": ((4, 8), (2, 32))},
            r"sync.levels\[1\].period=2 must be a multiple of, and larger than, "
            r"sync.levels\[0\].period=4; allowed: 8, 12, 16, ...",
        ),
        (
            {"levels": ((2, 8), (3, 32))},
            r"sync.levels\[1\].period=3 must be a multiple of.*allowed: 4, 6, 8",
        ),
        (
            {"levels": ((2, 8), (4, 12))},
            r"sync.levels\[1\].group_size=12 must be a multiple of, and larger than, "
            r"sync.levels\[0\].group_size=8.*allowed: 16, 24, 32",
        ),
        (
            {"levels": ((2, 8), (4, 32)), "sync_every": 4},
            r"sync.sync_every=4 \(the job-wide level\) must be a multiple of, and larger than, "
            r"the last level's period sync.levels\[1\].period=4; allowed: 8, 12, 16",
        ),
        ({"levels": ((3, 8),), "sync_every": 8}, r"sync.sync_every=8 .*allowed: 6, 9, 12"),
        ({"warmup_steps": -1}, r"sync.warmup_steps=-1: must be greater than or equal to 0"),
        ({"dense": "sometimes"}, r"sync.dense='sometimes': must be 'every_step' or 'with_"),
        (
            {"optimizer_state_every": 6, "levels": ((4, 8),), "sync_every": 8},
            r"sync.optimizer_state_every=6 must be a multiple of the shortest sync period 4.*"
            r"allowed: 4, 8, 12",
        ),
        (
            {"optimizer_state_every": 8, "sync_optimizer_state": False},
            r"sync.optimizer_state_every=8 needs sync.sync_optimizer_state=True",
        ),
        ({"optimizer_state_every": 0}, r"sync.optimizer_state_every=0: must be greater than 0"),
    ],
)
def test_config_validation_names_field_value_and_allowed(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SyncConfig(**kwargs)


# -- the highest-due-level rule ---------------------------------------------------------------


@pytest.mark.parametrize("num_gangs", [256, 4096])
def test_only_the_highest_due_level_syncs(num_gangs: int) -> None:
    plan = plan_sync(SEED_HSGD, generation=0, live_gangs=range(num_gangs))
    assert [lv.period for lv in plan.levels] == [2, 4, 8] and plan.top == 2
    sizes = {lv.index: {len(g) for g in lv.groups} for lv in plan.levels}
    assert sizes == {0: {8}, 1: {32}, 2: {num_gangs}}
    assert [len(lv.groups) for lv in plan.levels] == [num_gangs // 8, num_gangs // 32, 1]
    assert_partition(plan, set(range(num_gangs)))
    # Without locality, groups are runs of consecutive gang ids.
    assert plan.levels[0].groups[3] == tuple(range(24, 32))
    for step in range(1, 65):
        d = plan.decide(step)
        assert d.level == expected_level(step), step
        assert d.due == (d.level is not None)
        if d.level is None:
            assert d.groups == () and d.period == 0 and not d.optimizer_state
            assert d.reason == f"no level due at step {step} (periods 2, 4, 8)"
            continue
        assert d.groups == plan.levels[d.level].groups
        assert d.period == (2, 4, 8)[d.level]
        assert d.optimizer_state
        assert d.reason.startswith(f"level {d.level} (every {d.period} steps")
        # At multiples of 8 the job-wide level covers levels 0 and 1, at 4 mod 8 level 1 covers 0.
        covered = {2: "; it covers levels [0, 1], also due", 1: "; it covers levels [0], also due"}
        assert d.reason.endswith(
            covered.get(d.level, "is the highest level due at step " + str(step))
        )
    assert plan.decide(16).group_of(4095 if num_gangs == 4096 else 255) == tuple(range(num_gangs))
    assert plan.decide(2).group_of(17) == tuple(range(16, 24))


def test_synchronous_and_local_sgd() -> None:
    sync = plan_sync(SyncConfig(sync_every=1), generation=0, live_gangs=range(4096))
    assert all(sync.decide(s).level == 0 for s in range(1, 50))
    local = plan_sync(SyncConfig(sync_every=5), generation=0, live_gangs=range(4096))
    assert [s for s in range(1, 31) if local.decide(s).due] == [5, 10, 15, 20, 25, 30]


@pytest.mark.parametrize("num_gangs", [256, 4096])
def test_warmup_syncs_job_wide_every_step_first(num_gangs: int) -> None:
    cfg = SyncConfig(sync_every=8, levels=((2, 8), (4, 32)), warmup_steps=10)
    plan = plan_sync(cfg, generation=0, live_gangs=range(num_gangs))
    for step in range(1, 11):
        d = plan.decide(step)
        assert (d.level, d.period, len(d.groups)) == (2, 1, 1), step
        assert d.groups[0] == tuple(range(num_gangs))
        assert d.reason == f"warmup: step {step} of 10 syncs all live gangs"
    # After warmup the hierarchy runs on the global step count.
    assert [plan.decide(s).level for s in range(11, 17)] == [None, 1, None, 0, None, 2]


def test_step_must_be_positive() -> None:
    plan = plan_sync(SEED_HSGD, generation=0, live_gangs=range(256))
    for bad in (0, -3, True, 2.0):
        with pytest.raises(ScheduleError, match=r"step must be a positive integer \(1-based\)"):
            plan.decide(bad)  # type: ignore[arg-type]


def test_delayed_optimizer_state() -> None:
    cfg = SyncConfig(sync_every=8, levels=((2, 8), (4, 32)), optimizer_state_every=16)
    plan = plan_sync(cfg, generation=0, live_gangs=range(256))
    with_state = [s for s in range(1, 65) if plan.decide(s).optimizer_state]
    assert with_state == [16, 32, 48, 64]
    d = plan.decide(8)
    assert d.level == 2 and not d.optimizer_state
    assert d.reason.endswith("; optimizer state waits for a multiple of 16")
    # A period that is a lower level's: optimizer state rides on that level's groups.
    cfg = SyncConfig(sync_every=8, levels=((2, 8),), optimizer_state_every=6)
    plan = plan_sync(cfg, generation=0, live_gangs=range(256))
    d = plan.decide(6)
    assert d.level == 0 and d.optimizer_state and len(d.groups) == 32
    assert plan.decide(12).optimizer_state and not plan.decide(10).optimizer_state


# -- locality ---------------------------------------------------------------------------------


def test_lowest_groups_follow_hosts_then_racks() -> None:
    """4096 gangs on 512 hosts (8 each, scattered ids) in 32 racks of 16 hosts."""
    host = {g: (g * 2654435761) % 4096 // 8 for g in range(4096)}
    assert sorted(set(host.values())) == list(range(512))
    locality = {g: (host[g] // 16, host[g]) for g in range(4096)}
    cfg = SyncConfig(sync_every=16, levels=((2, 8), (4, 128)))
    plan = plan_sync(cfg, generation=0, live_gangs=range(4096), locality=locality)
    assert_partition(plan, set(range(4096)))
    for group in plan.levels[0].groups:
        assert len({host[g] for g in group}) == 1, group  # one host per lowest group
    for group in plan.levels[1].groups:
        assert len({host[g] // 16 for g in group}) == 1  # one rack per level-1 group
        assert len({host[g] for g in group}) == 16
    # Inside a host, gangs keep id order.
    assert all(list(group) == sorted(group) for group in plan.levels[0].groups)


def test_locality_from_the_topology() -> None:
    """1024 ranks in gangs of 4, 8 ranks per host: gangs 2h and 2h+1 share host h."""
    topo = Topology(world_size=1024, gang_size=4, ranks_per_host=8)
    locality = gang_locality(topo)
    assert locality[0] == locality[1] == (0,) and locality[255] == (127,)
    # Gangs listed in a shuffled order still pair up by host.
    live = list(range(256))
    random.Random(0).shuffle(live)
    cfg = SyncConfig(sync_every=4, levels=((2, 2),))
    plan = plan_sync(cfg, generation=0, live_gangs=live, locality=locality)
    assert plan.levels[0].groups == tuple((2 * h, 2 * h + 1) for h in range(128))


def test_bad_live_gangs_and_locality() -> None:
    with pytest.raises(ScheduleError, match="live_gangs is empty"):
        plan_sync(SEED_HSGD, generation=0, live_gangs=[])
    with pytest.raises(ScheduleError, match=r"live_gangs lists gangs \[3\] more than once"):
        plan_sync(SEED_HSGD, generation=0, live_gangs=[1, 3, 3])
    with pytest.raises(ScheduleError, match=r"live_gangs must be non-negative gang ids"):
        plan_sync(SEED_HSGD, generation=0, live_gangs=[0, -1])
    with pytest.raises(ScheduleError, match=r"locality has no key for live gangs \[2\]"):
        plan_sync(SEED_HSGD, generation=0, live_gangs=[0, 1, 2], locality={0: (0,), 1: (0,)})
    with pytest.raises(ScheduleError, match="locality keys must be mutually comparable"):
        plan_sync(SEED_HSGD, generation=0, live_gangs=[0, 1], locality={0: (0,), 1: ("a",)})
    plan = plan_sync(SEED_HSGD, generation=3, live_gangs=range(16))
    with pytest.raises(ScheduleError, match=r"gang 99 is not live in generation 3"):
        plan.group_index(99, 0)
    with pytest.raises(ScheduleError, match=r"gang 99 is in no group of the decision for step 2"):
        plan.decide(2).group_of(99)


# -- membership changes and the remainder rule -----------------------------------------------------


def test_form_groups_remainder_rule() -> None:
    assert form_groups(range(10), 4) == ((0, 1, 2, 3), (4, 5, 6, 7, 8, 9))
    assert form_groups(range(8), 4) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert form_groups(range(7), 4) == ((0, 1, 2, 3, 4, 5, 6),)  # 1 group of 4, absorbs 3
    assert form_groups(range(3), 4) == ((0, 1, 2),)  # capped
    assert form_groups([5, 2, 9], None) == ((5, 2, 9),)
    with pytest.raises(ScheduleError, match="live_gangs is empty"):
        form_groups([], 4)


def test_recomputed_after_a_host_is_lost_at_256_gangs() -> None:
    """8 gangs per host; host 3 (gangs 24..31) dies; generation 1 runs on 248 gangs."""
    locality = {g: (g // 8,) for g in range(256)}
    gen0 = plan_sync(SEED_HSGD, generation=0, live_gangs=range(256), locality=locality)
    survivors = [g for g in range(256) if not 24 <= g < 32]
    gen1 = plan_sync(SEED_HSGD, generation=1, live_gangs=survivors, locality=locality)
    assert gen1.generation == 1 and len(gen1.live_gangs) == 248
    assert_partition(gen1, set(survivors))
    # Level 0 still matches hosts exactly: 31 groups of 8.
    assert [len(g) for g in gen1.levels[0].groups] == [8] * 31
    assert all(len({g // 8 for g in group}) == 1 for group in gen1.levels[0].groups)
    assert gen1.levels[0].note == ""
    # Level 1: 248 = 7 * 32 + 24; the last group absorbs the 24 left over.
    assert [len(g) for g in gen1.levels[1].groups] == [32] * 6 + [56]
    assert gen1.levels[1].note == "248 live gangs: the last group absorbs 24 more"
    assert gen1.levels[2].groups == (tuple(survivors),)
    # Which level is due does not depend on the generation.
    for step in range(1, 33):
        a, b = gen0.decide(step), gen1.decide(step)
        assert (a.level, a.period, a.optimizer_state) == (b.level, b.period, b.optimizer_state)
    d = gen1.decide(12)
    assert d.reason == (
        "level 1 (every 4 steps, groups of 32); 248 live gangs: the last group absorbs 24 more "
        "is the highest level due at step 12; it covers levels [0], also due"
    )
    assert all(not 24 <= g < 32 for group in d.groups for g in group)


def test_recomputed_after_losses_at_4096_gangs() -> None:
    cfg = SyncConfig(sync_every=16, levels=((2, 8), (4, 64), (8, 512)))
    survivors = [g for g in range(4096) if g != 100]
    plan = plan_sync(cfg, generation=1, live_gangs=survivors)
    assert_partition(plan, set(survivors))
    # 4095 = 511 * 8 + 7 = 63 * 64 + 63 = 7 * 512 + 511.
    assert [len(lv.groups) for lv in plan.levels] == [511, 63, 7, 1]
    assert [len(lv.groups[-1]) for lv in plan.levels] == [15, 127, 1023, 4095]
    assert plan.levels[0].groups[12] == (96, 97, 98, 99, 101, 102, 103, 104)
    # Losing most gangs caps the upper levels at what is left.
    few = plan_sync(cfg, generation=2, live_gangs=[7, 3, 900, 12, 4000])
    assert [lv.groups for lv in few.levels] == [((3, 7, 12, 900, 4000),)] * 4
    assert [lv.note for lv in few.levels[:3]] == ["capped at 5 live gangs"] * 3
    assert few.decide(2).reason.startswith("level 0 (every 2 steps, groups of 8); capped at 5")


def test_random_membership_changes_keep_levels_nested() -> None:
    rng = random.Random(5)
    cfg = SyncConfig(sync_every=16, levels=((2, 4), (4, 16), (8, 64)))
    locality = {g: (g // 16, g // 4) for g in range(256)}
    for _ in range(20):
        live = set(rng.sample(range(256), rng.randint(1, 256)))
        plan = plan_sync(cfg, generation=1, live_gangs=live, locality=locality)
        assert_partition(plan, live)
        for level in plan.levels[:-1]:
            size = level.group_size
            assert size is not None
            n = len(live)
            expect = [n] if n < size else [size] * (n // size - 1) + [size + n % size]
            assert [len(g) for g in level.groups] == expect
