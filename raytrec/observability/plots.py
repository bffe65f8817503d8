"""A PNG of a run: loss and AUC over steps, with the job's events in a strip of markers above.

Input is plain data: metrics rows (mappings with at least ``step`` and ``loss``; ``auc``,
``eval_auc`` and ``eval_log_loss`` when the run measured them) and events, mappings
``{"step": int, "kind": str, ...}`` such as
``{"step": 120, "kind": "rank_died", "job_rank": 3}`` or ``{"step": 140, "kind": "generation",
"generation": 2}`` (the elastic event log's ``to_dicts()`` rows are of this shape). Each event
worth showing (:func:`raytrec.observability.incidents.mark_of`) is a marker in one lane of a
thin strip above the curves (failures, gang changes, generations, checkpoints), with a short
label where there is room; failures and generation changes also draw a thin line across the
curves. The strip has a fixed share of the figure, so any number of events leaves the curves
their room. The figure is drawn with matplotlib's Agg canvas directly (no pyplot state), so it
works on a driver with no display and in threads.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from raytrec.observability.incidents import GENERATION_KINDS, LANES, Mark, marks_of

__all__ = [
    "GENERATION_KINDS",
    "build_figure",
    "generation_events",
    "plot_run",
]

# Lanes whose events also draw a line across the curves, and its style.
_LINES = {"failures": ("--", 1.0), "generations": (":", 1.0)}
# A label's width in axes fraction per character (7-point text on a ~8 inch wide axes).
_CHAR_WIDTH = 0.0068


def generation_events(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One ``generation`` event where a row's generation differs from the row before.

    A row covers steps ``(step - steps, step]``; the new generation trained from the start of
    that interval at the latest, so the event is placed there.
    """
    events: list[dict[str, Any]] = []
    previous: Any = None
    for row in rows:
        gen = row.get("generation")
        if previous is not None and gen is not None and gen != previous:
            start = row["step"] - row.get("steps", 0)
            events.append({"step": start, "kind": "generation", "generation": gen})
        if gen is not None:
            previous = gen
    return events


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            xs.append(float(row["step"]))
            ys.append(float(value))
    return xs, ys


def _strip_labels(marks: Sequence[Mark], lo: float, hi: float) -> list[tuple[Mark, str]]:
    """The marks of one lane whose label has room, with its side (``right`` of its marker,
    else ``left`` of it): a label (its width estimated from its length, as axes fraction)
    stays inside the axes and covers neither another label nor another marker. Crowded
    marks show their marker alone."""
    span = max(hi - lo, 1e-9)
    xs = [(m.step - lo) / span for m in marks]
    gap = 1.5 * _CHAR_WIDTH  # a marker's half width
    out: list[tuple[Mark, str]] = []
    free = -1.0  # where the lane is free again
    for i, (m, x) in enumerate(zip(marks, xs, strict=True)):
        if not m.label:
            free = max(free, x + gap)
            continue
        width = (len(m.label) + 1) * _CHAR_WIDTH
        others = xs[:i] + xs[i + 1 :]
        for side, a, b in (("right", x + gap, x + gap + width), ("left", x - gap - width, x)):
            inside = a >= 0.0 and b <= 1.0 and a >= free
            if inside and not any(a - gap < o < b + gap for o in others if o != x):
                out.append((m, side))
                free = max(b, x + gap)
                break
        else:
            free = max(free, x + gap)
    return out


def _one_per_step(marks: Sequence[Mark]) -> list[Mark]:
    """A lane's marks with those at one step merged: one marker, their labels joined."""
    by_step: dict[int, list[Mark]] = {}
    for m in marks:
        by_step.setdefault(m.step, []).append(m)
    return [
        dataclasses.replace(
            same[0],
            label=", ".join(dict.fromkeys(m.label for m in same if m.label)),
            text="; ".join(m.text for m in same),
        )
        for _, same in sorted(by_step.items())
    ]


