"""The floor on an idle Ray Data scheduling loop's steps (raytrec.data.executor_pace)."""

from __future__ import annotations

import pytest
import ray.data

from raytrec.data import executor_pace
from raytrec.data.executor_pace import PacedLoop, floor_from, pace
from raytrec.errors import ConfigError


class Operator:
    def __init__(self, active: int) -> None:
        self.active = active

    def num_active_tasks(self) -> int:
        return self.active


class Executor:
    def __init__(self, *active: int) -> None:
        self._topology = {Operator(n): None for n in active}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A fake clock: ``time.perf_counter`` reads it, ``time.sleep`` advances it; returns the
    sleeps asked for."""
    now = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    monkeypatch.setattr(executor_pace.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(executor_pace.time, "sleep", sleep)
    return slept


def test_an_idle_step_is_made_to_last_the_floor(clock: list[float]) -> None:
    loop = PacedLoop()
    for _ in range(3):
        loop.on_execution_step(Executor(0, 0))
    assert clock == [pytest.approx(executor_pace.STEP_FLOOR_S)] * 3


def test_a_step_with_a_task_running_is_not_slowed(clock: list[float]) -> None:
    loop = PacedLoop()
    for _ in range(3):
        loop.on_execution_step(Executor(0, 2))
    assert clock == []


def test_a_step_that_took_longer_than_the_floor_does_not_sleep(
    clock: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = PacedLoop()
    loop.on_execution_step(Executor(0))  # an idle step: the floor
    later = executor_pace.time.perf_counter() + 2 * executor_pace.STEP_FLOOR_S
    monkeypatch.setattr(executor_pace.time, "perf_counter", lambda: later)
    loop.on_execution_step(Executor(0))
    assert len(clock) == 1


def test_an_executor_without_its_operators_is_paced_at_every_step(clock: list[float]) -> None:
    PacedLoop().on_execution_step(object())
    assert len(clock) == 1


def test_pace_adds_the_callback_once_to_that_context_only() -> None:
    mine = ray.data.DataContext.get_current().copy()
    pace(mine)
    pace(mine)
    assert mine.custom_execution_callback_classes.count(PacedLoop) == 1
    assert PacedLoop in mine.execution_callback_classes  # what Ray Data's planner instantiates
    assert PacedLoop not in ray.data.DataContext.get_current().custom_execution_callback_classes


def test_the_floor_comes_from_the_environment_and_a_bad_value_is_named() -> None:
    assert floor_from({}) == 0.02
    assert floor_from({"RAYTREC_DATA_STEP_FLOOR_S": "0"}) == 0.0
    assert floor_from({"RAYTREC_DATA_STEP_FLOOR_S": "0.005"}) == 0.005
    for bad in ("fast", "-1", "nan", ""):
        with pytest.raises(ConfigError, match=rf"RAYTREC_DATA_STEP_FLOOR_S='{bad}'.*>= 0"):
            floor_from({"RAYTREC_DATA_STEP_FLOOR_S": bad})
