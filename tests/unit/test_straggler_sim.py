"""Straggler injection and the straggler simulator: pure, checked against closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raytrec.config import ConfigError, SyncConfig
from raytrec.sync.schedule import plan_sync
from raytrec.sync.simulate import CostModel, gang_stalls, simulate
from raytrec.sync.stragglers import StragglerSpec, uniform_draws

# -- injection ----------------------------------------------------------------------------------


def test_stall_decisions_are_deterministic_per_step_and_rank() -> None:
    spec = StragglerSpec(rate=0.3, stall_s=1.5, seed=7)
    twin = StragglerSpec(rate=0.3, stall_s=1.5, seed=7)
    ranks = np.arange(64)
    for step in (1, 2, 1000):
        row = spec.stalls(step, ranks)
        assert set(np.unique(row)) <= {0.0, 1.5}
        # The scalar call a rank makes agrees with the vectorised one, in any order.
        assert [spec.stall_seconds(step, r) for r in reversed(range(64))] == list(row[::-1])
        assert np.array_equal(twin.stalls(step, ranks), row)
    other = StragglerSpec(rate=0.3, stall_s=1.5, seed=8)
    assert not np.array_equal(other.stalls(1, np.arange(4096)), spec.stalls(1, np.arange(4096)))
    assert not np.array_equal(spec.stalls(2, np.arange(4096)), spec.stalls(1, np.arange(4096)))


def test_uniform_draws_are_uniform_and_uncorrelated() -> None:
    u = np.stack([uniform_draws(3, step, np.arange(4096)) for step in range(1, 201)])
    assert u.min() >= 0.0 and u.max() < 1.0
    n = u.size  # 819,200 draws
    # Mean and the share under 1%: within 5 standard errors of the uniform law.
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    p = 0.01
    assert abs((u < p).mean() - p) < 5 * math.sqrt(p * (1 - p) / n)
    # Neighbouring ranks and neighbouring steps are not correlated.
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):
        r = np.corrcoef(a.ravel(), b.ravel())[0, 1]
        assert abs(r) < 5 / math.sqrt(a.size)


def test_transient_stragglers_hit_many_ranks_at_the_rate() -> None:
    spec = StragglerSpec(rate=0.02, stall_s=1.0, seed=1)
    hits = np.stack([spec.stalls(s, np.arange(64)) for s in range(1, 1001)]) > 0
    p, n = 0.02, hits.size
    assert abs(hits.mean() - p) < 5 * math.sqrt(p * (1 - p) / n)
    per_rank = hits.sum(axis=0)
    assert (per_rank > 0).all()  # every one of the 64 ranks straggles at some point
    assert per_rank.max() < 3 * 20  # and none is a persistent straggler (mean 20 per rank)


def test_persistent_straggler_is_one_fixed_rank() -> None:
    spec = StragglerSpec(rate=0.25, stall_s=2.0, mode="persistent", rank=5, seed=2)
    hits = np.stack([spec.stalls(s, np.arange(16)) for s in range(1, 2001)])
    assert (hits[:, np.arange(16) != 5] == 0).all()
    frac = (hits[:, 5] > 0).mean()
    assert abs(frac - 0.25) < 5 * math.sqrt(0.25 * 0.75 / 2000)
    always = StragglerSpec(rate=1.0, stall_s=0.5, mode="persistent", rank=3)
    assert [always.stall_seconds(s, 3) for s in range(1, 6)] == [0.5] * 5
    assert always.stall_seconds(1, 2) == 0.0
    assert StragglerSpec(rate=0.0, stall_s=9.0).stalls(1, np.arange(1000)).max() == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 1.5, "stall_s": 1.0}, r"stragglers.rate=1.5: must be less than or equal to 1"),
        (
            {"rate": 0.1, "stall_s": -1.0},
            r"stragglers.stall_s=-1.0: must be greater than or equal to 0",
        ),
        ({"rate": "x", "stall_s": 1.0}, r"stragglers.rate='x': must be a valid number"),
        (
            {"rate": 0.1, "stall_s": 1.0, "mode": "sometimes"},
            r"stragglers.mode='sometimes': must be 'transient' or 'persistent'",
        ),
        (
            {"rate": 0.1, "stall_s": 1.0, "rank": -2},
            r"stragglers.rank=-2: must be greater than or equal to 0",
        ),
    ],
)
def test_straggler_spec_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StragglerSpec(**kwargs)


# -- the cost model ---------------------------------------------------------------------------


def test_cost_model_ring_allreduce_times() -> None:
    c = CostModel(step_s=0.05, model_bytes=40e6, network_bytes_per_s=4e9, host_bytes_per_s=10e9)
    assert c.average_s(1) == 0.0
    # 4 workers on one host: PCIe; 2 * 3/4 * 40 MB / 10 GB/s + 2 * log2(4) hops of 50 us.
    assert c.average_s(4) == pytest.approx(2 * 0.75 * 40e6 / 10e9 + 4 * 50e-6)
    # 64 workers = 16 hosts: the NIC; 2 * 15/16 * 40 MB / 4 GB/s + 2 * 6 hops.
    assert c.average_s(64) == pytest.approx(2 * 15 / 16 * 40e6 / 4e9 + 12 * 50e-6)
    assert c.average_s(6) == pytest.approx(2 * 0.5 * 40e6 / 4e9 + 6 * 50e-6)  # 2 hosts
    with pytest.raises(ConfigError, match=r"cost.step_s must be a positive number, got 0"):
        CostModel(step_s=0)


# -- the simulator ------------------------------------------------------------------------------

FREE = CostModel(step_s=1.0, hop_latency_s=0.0)  # an all-reduce of 1 worker costs nothing


def test_gang_stalls_take_the_slowest_rank_of_each_gang() -> None:
    spec = StragglerSpec(rate=0.1, stall_s=1.0, seed=4)
    g = gang_stalls(spec, steps=50, num_gangs=16, gang_size=4)
    assert g.shape == (50, 16)
    for step in (1, 17, 50):
        ranks = spec.stalls(step, np.arange(64)).reshape(16, 4)
        assert np.array_equal(g[step - 1], ranks.max(axis=1))


def test_hierarchy_blocks_each_group_on_its_slowest_member_by_hand() -> None:
    """4 single-rank gangs, groups of 2 every 2 steps, all every 4; stalls placed by hand."""
    stalls = np.array(
        [
            [5.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 3.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
            [0.0, 1.0, 0.0, 0.0],
        ]
    )
    c2, c4 = FREE.average_s(2), FREE.average_s(4)
    assert c2 > 0 and c4 > 0
    cfg = SyncConfig(sync_every=4, levels=((2, 2),))
    plan = plan_sync(cfg, generation=0, live_gangs=range(4))
    # Clocks after step 2: [7, 2, 5, 2]; groups (0, 1) -> 7 + c2, (2, 3) -> 5 + c2.
    # After step 4: [9, 10, 7, 7] + c2; the job-wide sync waits for gang 1: 10 + c2 + c4.
    result = simulate(plan, stalls, FREE, gang_size=1)
    assert result.seconds == pytest.approx(10 + c2 + c4)
    assert result.syncs_per_level == (1, 1)
    # Local SGD every 4: gang 0 reaches step 4 at 9, the others earlier; 9 + c4.
    local = plan_sync(SyncConfig(sync_every=4), generation=0, live_gangs=range(4))
    assert simulate(local, stalls, FREE, gang_size=1).seconds == pytest.approx(9 + c4)
    # Synchronous: every step waits for the slowest gang; the gradient all-reduce is hidden.
    sync = plan_sync(SyncConfig(sync_every=1), generation=0, live_gangs=range(4))
    assert simulate(sync, stalls, FREE, gang_size=1).seconds == pytest.approx(4 + 5 + 3 + 0 + 1)


def test_synchronous_sgd_matches_the_closed_form() -> None:
    """E[step] = step_s + stall_s * P(any of W ranks stalls) = 0.055 + (1 - 0.99**256)."""
    spec = StragglerSpec(rate=0.01, stall_s=1.0, seed=11)
    stalls = gang_stalls(spec, steps=1500, num_gangs=64, gang_size=4)
    cost = CostModel(gradient_sync_s=0.002)
    plan = plan_sync(SyncConfig(sync_every=1), generation=0, live_gangs=range(64))
    result = simulate(plan, stalls, cost, gang_size=4)
    # Exactly: the sum over steps of the slowest gang's stall.
    exact = 1500 * (0.055 + 0.002) + stalls.max(axis=1).sum()
    assert result.seconds == pytest.approx(exact)
    p_any = 1 - 0.99**256  # 0.924
    sd = math.sqrt(p_any * (1 - p_any) / 1500)
    assert abs(result.seconds / 1500 - (0.057 + p_any)) < 5 * sd


def test_local_sgd_waits_for_the_largest_stall_sum_since_the_last_sync() -> None:
    spec = StragglerSpec(rate=0.05, stall_s=1.0, seed=3)
    stalls = gang_stalls(spec, steps=96, num_gangs=32, gang_size=2)
    cost = CostModel()
    plan = plan_sync(SyncConfig(sync_every=8), generation=0, live_gangs=range(32))
    result = simulate(plan, stalls, cost, gang_size=2)
    # Every gang starts each 8-step window together, so each window costs its largest sum.
    windows = stalls.reshape(12, 8, 32).sum(axis=1).max(axis=1)
    expect = 96 * cost.step_s + windows.sum() + 12 * cost.average_s(64)
    assert result.seconds == pytest.approx(expect)
    assert result.sync_seconds == pytest.approx(12 * cost.average_s(64))


def test_hierarchical_sgd_lies_between_local_sgd_bounds() -> None:
    """Seed 002's ordering at 256 workers: local every 2 <= HSGD 2-8,4-32,8-all <= local every 8."""
    spec = StragglerSpec(rate=0.01, stall_s=1.0, seed=0)
    stalls = gang_stalls(spec, steps=400, num_gangs=64, gang_size=4)
    cost = CostModel()

    def seconds(cfg: SyncConfig) -> float:
        plan = plan_sync(cfg, generation=0, live_gangs=range(64))
        return simulate(plan, stalls, cost, gang_size=4).seconds

    sync = seconds(SyncConfig(sync_every=1))
    local2, local8 = seconds(SyncConfig(sync_every=2)), seconds(SyncConfig(sync_every=8))
    hsgd = seconds(SyncConfig(sync_every=8, levels=((2, 2), (4, 8))))
    assert sync > local2 > hsgd > local8


def test_simulate_refuses_mismatched_gangs() -> None:
    plan = plan_sync(SyncConfig(sync_every=2), generation=0, live_gangs=[0, 1, 5])
    with pytest.raises(ConfigError, match=r"live gangs must be 0..2"):
        simulate(plan, np.zeros((4, 3)), CostModel(), gang_size=1)
