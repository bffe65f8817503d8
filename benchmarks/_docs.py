"""Writing a benchmark's results into its page under docs/, leaving the rest of the page alone.

Two ways a benchmark owns part of a page: a whole ``## `` section (everything from its heading to
the next ``## ``), or a block between two HTML comment markers. Both re-read the page right before
writing and replace it atomically, so an edit of another part made meanwhile survives.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["replace_block", "replace_section"]


def replace_section(path: Path, text: str, *, heading: str, title: str = "# Benchmarks") -> None:
    """Replaces the section that starts with the line ``heading`` by ``text`` (which starts with
    that heading); appends it when the page has none yet (a new page starts with ``title``)."""
    old = path.read_text() if path.exists() else f"{title}\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, x in enumerate(lines) if x.rstrip() == heading), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        rest = "".join(lines[end:])
        new = "".join(lines[:start]) + text + ("\n" + rest if rest else "")
    _write(path, new)


def replace_block(
    path: Path, block: str, *, begin: str, end: str, heading: str | None = None
) -> None:
    """Replaces what stands between the markers ``begin`` and ``end`` by ``block``. When the page
    has no such markers: appends them, under ``heading``, as a new last section if a heading is
    given, else refuses (the page says where the block goes)."""
    text = path.read_text()
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        _write(path, f"{head}{begin}\n{block}\n{end}{tail}")
    elif heading is not None:
        _write(path, f"{text.rstrip()}\n\n{heading}\n\n{begin}\n{block}\n{end}\n")
    else:
        raise SystemExit(f"{path} has no {begin} ... {end} block to replace")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
