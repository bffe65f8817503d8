"""The job's events as a person reads them: the failures as a user counts them, and a short mark
for each event worth showing on the plot and in TensorBoard.

Works on event dicts (``Event.to_dict()``, the rows of ``events.jsonl``), or event values.
A user counts one failure per thing that broke: a rank that died, a node that died (its ranks
with it), a hang, a heal whose copy came out wrong. The gang peers of a dead rank, which the
coordinator ends on purpose because their gang is dropped, are not failures; neither are the
ranks that went with a dead node, nor what a failure led to (a gang dropped, a total loss).
Those stay in the events, and ``summary.json`` keeps every failure event by kind.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from raytrec.elastic.workers import NODE_DIED, PEER_RELEASED

__all__ = [
    "FAILURE_EVENT_KINDS",
    "LANES",
    "Mark",
    "as_dict",
    "counted_failures",
    "describe_failures",
    "failure_report",
    "is_failure",
    "mark_of",
    "marks_of",
]

#: Event kinds that record something breaking, each counted by kind in ``summary.json``.
FAILURE_EVENT_KINDS = (
    "rank_died",
    "node_died",
    "hang_detected",
    "heal_failed",
    "total_loss",
    "coordinator_lost",
)
#: The kinds a user counts as failures (with the rank deaths that are failures of their own).
_COUNTED = ("rank_died", "node_died", "hang_detected", "heal_failed", "coordinator_lost")
#: The rows of the plot's event strip, top to bottom, with their colour and marker.
LANES: dict[str, tuple[str, str]] = {
    "failures": ("tab:red", "X"),
    "gangs": ("tab:purple", "D"),
    "generations": ("tab:blue", "|"),
    "checkpoints": ("tab:gray", "s"),
    "other": ("tab:olive", "o"),
}
GENERATION_KINDS = ("generation", "generation_started")


def as_dict(event: Any) -> dict[str, Any]:
    """An event value's ``to_dict()``, or a mapping as a dict."""
    to_dict = getattr(event, "to_dict", None)
    return to_dict() if callable(to_dict) else dict(event)


def _ranks(value: Any) -> str:
    ranks = list(value) if isinstance(value, list | tuple) else [value]
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def is_failure(event: Mapping[str, Any]) -> bool:
    """Whether the user counts ``event`` as one failure (see the module doc)."""
    kind = event.get("kind")
    if kind == "rank_died":
        return event.get("cause") not in (PEER_RELEASED, NODE_DIED)
    return kind in _COUNTED


def _what(event: Mapping[str, Any]) -> str:
    """``rank 3 died``, ``node 1 died``, ``ranks 2, 3 hung``, ``gang 2's heal failed``."""
    kind = event.get("kind")
    if kind == "rank_died":
        return f"{_ranks(event.get('job_rank', event.get('rank', '?')))} died"
    if kind == "node_died":
        return f"node {event.get('node', '?')} died"
    if kind == "hang_detected":
        return f"{_ranks(event.get('job_ranks', ()))} hung"
    if kind == "heal_failed":
        return f"gang {event.get('gang_id', '?')}'s heal failed"
    if kind == "coordinator_lost":
        return "the coordinator died"
    return str(kind).replace("_", " ")


def counted_failures(events: Iterable[Any]) -> list[dict[str, Any]]:
    """The failures a user counts, in order: ``{"step", "kind", "what"}`` (and ``cause``)."""
    out = []
    for event in map(as_dict, events):
        if is_failure(event):
            item = {"step": event.get("step"), "kind": event["kind"], "what": _what(event)}
            if event.get("cause"):
                item["cause"] = event["cause"]
            out.append(item)
    return out


def failure_report(events: Iterable[Any]) -> dict[str, Any]:
    """``summary.json``'s ``failures``: how many a user counts and which (``count``,
    ``each``), every failure event by kind (``events``: a killed rank's gang peers included),
    and the ranks ended on purpose because their gang lost a rank (``ranks_released``)."""
    dicts = [as_dict(e) for e in events]
    kinds = collections.Counter(str(e.get("kind")) for e in dicts)
    each = counted_failures(dicts)
    released = [
        e.get("job_rank")
        for e in dicts
        if e.get("kind") == "rank_died" and e.get("cause") == PEER_RELEASED
    ]
    return {
        "count": len(each),
        "each": each,
        "events": {k: kinds[k] for k in FAILURE_EVENT_KINDS if kinds[k]},
        "ranks_released": released,
    }


