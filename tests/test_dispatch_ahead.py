"""When the coordinator may send the next interval before it books the last one (pure, ms).

Sending early is only safe when nothing has to run on the ranks at the boundary: a checkpoint
(a sync and a save on the ranks), a gang joining, or the end of the job. The rule is
``Coordinator._dispatch_ahead``; these tests call it on a coordinator built without Ray.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from actors.coordinator import Coordinator
from raytrec.checkpoint.config import CheckpointConfig


def coordinator(
    *, end_step: int = 100, every_n_steps: int | None = None, live: int = 2, min_gangs: int = 1
) -> tuple[Coordinator, list[tuple[int, int]]]:
    c = Coordinator.__new__(Coordinator)  # no __init__: no Ray, no store
    sent: list[tuple[int, int]] = []
    c.end_step = end_step
    c.cfg = SimpleNamespace(log_every=25, checkpoint=CheckpointConfig(every_n_steps=every_n_steps))
    c.elastic = SimpleNamespace(min_gangs=min_gangs)
    c.membership = SimpleNamespace(num_gangs=live)
    c._last_save = (0, time.monotonic())
    c._pending = []
    c._building = {}

    def dispatch(n: int, following: int, **_: Any) -> Any:
        sent.append((n, following))
        return SimpleNamespace(n=n, t0=time.perf_counter())

    c._dispatch = dispatch
    return c, sent


def reports(step: int, stop: BaseException | None = None) -> list[dict[str, Any]]:
    return [{"step": step, "stop": stop}, {"step": step, "stop": None}]


def test_a_plain_boundary_sends_the_next_interval_with_the_one_after_to_prepare() -> None:
    c, sent = coordinator(end_step=100)
    assert c._dispatch_ahead(reports(25)) is not None
    assert c._dispatch_ahead(reports(50)) is not None
    assert c._dispatch_ahead(reports(75)) is not None
    # The last interval prepares nothing after it.
    assert sent == [(25, 25), (25, 25), (25, 0)]


def test_a_short_last_interval() -> None:
    c, sent = coordinator(end_step=60)
    assert c._dispatch_ahead(reports(50)) is not None
    assert sent == [(10, 0)]


@pytest.mark.parametrize(
    ("why", "kwargs", "step", "stop"),
    [
        ("the job is at its end", {"end_step": 50}, 50, None),
        ("a rank stopped (bad input, data ran out)", {}, 25, RuntimeError("no more rows")),
        ("a checkpoint is due", {"every_n_steps": 50}, 50, None),
        ("the job is below its minimum gangs", {"live": 1, "min_gangs": 2}, 25, None),
    ],
)
def test_nothing_is_sent_early_when_the_boundary_has_work(
    why: str, kwargs: dict[str, Any], step: int, stop: BaseException | None
) -> None:
    c, sent = coordinator(**kwargs)
    assert c._dispatch_ahead(reports(step, stop)) is None, why
    assert sent == []


def test_nothing_is_sent_early_while_a_gang_is_being_added() -> None:
    c, sent = coordinator()
    c._pending = [object()]  # a placement group not ready yet
    assert c._dispatch_ahead(reports(25)) is None
    c._pending, c._building = [], {3: object()}
    assert c._dispatch_ahead(reports(25)) is None
    assert sent == []


def test_a_checkpoint_not_yet_due_does_not_hold_the_next_interval() -> None:
    c, sent = coordinator(every_n_steps=50)
    assert c._dispatch_ahead(reports(25)) is not None
    assert sent == [(25, 25)]
