"""The run plot: loss and AUC against step, the job's events in a strip of markers above."""

from __future__ import annotations

import pathlib
import struct
from typing import Any

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb

from raytrec.elastic.workers import NODE_DIED, PEER_RELEASED
from raytrec.observability.incidents import (
    LANES,
    counted_failures,
    describe_failures,
    failure_report,
    mark_of,
)
from raytrec.observability.plots import build_figure, generation_events, plot_run

RED = to_rgb(LANES["failures"][0])
BLUE = to_rgb(LANES["generations"][0])


def rows(n: int = 12, every: int = 10) -> list[dict]:
    return [
        {
            "step": every * (i + 1),
            "steps": every,
            "loss": 0.7 - 0.02 * i,
            "auc": 0.55 + 0.01 * i,
            "generation": 0 if i < 5 else (1 if i < 9 else 2),
        }
        for i in range(n)
    ]


def died(step: int, rank: int, cause: str = "ActorDiedError: exited") -> dict:
    return {
        "step": step,
        "kind": "rank_died",
        "job_rank": rank,
        "gang_id": rank // 2,
        "cause": cause,
    }


@pytest.mark.parametrize(
    ("event", "lane", "label"),
    [
        (died(5, 3), "failures", "rank 3 died"),
        (died(5, 2, PEER_RELEASED), None, None),  # ended by raytrec: its gang lost rank 3
        (died(5, 2, NODE_DIED), None, None),  # the node's death is the failure
        ({"step": 5, "kind": "node_died", "node": 1, "gang_ids": [0]}, "failures", "node 1 died"),
        ({"step": 5, "kind": "hang_detected", "job_ranks": [2, 3]}, "failures", "ranks 2, 3 hung"),
        ({"step": 5, "kind": "heal_failed", "gang_id": 4}, "failures", "gang 4's heal failed"),
        (
            {"step": 10, "kind": "total_loss", "lost_gangs": [0, 1], "checkpoint_step": 8},
            "failures",
            "total loss: back to step 8",
        ),
        ({"step": 5, "kind": "gang_dropped", "gang_id": 1}, "gangs", "gang 1 dropped"),
        ({"step": 5, "kind": "gang_joined", "gang_id": 2}, "gangs", "gang 2 joined"),
        ({"step": 5, "kind": "gang_drained", "gang_id": 0}, "gangs", "gang 0 drained"),
        ({"step": 5, "kind": "generation", "generation": 2}, "generations", "gen 2"),
        ({"step": 0, "kind": "generation_started", "generation": 0}, None, None),  # the start
        ({"step": 5, "kind": "checkpoint_saved", "uri": "x"}, "checkpoints", ""),
        (
            {"step": 5, "kind": "checkpoint_restored", "saved_step": 8},
            "checkpoints",
            "restored step 8",
        ),
        ({"step": 5, "kind": "failed_step_settled", "dense_through": 4}, None, None),
        ({"step": 5, "kind": "data_reshared", "end_step": 40}, None, None),
        ({"step": 5, "kind": "gang_requested", "count": 1}, None, None),
        ({"step": 5, "kind": "custom", "label": "lr halved"}, "other", "lr halved"),
    ],
)
def test_each_event_has_a_lane_and_a_short_label_or_none(
    event: dict, lane: str | None, label: str | None
) -> None:
    mark = mark_of(event)
    if lane is None:
        assert mark is None
        return
    assert mark is not None
    assert (mark.step, mark.lane, mark.label) == (event["step"], lane, label)
    assert mark.text.startswith(label or event["kind"])
    assert mark.counts == (event["kind"] != "total_loss")  # a failure's outcome, not one more