# How many failures of a kind read, for a ledger line that counts them by kind.
_NOUNS = {
    "rank_died": ("rank died", "ranks died"),
    "node_died": ("node died", "nodes died"),
    "hang_detected": ("hang", "hangs"),
    "heal_failed": ("failed heal", "failed heals"),
}


def describe_failures(each: list[Mapping[str, Any]], *, name_up_to: int = 3) -> str:
    """``none``; ``1 (rank 3 died)``; ``20 (17 ranks died, 3 nodes died)`` past ``name_up_to``."""
    if not each:
        return "none"
    if len(each) <= name_up_to:
        return f"{len(each)} ({', '.join(str(f['what']) for f in each)})"
    kinds = collections.Counter(str(f["kind"]) for f in each)
    parts = [
        f"{n} {_NOUNS.get(k, (k, k))[n != 1]}"
        for k, n in sorted(kinds.items(), key=lambda kn: (-kn[1], kn[0]))
    ]
    return f"{len(each)} ({', '.join(parts)})"


@dataclasses.dataclass(frozen=True)
class Mark:
    """One event on the plot: its step, its lane (a key of :data:`LANES`), a short label for
    the strip (empty: the marker alone), the full text (TensorBoard's), and whether it counts
    in its lane's tally (what a failure led to, a total loss or the job failing, is drawn
    with the failures but does not count as one)."""

    step: int
    lane: str
    label: str
    text: str
    counts: bool = True


def _full_text(event: Mapping[str, Any], short: str) -> str:
    details = {k: v for k, v in event.items() if k not in ("kind", "at", "step", "label")}
    said = ", ".join(f"{k}={v}" for k, v in details.items())
    return f"{short}: {event.get('kind')} {said}".rstrip() if said else short


def mark_of(event: Any) -> Mark | None:
    """The mark of one event, or None for bookkeeping (placement requests, re-shares, the
    starting generation, a dead rank that is not a failure of its own)."""
    e = as_dict(event)
    kind, step = str(e.get("kind", "")), int(e.get("step", 0))
    lane, label = _lane_and_label(kind, e)
    if lane is None:
        return None
    counts = kind not in ("total_loss", "job_failed")
    return Mark(step=step, lane=lane, label=label, text=_full_text(e, label or kind), counts=counts)


def _lane_and_label(kind: str, e: Mapping[str, Any]) -> tuple[str | None, str]:
    if e.get("label"):
        return "other", str(e["label"])
    if is_failure(e):
        return "failures", _what(e)
    if kind == "total_loss":
        return "failures", f"total loss: back to step {e.get('checkpoint_step', '?')}"
    if kind == "job_failed":
        return "failures", "job failed"
    if kind in GENERATION_KINDS:
        gen = e.get("generation")
        return (None, "") if gen in (0, None) else ("generations", f"gen {gen}")
    if kind in ("gang_dropped", "gang_drained", "gang_joined"):
        return "gangs", f"gang {e.get('gang_id', '?')} {kind.removeprefix('gang_')}"
    if kind == "domain_shared":
        return "gangs", f"gang {e.get('gang_id', '?')} shares {e.get('domain', '?')}"
    if kind == "checkpoint_saved":
        return "checkpoints", ""  # the lane says it; many would crowd it
    if kind == "checkpoint_restored":
        return "checkpoints", f"restored step {e.get('saved_step', '?')}"
    if kind == "early_stopped":
        return "other", "early stop"
    if kind == "coordinator_restarted":
        return "other", f"coordinator restarted from step {e.get('checkpoint_step', 0) or 0}"
    return None, ""


def marks_of(events: Iterable[Any]) -> list[Mark]:
    """The marks of ``events``, in step order (the order given within a step)."""
    marks = [m for m in map(mark_of, events) if m is not None]
    return sorted(marks, key=lambda m: m.step)
