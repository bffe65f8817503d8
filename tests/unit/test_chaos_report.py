"""The chaos harness's reading of a run: detection, the stall at a loss and over the rest of
the run (pure, milliseconds). Rows and events are made by hand, so every expected figure is
worked out below from them."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import chaos

PACE = 0.05  # s/step before the first fault


def row(step: int, at: float, *, steps: int = 2, wait: float = 0.0) -> dict[str, Any]:
    seconds = steps * PACE
    return {
        "step": step,
        "steps": steps,
        "at": at,
        "seconds": seconds,
        "data_wait_fraction": wait / seconds,
        "generation": 0,
        "gangs": 2,
    }


def run_with(rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[str, Any]:
    fault = {
        "kind": "rank",
        "step": 20,
        "kill_mono": 1000.0 + 1.05,  # offset 1000: the coordinator's clock is 1.05 at the kill
        "node": "n0",
        "node_id": "abcdef",
        "replacement_mono": None,
    }
    return {
        "rows": rows,
        "events": events,
        "offset": 1000.0,
        "faults": [fault],
        "summary": {"batches": {"lost": 0, "committed": 10, "committed_distinct": 10}},
    }


def late_stall_rows() -> list[dict[str, Any]]:
    rows = [row(2 * i, 0.1 * i) for i in range(1, 11)]  # steps 2..20 at the pace, to t=1.0
    # The kill at 1.05, seen at 1.25; the next row at 2.6: 1.6 s gap, 1.5 s beyond the pace.
    rows.append(row(22, 2.6))
    rows += [row(22 + 2 * i, 2.6 + 0.1 * i) for i in range(1, 5)]  # at the pace again, to 3.0
    # A late stall: 0.9 s beyond the pace, 0.8 s of it waiting for data.
    rows.append(row(32, 4.0, wait=0.8))
    rows += [row(32 + 2 * i, 4.0 + 0.1 * i) for i in range(1, 4)]
    return rows


DIED = {"kind": "rank_died", "at": 1.25, "step": 20, "node": "abcdef at 127.0.0.1"}


def test_a_loss_is_charged_its_stall_and_every_late_one_until_the_next() -> None:
    report = chaos.analyse(run_with(late_stall_rows(), [DIED]))
    (mark,) = report["marks"]
    assert mark["detected_s"] == pytest.approx(0.2)
    assert mark["stall_s"] == pytest.approx(1.5)
    assert mark["total_stall_s"] == pytest.approx(1.5 + 0.9)
    assert mark["late_data_s"] == pytest.approx(0.8)
    assert (report["lost"], report["doubled"]) == (0, 0)
    text = chaos.table(report)
    assert "| 1.50 | 2.40 | 0.80 |" in text, text


def test_without_a_baseline_before_the_first_fault_nothing_is_charged() -> None:
    rows = [row(2, 0.1), row(4, 0.2), row(22, 2.6), row(24, 2.7)]
    events = [{"kind": "rank_died", "at": 1.25, "step": 20, "node": "abcdef at 127.0.0.1"}]
    (mark,) = chaos.analyse(run_with(rows, events))["marks"]
    assert "total_stall_s" not in mark and mark["detected_s"] == pytest.approx(0.2)


def test_a_checkpoint_save_is_not_charged_to_the_loss_before_it() -> None:
    save = {"kind": "checkpoint_saved", "at": 3.5, "step": 30}
    (mark,) = chaos.analyse(run_with(late_stall_rows(), [DIED, save]))["marks"]
    assert mark["total_stall_s"] == pytest.approx(1.5) and mark["late_data_s"] == 0.0
