"""The run plot: loss and AUC against step, events drawn where they happened."""

from __future__ import annotations

import pathlib
import struct

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb

from raytrec.observability.plots import (
    FAILURE_COLOR,
    GENERATION_COLOR,
    OTHER_COLOR,
    build_figure,
    event_label,
    event_style,
    generation_events,
    marks,
    plot_run,
)


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


@pytest.mark.parametrize(
    ("event", "label", "color"),
    [
        ({"step": 5, "kind": "rank_lost", "rank": 3}, "rank lost (rank 3)", FAILURE_COLOR),
        (
            {"step": 5, "kind": "rank_died", "job_rank": 3, "gang_id": 1, "cause": "x"},
            "rank died (rank 3, gang 1)",
            FAILURE_COLOR,
        ),
        ({"step": 5, "kind": "gang_dropped", "gang_id": 1}, "gang dropped (gang 1)", FAILURE_COLOR),
        ({"step": 5, "kind": "node_died", "node": 0}, "node died (node 0)", FAILURE_COLOR),
        ({"step": 5, "kind": "generation", "generation": 2}, "generation 2", GENERATION_COLOR),
        (
            {"step": 5, "kind": "generation_started", "generation": 3, "gang_ids": [0, 2]},
            "generation 3",
            GENERATION_COLOR,
        ),
        ({"step": 5, "kind": "hang_detected"}, "hang detected", FAILURE_COLOR),
        (
            {"step": 10, "kind": "total_loss", "lost_gangs": [0, 1], "checkpoint_step": 8},
            "total loss (back to step 8)",
            FAILURE_COLOR,
        ),
        ({"step": 5, "kind": "gang_requested", "count": 1}, "gang requested", OTHER_COLOR),
        ({"step": 5, "kind": "checkpoint", "label": "saved"}, "saved", OTHER_COLOR),
    ],
)
def test_event_labels_and_colors(event: dict, label: str, color: str) -> None:
    assert event_label(event) == label
    assert event_style(event) == color


def test_marks_keep_failures_and_generations_one_line_per_step() -> None:
    events = [
        {"step": 30, "kind": "generation_started", "generation": 1},
        {"step": 30, "kind": "rank_died", "job_rank": 2},
        {"step": 30, "kind": "gang_dropped", "gang_id": 1},
        {"step": 31, "kind": "gang_requested", "count": 1},  # bookkeeping: not drawn
        {"step": 50, "kind": "gang_joined", "gang_id": 2, "label": "gang 2 joined"},
        {"step": 0, "kind": "generation_started", "generation": 0},  # the start: not drawn
        {"step": 10, "kind": "generation", "generation": 4},
    ]
    assert marks(events) == [
        (10, "generation 4", GENERATION_COLOR),
        (30, "generation 1; rank died (rank 2); gang dropped (gang 1)", FAILURE_COLOR),
        (50, "gang 2 joined", OTHER_COLOR),
    ]


def test_generation_changes_become_events_at_the_start_of_the_interval() -> None:
    assert generation_events(rows()) == [
        {"step": 50, "kind": "generation", "generation": 1},  # row step 60 covers (50, 60]
        {"step": 90, "kind": "generation", "generation": 2},
    ]
    assert generation_events([{"step": 1, "generation": 0}]) == []


def test_figure_plots_the_rows_and_marks_each_event_on_both_panels() -> None:
    data = rows()
    events = [{"step": 45, "kind": "rank_lost", "rank": 1}, *generation_events(data)]
    fig = build_figure(data, events, title="run")
    loss_ax, auc_ax = fig.axes
    loss_line = loss_ax.lines[0]
    assert list(loss_line.get_xdata()) == [r["step"] for r in data]
    assert list(loss_line.get_ydata()) == pytest.approx([r["loss"] for r in data])
    assert list(auc_ax.lines[0].get_ydata()) == pytest.approx([r["auc"] for r in data])
    for ax in (loss_ax, auc_ax):
        vlines = list(ax.lines)[1:]
        assert [ln.get_xdata()[0] for ln in vlines] == [45, 50, 90]
        assert [to_rgb(ln.get_color()) for ln in vlines] == [
            to_rgb(FAILURE_COLOR),
            to_rgb(GENERATION_COLOR),
            to_rgb(GENERATION_COLOR),
        ]
    assert [t.get_text() for t in loss_ax.texts] == [
        "rank lost (rank 1)",
        "generation 1",
        "generation 2",
    ]


def test_missing_auc_is_said_not_drawn() -> None:
    fig = build_figure([{"step": 1, "loss": 0.6}, {"step": 2, "loss": 0.5, "auc": None}])
    _, auc_ax = fig.axes
    assert len(auc_ax.lines) == 0
    assert [t.get_text() for t in auc_ax.texts] == ["AUC not recorded"]


def test_png_is_valid_and_the_failure_line_is_where_the_event_happened(
    tmp_path: pathlib.Path,
) -> None:
    import matplotlib.image

    data = rows()
    event = {"step": 45, "kind": "rank_lost", "rank": 1}
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
    column = image[:, round(x), :3]
    red = np.array(to_rgb(FAILURE_COLOR))
    assert np.abs(column - red).max(axis=1).min() < 0.1  # the dashed red line crosses it
    far = image[:, round(x) + 40, :3]
    assert np.abs(far - red).max(axis=1).min() > 0.2  # and nothing red 40 pixels away