def _draw_events(strip: Any, curves: Sequence[Any], marks: Sequence[Mark]) -> None:
    """The strip's lanes (only those with marks, in :data:`LANES` order, top to bottom, each
    named with its tally), their markers and labels, and the lines across the curves."""
    lanes = [lane for lane in LANES if any(m.lane == lane for m in marks)]
    strip.set_ylim(len(lanes) - 0.5, -0.5)
    names = [f"{lane} ({sum(m.lane == lane and m.counts for m in marks)})" for lane in lanes]
    strip.set_yticks(range(len(lanes)), names, fontsize=8)
    strip.tick_params(axis="y", length=0)
    strip.tick_params(axis="x", labelbottom=False)
    for side in ("top", "right", "left"):
        strip.spines[side].set_visible(False)
    strip.grid(True, axis="x", alpha=0.3)
    lo, hi = strip.get_xlim()
    for y, lane in enumerate(lanes):
        color, marker = LANES[lane]
        own = _one_per_step([m for m in marks if m.lane == lane])
        strip.scatter(
            [m.step for m in own], [y] * len(own), marker=marker, s=36, color=color, zorder=3
        )
        for m, side in _strip_labels(own, lo, hi):
            strip.annotate(
                m.label,
                xy=(m.step, y),
                xytext=(5 if side == "right" else -5, 0),
                textcoords="offset points",
                ha="left" if side == "right" else "right",
                va="center",
                fontsize=7,
                color=color,
                clip_on=True,
            )
        if lane in _LINES:
            style, width = _LINES[lane]
            steps = sorted({m.step for m in own})
            alpha = 1.0 if len(steps) <= 12 else 0.35  # many lines stay in the background
            for step in steps:
                for ax in curves:
                    ax.axvline(step, color=color, linestyle=style, linewidth=width, alpha=alpha)


def build_figure(
    rows: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]] = (),
    *,
    title: str = "",
) -> Any:
    """A matplotlib Figure: loss (top) and AUC (bottom) against step, the held-out evaluations'
    log loss and AUC beside the training ones, and, when there are events, a strip of event
    markers above them (``fig.axes``: loss, AUC, then the strip)."""
    from matplotlib.figure import Figure

    marks = marks_of(events)
    lanes = len({m.lane for m in marks})
    fig = Figure(figsize=(9, 6), dpi=100, layout="constrained")
    # The strip's height grows with its lanes (a few tenths of an inch each), whatever the
    # number of events; the curves share the rest.
    grid = fig.add_gridspec(3, 1, height_ratios=[0.25 * lanes + 0.01, 2.4, 2.4])
    loss_ax = fig.add_subplot(grid[1])
    auc_ax = fig.add_subplot(grid[2], sharex=loss_ax)
    loss_ax.tick_params(axis="x", labelbottom=False)
    xs, ys = _series(rows, "loss")
    loss_ax.plot(xs, ys, marker="o", markersize=3, color="tab:orange", label="loss")
    loss_ax.set_ylabel("training loss")
    xs, ys = _series(rows, "auc")
    held_xs, held_ys = _series(rows, "eval_auc")
    if xs:
        auc_ax.plot(
            xs, ys, marker="o", markersize=3, color="tab:green", label="training (progressive)"
        )
    if held_xs:
        # Held-out evaluations (TrainConfig.eval): the curve that tells overfitting apart.
        auc_ax.plot(held_xs, held_ys, marker="s", markersize=5, color="tab:blue", label="held-out")
        loss_ax.plot(
            *_series(rows, "eval_log_loss"),
            marker="s",
            markersize=5,
            color="tab:blue",
            label="held-out log loss",
        )
        for ax in (loss_ax, auc_ax):
            ax.legend(loc="lower right" if ax is auc_ax else "upper right", fontsize=8)
    if not xs and not held_xs:
        auc_ax.text(0.5, 0.5, "AUC not recorded", transform=auc_ax.transAxes, ha="center")
    auc_ax.set_ylabel("AUC")
    auc_ax.set_xlabel("step")
    for ax in (loss_ax, auc_ax):
        ax.grid(True, alpha=0.3)
    if marks:
        strip = fig.add_subplot(grid[0], sharex=loss_ax)
        steps = [m.step for m in marks] + [float(r["step"]) for r in rows if "step" in r]
        lo, hi = min(steps), max(steps)
        pad = max(1.0, 0.02 * (hi - lo))
        loss_ax.set_xlim(lo - pad, hi + pad)
        _draw_events(strip, (loss_ax, auc_ax), marks)
    if title:
        fig.suptitle(title)
    return fig


def plot_run(
    rows: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
    path: str,
    *,
    title: str = "",
) -> str:
    """Writes the figure of :func:`build_figure` to ``path`` as PNG; returns ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = build_figure(rows, events, title=title)
    FigureCanvasAgg(fig)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png")
    return path
