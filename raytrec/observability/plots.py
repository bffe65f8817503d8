"""A PNG of a run: loss and AUC over steps, with failures and generation changes marked.

Input is plain data: metrics rows (mappings with at least ``step`` and ``loss``; ``auc``,
``eval_auc`` and ``eval_log_loss`` when the run measured them) and events, mappings
``{"step": int, "kind": str, ...}`` such as
``{"step": 120, "kind": "rank_died", "job_rank": 3}`` or ``{"step": 140, "kind": "generation",
"generation": 2}`` (the elastic event log's ``to_dicts()`` rows are of this shape). Failures and
generation changes are marked, labelled from the kind and the keys that name a rank, gang or
node.
The figure is drawn with matplotlib's Agg canvas directly (no pyplot state), so it works on a
driver with no display and in threads.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "build_figure",
    "event_label",
    "event_style",
    "generation_events",
    "marks",
    "plot_run",
]

# Event kinds that mean something broke (drawn red); generation changes are drawn blue. Other
# kinds (placement requests and the like) are bookkeeping and are not drawn unless labelled.
FAILURE_WORDS = (
    "lost",
    "total_loss",
    "fail",
    "died",
    "dead",
    "dropped",
    "timeout",
    "hang",
    "error",
)
GENERATION_KINDS = ("generation", "generation_started")
FAILURE_COLOR = "tab:red"
GENERATION_COLOR = "tab:blue"
OTHER_COLOR = "tab:gray"
# Event keys worth naming in a label, and the word for each.
_DETAIL_KEYS: tuple[tuple[str, str], ...] = (
    ("rank", "rank"),
    ("job_rank", "rank"),
    ("gang", "gang"),
    ("gang_id", "gang"),
    ("node", "node"),
    ("checkpoint_step", "back to step"),
)


def event_label(event: Mapping[str, Any]) -> str:
    """``{"kind": "rank_died", "job_rank": 3}`` -> ``"rank died (rank 3)"``; ``label`` wins."""
    if event.get("label"):
        return str(event["label"])
    kind = str(event.get("kind", "event"))
    if kind in GENERATION_KINDS and "generation" in event:
        return f"generation {event['generation']}"
    text = kind.replace("_", " ")
    details = [f"{word} {event[k]}" for k, word in _DETAIL_KEYS if event.get(k) is not None]
    return f"{text} ({', '.join(details)})" if details else text


def event_style(event: Mapping[str, Any]) -> str:
    """The line colour of an event: failures red, generation changes blue, the rest gray."""
    kind = str(event.get("kind", "")).lower()
    if kind in GENERATION_KINDS:
        return GENERATION_COLOR
    if any(word in kind for word in FAILURE_WORDS):
        return FAILURE_COLOR
    return OTHER_COLOR


def marks(events: Iterable[Mapping[str, Any]]) -> list[tuple[int, str, str]]:
    """The vertical lines to draw: ``(step, label, color)``, one per step, in step order.

    Failures and generation changes (not generation 0, the start) are drawn, and any event
    that carries a ``label``. Events at the same step share one line (a rank's death and the
    generation it starts often do), labelled with all of them and red if any is a failure.
    """
    by_step: dict[int, list[Mapping[str, Any]]] = {}
    for event in events:
        if event_style(event) == GENERATION_COLOR and event.get("generation") == 0:
            continue  # generation 0 is the starting membership, not a change
        if event_style(event) != OTHER_COLOR or event.get("label"):
            by_step.setdefault(int(event["step"]), []).append(event)
    out = []
    for step in sorted(by_step):
        group = by_step[step]
        labels = list(dict.fromkeys(event_label(e) for e in group))
        colors = {event_style(e) for e in group}
        color = next((c for c in (FAILURE_COLOR, GENERATION_COLOR) if c in colors), OTHER_COLOR)
        out.append((step, "; ".join(labels), color))
    return out


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


def build_figure(
    rows: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]] = (),
    *,
    title: str = "",
) -> Any:
    """A matplotlib Figure: loss (top) and AUC (bottom) against step, the held-out evaluations'
    log loss and AUC beside the training ones, events as vertical lines."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6), dpi=100, layout="constrained")
    loss_ax, auc_ax = fig.subplots(2, 1, sharex=True)
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
    for step, label, color in marks(events):
        for ax in (loss_ax, auc_ax):
            ax.axvline(step, color=color, linestyle="--", linewidth=1.2)
        loss_ax.annotate(
            label,
            xy=(step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -3),
            textcoords="offset points",
            rotation=90,
            va="top",
            fontsize=8,
            color=color,
        )
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
    with warnings.catch_warnings():
        # Many event labels can leave the constrained layout no room; matplotlib then draws
        # the figure without it and says so on the user's terminal.
        warnings.filterwarnings("ignore", message="constrained_layout not applied")
        fig.savefig(path, format="png")
    return path
