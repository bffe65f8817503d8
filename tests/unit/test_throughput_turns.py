"""How ``python -m benchmarks.throughput`` times each side's windows from its progress
records.

The benchmark pauses and resumes two whole jobs; a window's rows/s must come from the records
written while that side ran, with the interval that spans a pause, and the settling time after
a resume, left out. Checked here on records made up with known rates; and a pause must reach
every process of a side.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from benchmarks import throughput as turns


def records(
    windows: list[tuple[float, float]],
    rates: list[float],
    *,
    every: int = 25,
    seen_late: float = 0.0,
) -> list[tuple[int, float, float]]:
    """Progress records of a side that runs at ``rates[i]`` steps/s inside window i and is
    stopped between windows: (step, its clock, when the record was seen). Its clock is a
    wall clock that keeps running while it is stopped; the first record after a resume ends
    the interval that spanned the pause."""
    out: list[tuple[int, float, float]] = []
    step, t = 0, windows[0][0]
    for (start, end), rate in zip(windows, rates, strict=True):
        t = max(t, start)
        while t + every / rate <= end:
            t += every / rate
            step += every
            out.append((step, t, t + seen_late))
        # Stopped mid-interval: part of the next interval is done before the pause.
        t = end - every / rate / 2
    return out


def test_each_window_is_timed_on_the_records_inside_it() -> None:
    windows = [(0.0, 10.0), (20.0, 30.0), (40.0, 50.0)]
    recs = records(windows, [100.0, 50.0, 200.0])  # steps/s
    rates = turns.window_rates(recs, windows, rows_per_step=4, gap_s=5.0, settle_s=0.0)
    assert rates == [pytest.approx(400.0), pytest.approx(200.0), pytest.approx(800.0)]


def test_records_seen_late_still_go_to_their_window() -> None:
    # raytrec's driver sees the coordinator's records up to a poll later, and the last few of
    # a window only after the next resume; the window is told by most of its records.
    windows = [(0.0, 10.0), (20.0, 30.0)]
    recs = records(windows, [100.0, 50.0], seen_late=0.9)
    rates = turns.window_rates(recs, windows, rows_per_step=1, gap_s=5.0, settle_s=0.0)
    assert rates == [pytest.approx(100.0), pytest.approx(50.0)]


def test_the_settling_time_after_a_resume_is_left_out() -> None:
    # Slow for the first 3 s of the window (coming back from a pause), then steady.
    slow = [(i * 25, 0.5 * i, 0.5 * i) for i in range(1, 7)]  # 50 steps/s up to t = 3
    fast = [(150 + i * 25, 3.0 + 0.25 * i, 3.0 + 0.25 * i) for i in range(1, 28)]  # 100 steps/s
    windows = [(0.0, 10.0)]
    with_settle = turns.window_rates(slow + fast, windows, rows_per_step=1, gap_s=5.0, settle_s=2.6)
    without = turns.window_rates(slow + fast, windows, rows_per_step=1, gap_s=5.0, settle_s=0.0)
    assert with_settle == [pytest.approx(100.0)]
    assert without[0] is not None and without[0] < 95.0


def test_a_window_with_too_few_records_is_not_timed() -> None:
    windows = [(0.0, 10.0), (20.0, 30.0)]
    recs = records(windows, [100.0, 0.4])  # the second window makes 10 steps: no record
    rates = turns.window_rates(recs, windows, rows_per_step=1, gap_s=5.0, settle_s=0.0)
    assert rates[0] == pytest.approx(100.0)
    assert rates[1] is None


def test_a_paused_side_stops_children_in_sessions_of_their_own(tmp_path: Path) -> None:
    # torchrun starts each worker in a session of its own: pausing the side must reach it too.
    import psutil

    child = "import time; time.sleep(60)"
    parent = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True)\n"
        "time.sleep(60)"
    )
    side = turns.Side([sys.executable, "-c", parent], tmp_path / "side.rec")
    try:
        proc = psutil.Process(side.proc.pid)
        for _ in range(100):  # bounded: 10 s for the child to start
            kids = proc.children()
            if kids:
                break
            time.sleep(0.1)
        assert len(kids) == 1 and os.getsid(kids[0].pid) != os.getsid(proc.pid)
        side.signal(signal.SIGSTOP)
        time.sleep(0.2)
        assert {p.status() for p in (proc, kids[0])} == {psutil.STATUS_STOPPED}
        side.signal(signal.SIGCONT)
        time.sleep(0.2)
        assert psutil.STATUS_STOPPED not in {p.status() for p in (proc, kids[0])}
    finally:
        side.stop_all()
    assert not kids[0].is_running() and not proc.is_running()