def test_failures_are_counted_as_a_user_counts_them() -> None:
    events = [
        {"step": 0, "kind": "generation_started", "generation": 0},
        died(100, 3),  # the kill
        died(100, 2, PEER_RELEASED),  # its gang peer, ended by the coordinator
        {"step": 120, "kind": "gang_dropped", "gang_id": 1},
        {"step": 200, "kind": "node_died", "node": 2, "gang_ids": [2]},
        died(200, 4, NODE_DIED),
        died(200, 5, NODE_DIED),
    ]
    each = counted_failures(events)
    assert [(f["step"], f["what"]) for f in each] == [(100, "rank 3 died"), (200, "node 2 died")]
    report = failure_report(events)
    assert report["count"] == 2 and report["each"] == each
    assert report["events"] == {"rank_died": 4, "node_died": 1}  # every failure event
    assert report["ranks_released"] == [2]
    assert describe_failures(each) == "2 (rank 3 died, node 2 died)"
    assert describe_failures([]) == "none"
    many = counted_failures([died(s, s % 8) for s in range(17)] + events[4:5] * 3)
    assert describe_failures(many) == "20 (17 ranks died, 3 nodes died)"


def test_generation_changes_become_events_at_the_start_of_the_interval() -> None:
    assert generation_events(rows()) == [
        {"step": 50, "kind": "generation", "generation": 1},  # row step 60 covers (50, 60]
        {"step": 90, "kind": "generation", "generation": 2},
    ]
    assert generation_events([{"step": 1, "generation": 0}]) == []


def test_figure_plots_the_rows_and_marks_events_in_the_strip_and_across_the_curves() -> None:
    data = rows()
    events = [
        died(45, 1),
        died(45, 0, PEER_RELEASED),
        {"step": 46, "kind": "gang_dropped", "gang_id": 0},
        *generation_events(data),
    ]
    fig = build_figure(data, events, title="run")
    loss_ax, auc_ax, strip = fig.axes
    loss_line = loss_ax.lines[0]
    assert list(loss_line.get_xdata()) == [r["step"] for r in data]
    assert list(loss_line.get_ydata()) == pytest.approx([r["loss"] for r in data])
    assert list(auc_ax.lines[0].get_ydata()) == pytest.approx([r["auc"] for r in data])
    # Across the curves: the failure (red) and the generation changes (blue), nothing else.
    for ax in (loss_ax, auc_ax):
        vlines = list(ax.lines)[1:]
        assert sorted((ln.get_xdata()[0], to_rgb(ln.get_color())) for ln in vlines) == [
            (45, RED),
            (50, BLUE),
            (90, BLUE),
        ]
    # The strip: one lane per kind of mark, named with its count, each marker at its step.
    lanes = [t.get_text() for t in strip.get_yticklabels()]
    assert lanes == ["failures (1)", "gangs (1)", "generations (2)"]
    offsets = [c.get_offsets().tolist() for c in strip.collections]
    assert offsets == [[[45, 0]], [[46, 1]], [[50, 2], [90, 2]]]
    assert [t.get_text() for t in strip.texts] == [
        "rank 1 died",
        "gang 0 dropped",
        "gen 1",
        "gen 2",
    ]


def test_missing_auc_is_said_not_drawn() -> None:
    fig = build_figure([{"step": 1, "loss": 0.6}, {"step": 2, "loss": 0.5, "auc": None}])
    _, auc_ax = fig.axes  # no events, no strip
    assert len(auc_ax.lines) == 0
    assert [t.get_text() for t in auc_ax.texts] == ["AUC not recorded"]


def busy_run() -> tuple[list[dict], list[dict]]:
    """600 steps with 20 failures (each with its gang peer released and its gang dropped), 20
    joins, 40 generation changes and 11 checkpoints."""
    data = rows(60)
    events: list[dict[str, Any]] = [{"step": 0, "kind": "generation_started", "generation": 0}]
    for k in range(20):
        step = 15 + 29 * k
        events += [
            died(step, 2 * k + 1),
            died(step, 2 * k, PEER_RELEASED),
            {"step": step, "kind": "gang_dropped", "gang_id": k},
            {"step": step, "kind": "generation_started", "generation": 2 * k + 1},
            {"step": step + 12, "kind": "gang_joined", "gang_id": 20 + k},
            {"step": step + 12, "kind": "generation_started", "generation": 2 * k + 2},
        ]
    events += [{"step": s, "kind": "checkpoint_saved", "uri": f"c{s}"} for s in range(50, 600, 50)]
    return data, sorted(events, key=lambda e: e["step"])


