"""Day partitions of the planted teacher's data, landed one at a time (for a growing source).

:func:`stage_days` writes ``days`` files of synthetic rows (:func:`~raytrec.data.generate.
write_synthetic_parquet`: one teacher, ``row_id`` ``0..N-1`` across the days, so exactly-once
can be checked by row id) under ``<root>/_staging``, a name every listing skips.
:meth:`DayLander.land` then moves day ``i`` into place as ``<root>/day=YYYY-MM-DD/part-0.parquet``
with one rename on the same filesystem: a reader never sees a partial file (the contract of
``data.growing``). ``python -m jobs.land_days`` runs a lander from the command line.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

from raytrec.data.generate import GeneratedData, write_synthetic_parquet

__all__ = ["DayLander", "stage_days"]

STAGING = "_staging"


@dataclasses.dataclass(frozen=True)
class DayLander:
    """Lands the staged days of :func:`stage_days` into ``root``, first day ``first``."""

    root: str
    staged: tuple[str, ...]
    first: datetime.date
    rows: int

    def day_dir(self, i: int) -> str:
        return os.path.join(self.root, f"day={self.first + datetime.timedelta(days=i)}")

    def land(self, i: int) -> str:
        """Moves day ``i`` into place (one rename); returns its path."""
        os.makedirs(self.day_dir(i), exist_ok=True)
        path = os.path.join(self.day_dir(i), "part-0.parquet")
        os.utime(self.staged[i])  # written now, as far as a reader can tell: its landing time
        os.replace(self.staged[i], path)
        return path

    def landed(self) -> list[str]:
        """The days in place so far."""
        out = [os.path.join(self.day_dir(i), "part-0.parquet") for i in range(len(self.staged))]
        return [p for p in out if os.path.exists(p)]


def stage_days(
    root: str,
    *,
    days: int,
    rows_per_day: int,
    row_groups_per_day: int = 2,
    seed: int = 0,
    num_embeddings: int = 10_000,
    first: str = "2026-11-27",
) -> tuple[DayLander, GeneratedData]:
    """Writes ``days`` days of ``rows_per_day`` rows into ``<root>/_staging`` (see the module
    doc); returns the lander and what was written (its oracle AUC)."""
    stage = os.path.join(root, STAGING)
    data = write_synthetic_parquet(
        stage,
        rows=days * rows_per_day,
        files=days,
        row_groups_per_file=row_groups_per_day,
        seed=seed,
        num_embeddings=num_embeddings,
    )
    start = datetime.date.fromisoformat(first)
    return DayLander(root, data.paths, start, rows_per_day), data
