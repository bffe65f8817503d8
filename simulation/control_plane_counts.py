"""How much of the control plane a reader must follow, counted from the code.

``python -m simulation.control_plane_counts`` prints:

- the project files whose code runs while the job goes from a rank death to its next
  generation: one schedule of the fault-space simulation (one rank dies mid-interval), traced
  from the moment a ``RankLost`` reaches a frame of ``actors/`` to the event
  ``GenerationStarted`` that follows (files of ``actors/`` and ``raytrec/``; the fake's own
  files in ``simulation/`` are not counted);
- the loops in ``actors/`` that retry or poll (``for _ in range(...)`` and ``while True``);
- the places that call ``decide(`` (``actors/`` and ``raytrec/``, its definition aside), and
  those that call a wrapper of it (``self.decide(``, ``self._decide(``);
- the ``except RankCallError`` handlers in ``actors/``;
- the five largest modules of ``actors/`` and ``raytrec/elastic/``.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import types
from typing import Any

from simulation.fault_schedule import Schedule, Settings
from simulation.fault_space import run_schedule

ROOT = pathlib.Path(__file__).resolve().parent.parent


def rank_death_files() -> list[str]:
    """The project files run between a rank's death being seen and the next generation."""
    seen: list[str] = []
    state = {"on": False, "done": False}

    def local(frame: types.FrameType, event: str, arg: Any) -> Any:
        # The coordinator sees the death: a RankLost raised into one of its own frames.
        if event == "exception" and not state["done"] and type(arg[1]).__name__ == "RankLost":
            state["on"] = state["on"] or frame.f_code.co_filename.startswith(str(ROOT / "actors"))
        return local

    def trace(frame: types.FrameType, event: str, _arg: Any) -> Any:
        if state["done"]:
            return None
        frame.f_trace_lines = False
        path = frame.f_code.co_filename
        if state["on"]:
            if frame.f_code.co_name == "append" and path.endswith("elastic/events.py"):
                appended = frame.f_locals.get("events", ())
                if any(type(e).__name__ == "GenerationStarted" for e in appended):
                    state["on"], state["done"] = False, True
                    return None
            rel = pathlib.Path(path)
            if rel.is_relative_to(ROOT):
                name = str(rel.relative_to(ROOT))
                if name.startswith(("actors/", "raytrec/")) and name not in seen:
                    seen.append(name)
        return local

    schedule = Schedule(Settings(), ({"kind": "rank_dies", "rank": 2, "step": 5},), seed=1)
    sys.settrace(trace)
    try:
        outcome = run_schedule(schedule)
    finally:
        sys.settrace(None)
    assert outcome.verdict == "pass", outcome
    return seen


def _grep(pattern: str, folders: tuple[str, ...]) -> list[str]:
    hits = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(pattern, line.split("#")[0]):  # code, not a comment
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    return hits


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    files = rank_death_files()
    control = [f for f in files if f.startswith("actors/")]
    print(f"files run from a rank death to the next generation: {len(files)}")
    print(
        f"  of them in actors/ (the control flow; raytrec/ holds values and rules): {len(control)}"
    )
    for f in files:
        print(f"  {f}")
    sections = {
        "retry or poll loops in actors/": _grep(r"for _ in range\(|while True", ("actors",)),
        "calls of decide(": [
            h for h in _grep(r"(?<![\w.])decide\(", ("actors", "raytrec")) if "def decide(" not in h
        ],
        "calls of a wrapper of it (self.decide(, self._decide()": _grep(
            r"self\._?decide\(", ("actors",)
        ),
        "except RankCallError handlers in actors/": _grep(r"except RankCallError", ("actors",)),
    }
    for title, hits in sections.items():
        print(f"{title}: {len(hits)}")
        for h in hits:
            print(f"  {h}")
    sizes = sorted(
        (len(p.read_text().splitlines()), str(p.relative_to(ROOT)))
        for folder in ("actors", "raytrec/elastic")
        for p in (ROOT / folder).glob("*.py")
    )
    print("largest modules:")
    for n, p in reversed(sizes[-5:]):
        print(f"  {n:4d} {p}")


if __name__ == "__main__":
    main()
