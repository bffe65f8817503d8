"""The rank's fault injection (actors.fault_injection) on a stand-in rank, without Ray: which
hooks a job gets, and each fault kind carried out where the plan says, once where it must be.
The cluster tests (test_kill_process_cluster.py, test_control_plane_cluster.py, ...) run the
same hooks inside real rank actors."""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest
import torch

from actors import fault_injection
from actors.fault_injection import FaultInjection, hooks_for
from actors.rank import RankHooks
from raytrec.config import ScalingConfig, TestingConfig, TrainConfig
from raytrec.elastic.faults import FaultConfig, Phase
from raytrec.sync.stragglers import StragglerSpec

RANK, GANG = 3, 1  # job rank 3 is in gang 1 of 2 gangs x 2 ranks


class Exited(Exception):
    """Stands for the process exit of a ``kill_rank``."""


def config(*faults: str, stragglers: StragglerSpec | None = None) -> TrainConfig:
    plan = FaultConfig.parse(list(faults)) if faults else FaultConfig()
    return TrainConfig(
        scaling=ScalingConfig(num_workers=4, gang_size=2),
        testing=TestingConfig(faults=plan.faults, stragglers=stragglers),
    )


def attached(cfg: TrainConfig) -> tuple[FaultInjection, Any]:
    """Hooks attached to a stand-in rank: its spec, and an engine with one embedding table."""
    weights = torch.zeros(4, 2)
    engine = types.SimpleNamespace(
        step=0, embedding_weights=lambda: [weights], embeddings_written=lambda: None
    )
    rank = types.SimpleNamespace(
        spec=types.SimpleNamespace(config=cfg, rank=RANK, gang=GANG), engine=engine
    )
    hooks = hooks_for(cfg)
    assert isinstance(hooks, FaultInjection)
    hooks.attach(rank)  # type: ignore[arg-type]
    return hooks, engine


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> None:
    def exit_(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(fault_injection.os, "_exit", exit_)


def test_only_a_job_with_faults_or_stalls_gets_hooks_that_act() -> None:
    assert hooks_for(config()) is None
    assert isinstance(hooks_for(config("kill_rank@5:rank=0")), FaultInjection)
    assert isinstance(hooks_for(config(stragglers=StragglerSpec(rate=0.1, stall_s=0.1))), RankHooks)
    plain = RankHooks()
    assert plain.step_begins(5) == 0.0
    assert plain.enters(Phase.SYNC) is None and plain.healed() is None


def test_a_slow_rank_stalls_in_each_of_its_steps_and_no_other() -> None:
    slow = f"slow_rank@2:rank={RANK}:stall_s=0.01:steps=2"
    hooks, _ = attached(config(slow, "slow_rank@2:rank=0:stall_s=1"))
    assert [hooks.step_begins(s) for s in range(5)] == [0.0, 0.0, 0.01, 0.01, 0.0]


def test_a_kill_fires_at_its_step_and_a_phase_kill_once(exits: None) -> None:
    faults = (f"kill_rank@4:gang={GANG}", f"kill_rank@2:rank={RANK}:phase=sync")
    hooks, engine = attached(config(*faults))
    hooks.step_begins(3)
    with pytest.raises(Exited):
        hooks.step_begins(4)
    engine.step = 1
    hooks.enters(Phase.SYNC)  # before the phase fault's step
    engine.step = 2
    hooks.enters(Phase.HEAL)  # another phase
    with pytest.raises(Exited):
        hooks.enters(Phase.SYNC)
    engine.step = 3
    hooks.enters(Phase.SYNC)  # it fired already


def test_a_process_kill_is_armed_for_a_moment_of_its_drawn_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    killed = threading.Event()
    monkeypatch.setattr(fault_injection, "_sigkill", killed.set)
    fault = f"kill_process@2:rank={RANK}:steps=3:seed=1"
    step, _ = FaultConfig.parse(fault).faults[0].kill_at(RANK)
    hooks, _ = attached(config(fault))
    for s in range(step):
        assert hooks.step_begins(s) == 0.0
    assert not killed.wait(0.2)
    assert hooks.step_begins(step) == 0.0  # armed, not slept: the timer kills from its thread
    assert killed.wait(5.0)


def test_a_corrupt_heal_leaves_one_weight_off_once() -> None:
    hooks, engine = attached(config(f"corrupt_heal@3:rank={RANK}"))
    engine.step = 2
    hooks.healed()
    assert engine.embedding_weights()[0].sum().item() == 0.0
    engine.step = 3
    hooks.healed()
    hooks.healed()
    assert engine.embedding_weights()[0].view(-1).tolist() == [1.0] + [0.0] * 7