def heights(fig: Any) -> list[float]:
    """Each axes' drawn height as a share of the figure's height."""
    FigureCanvasAgg(fig).draw()
    return [ax.get_window_extent().height / fig.bbox.height for ax in fig.axes]


def test_many_events_leave_the_curves_their_room() -> None:
    data, events = busy_run()
    fig = build_figure(data, events, title="busy")
    loss_h, auc_h, strip_h = heights(fig)
    bare_loss_h, bare_auc_h = heights(build_figure(data, [], title="busy"))
    # The curves keep most of the figure: each over a third of it, at least 3/4 of their
    # height without events, and the strip of four lanes under a fifth.
    assert loss_h > 0.33 and auc_h > 0.33, (loss_h, auc_h)
    assert loss_h > 0.75 * bare_loss_h and auc_h > 0.75 * bare_auc_h
    assert strip_h < 0.2
    loss_ax, auc_ax, strip = fig.axes
    assert list(loss_ax.lines[0].get_xdata()) == [r["step"] for r in data]
    assert list(auc_ax.lines[0].get_ydata()) == pytest.approx([r["auc"] for r in data])
    lanes = [t.get_text() for t in strip.get_yticklabels()]
    assert lanes == ["failures (20)", "gangs (40)", "generations (40)", "checkpoints (11)"]
    assert not strip.texts  # too crowded for labels: the markers say it


def test_strip_labels_go_where_they_fit() -> None:
    """Labels right of their marker, left of it at the right edge, none where it would cover
    another label or marker: inside the strip, none over another."""
    steps = (100, 112, 300, 560, 598)
    fig = build_figure(rows(60), [died(s, k) for k, s in enumerate(steps)])
    FigureCanvasAgg(fig).draw()
    strip = fig.axes[2]
    shown = {t.xy[0]: t.get_text() for t in strip.texts}
    # 100 and 560 left of their marker (text aligned right: 112's and 598's markers are on
    # their right); 598: no room either side of it.
    assert shown == {100: "rank 0 died", 112: "rank 1 died", 300: "rank 2 died", 560: "rank 3 died"}
    sides = {t.xy[0]: t.get_horizontalalignment() for t in strip.texts}
    assert sides == {100: "right", 112: "left", 300: "left", 560: "right"}
    boxes = [t.get_window_extent() for t in strip.texts]
    dots = strip.transData.transform([(s, 0) for s in steps])
    inside = strip.get_window_extent()
    for i, box in enumerate(boxes):
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1
        assert not any(box.overlaps(other) for other in boxes[i + 1 :])
        assert not any(box.x0 - 2 <= x <= box.x1 + 2 for x, _ in dots)


def test_png_is_valid_and_the_failure_line_is_where_the_event_happened(
    tmp_path: pathlib.Path,
) -> None:
    import matplotlib.image

    data = rows()
    event = died(45, 1)
    path = plot_run(data, [event], str(tmp_path / "sub" / "plot.png"))
    raw = pathlib.Path(path).read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    assert raw[12:16] == b"IHDR"
    width, height = struct.unpack(">II", raw[16:24])
    assert (width, height) == (900, 600)  # figsize (9, 6) at 100 dpi
    assert len(raw) > 20_000
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (600, 900)

    # Where the event's step falls on the loss panel, in the saved image's pixels.
    fig = build_figure(data, [event])
    FigureCanvasAgg(fig).draw()
    loss_ax = fig.axes[0]
    x, _y = loss_ax.transData.transform((45, float(np.mean(loss_ax.get_ylim()))))
    bottom, top = (600 - round(v) for v in loss_ax.get_window_extent().intervaly)
    column = image[top:bottom, round(x), :3]
    red = np.array(RED)
    assert np.abs(column - red).max(axis=1).min() < 0.1  # the dashed red line crosses it
    far = image[top:bottom, round(x) + 40, :3]
    assert np.abs(far - red).max(axis=1).min() > 0.2  # and nothing red 40 pixels away
