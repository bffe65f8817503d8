"""The recovery benchmark's reading of events and history rows (pure, milliseconds).

The event and row times below are those of an elastic run on this machine (2 gangs x 2 ranks,
rank 3 killed as it started step 14), so the expected figures are differences worked out by
hand from them.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from benchmarks import recovery
from benchmarks.common import drop_options, replace_block
from raytrec.elastic.events import (
    CheckpointRestored,
    CheckpointSaved,
    GangDropped,
    GangHealed,
    GangJoined,
    GangPlaced,
    GangRequested,
    GenerationStarted,
    RankDied,
)
from raytrec.observability.metrics import IntervalMetrics


def row(step: int, at: float, *, gangs: int = 2, seconds: float = 0.04) -> IntervalMetrics:
    return IntervalMetrics(
        step=step,
        steps=1,
        loss=0.5,
        samples_per_s=1000.0,
        seconds=seconds,
        data_wait_fraction=0.0,
        sync_fraction=0.0,
        generation=0,
        gangs=gangs,
        elapsed_s=at,
        at=at,
    )


BEFORE = [row(s, 44.9 + 0.05 * s, seconds=0.03 + 0.01 * (s % 3)) for s in range(1, 14)]
EVENTS = [
    GenerationStarted(at=44.819, step=0, generation=0, gang_ids=(0, 1), reason="start"),
    CheckpointSaved(at=45.415, step=8, uri="checkpoint_0000000008"),
    RankDied(at=75.686, step=13, job_rank=3, gang_id=1),
    GangDropped(at=75.693, step=14, gang_id=1, reason="rank 3 died"),
    GenerationStarted(at=75.715, step=14, generation=1, gang_ids=(0,), reason="gang 1 dropped"),
    GangRequested(at=75.736, step=14, count=1, outstanding=1),
    GangPlaced(at=104.233, step=16, nodes=("n0", "n0")),
    GenerationStarted(at=104.275, step=16, generation=2, gang_ids=(0, 2), reason="gang 2 joins"),
    GangHealed(at=104.295, step=16, gang_id=2, peer_gang_id=0),
    GangJoined(at=104.295, step=16, gang_id=2, generation=2),
]
AFTER = [
    row(15, 75.788, gangs=1),
    row(16, 75.823, gangs=1),
    row(17, 104.36, gangs=2, seconds=28.376),
    row(18, 104.389, gangs=2),
]


def test_elastic_timings_from_the_failure_and_from_the_request() -> None:
    t = recovery.elastic_timings(EVENTS, BEFORE + AFTER, last_done=13, full_gangs=2)
    failed_at = 44.9 + 0.05 * 13  # the row of step 13
    assert t.resume_s == pytest.approx(75.788 - failed_at)  # step 15, after the death
    assert t.heal_start_s == pytest.approx(104.233 - 75.736)
    assert t.heal_transfer_s == pytest.approx(104.295 - 104.233)
    assert t.heal_join_s == pytest.approx(104.295 - 75.736)
    assert t.heal_step_s == pytest.approx(104.36 - 75.736)
    assert t.survivors_gap_s == pytest.approx(104.36 - 75.823)
    # Steps 2..13 take 0.03, 0.04 or 0.05 s by step % 3: four of each, median 0.04.
    assert t.step_s == pytest.approx(0.04)


def test_a_heal_that_did_not_happen_is_not_observed() -> None:
    events = [e for e in EVENTS if e.at < 100]
    t = recovery.elastic_timings(events, BEFORE + AFTER[:2], last_done=13, full_gangs=2)
    assert t.resume_s == pytest.approx(75.788 - (44.9 + 0.05 * 13))
    assert (t.heal_start_s, t.heal_join_s, t.heal_step_s, t.survivors_gap_s) == (None,) * 4


def test_a_missing_row_or_event_is_an_error_not_a_number() -> None:
    with pytest.raises(ValueError, match="no history row for step 14"):
        recovery.elastic_timings(EVENTS, BEFORE + AFTER, last_done=14, full_gangs=2)
    no_death = [e for e in EVENTS if not isinstance(e, RankDied)]
    with pytest.raises(ValueError, match="no 'rank_died' event"):
        recovery.elastic_timings(no_death, BEFORE + AFTER, last_done=13, full_gangs=2)


def test_the_restart_is_timed_on_the_driver_clock() -> None:
    events = [
        GenerationStarted(at=30.0, step=0, generation=0, gang_ids=(0, 1), reason="start"),
        CheckpointRestored(at=31.5, step=10, uri="c", saved_step=10, saved_generation=0),
    ]
    rows = [row(s, 32.0 + 0.5 * (s - 11)) for s in range(11, 17)]
    # Rows reach the driver in polls a second apart; the clock's zero is 9.0 s after fit().
    polls = {11: 42.1, 12: 42.1, 13: 43.1, 14: 43.1, 15: 44.1, 16: 44.1}
    arrivals = [(polls[r.step], r.at) for r in rows]
    seconds = recovery.restart_seconds(events, rows, arrivals, last_done=15)
    # Smallest arrival - at: step 12 (42.1 - 32.5) and 14 (43.1 - 33.5): 9.6 s; then the row
    # of step 16 (at 34.5) on the driver's clock.
    assert seconds == pytest.approx(9.6 + 34.5)
    with pytest.raises(ValueError, match="no 'checkpoint_restored' event"):
        recovery.restart_seconds(events[:1], rows, arrivals, last_done=15)


def test_the_ratios_compare_the_restart_with_the_survivors() -> None:
    growing = recovery.elastic_timings(EVENTS, BEFORE + AFTER, last_done=13, full_gangs=2)
    alone = dataclasses.replace(growing, resume_s=2.0)
    m = recovery.Measurement(
        size="s", shape="2 x 2", repeat=0, survivors=alone, restart_s=43.5, growing=growing
    )
    assert m.ratio == pytest.approx(43.5 / 2.0)
    assert m.ratio_growing == pytest.approx(43.5 / (75.788 - (44.9 + 0.05 * 13)))


def test_last_checkpoint_before_the_failure() -> None:
    assert recovery.last_checkpoint_before(15, 10) == 10
    assert recovery.last_checkpoint_before(20, 10) == 20
    assert recovery.last_checkpoint_before(9, 10) == 0


def test_the_section_is_appended_once_then_replaced(tmp_path: pathlib.Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\nBody.\n")
    replace_block(doc, "first", name="recovery", heading=recovery.HEADING)
    replace_block(doc, "second", name="recovery", heading=recovery.HEADING)
    assert doc.read_text() == (
        f"# Title\n\nBody.\n\n{recovery.HEADING}\n\n"
        "<!-- recovery:begin -->\nsecond\n<!-- recovery:end -->\n"
    )


def test_a_block_is_replaced_and_the_page_around_it_kept(tmp_path: pathlib.Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text("# Page\n\n<!-- mine:begin -->\nold\n<!-- mine:end -->\n\nkept\n")
    replace_block(doc, "new\n", name="mine")
    assert doc.read_text() == "# Page\n\n<!-- mine:begin -->\nnew\n<!-- mine:end -->\n\nkept\n"
    with pytest.raises(SystemExit, match=r"no <!-- other:begin --> \.\.\. <!-- other:end -->"):
        replace_block(doc, "x", name="other")


def test_the_printed_command_leaves_out_where_it_was_written() -> None:
    argv = ["--repeats", "2", "--write", "docs/x.md", "--source=parquet", "--write=y.md"]
    assert drop_options(argv, "--write") == ["--repeats", "2", "--source=parquet"]
