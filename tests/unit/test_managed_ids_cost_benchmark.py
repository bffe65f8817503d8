"""benchmarks.managed_ids_cost on its tiny settings (one in-process rank, nothing timed is
asserted): every repeat times both sides and the remap on the same batch, the merges run at the
sync cadence, and the page gets the cost table beside the AUC table, which stays."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

import pytest

from benchmarks import managed_ids_cost


def test_tiny_run_times_both_sides_and_writes_the_table(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = tmp_path / "managed_ids.md"
    page.write_text(
        "## Measured\n\n<!-- managed-ids:begin -->\nAUC table\n<!-- managed-ids:end -->\n"
    )
    seen: list[managed_ids_cost.Timings] = []
    render = managed_ids_cost.render

    def spy(a: Any, results: Sequence[managed_ids_cost.Timings]) -> list[str]:
        seen.extend(results)
        return render(a, results)

    monkeypatch.setattr(managed_ids_cost, "render", spy)
    argv = ["--tiny", "--write", str(page)]
    assert managed_ids_cost.main(argv) == 0
    assert [r.batch_size for r in seen] == [32, 48]
    for r in seen:
        assert len(r.with_remap) == len(r.remap) == len(r.without) == 6
        # Two steps a repeat, a merge every 4 steps (sync_every), the warmup's dropped.
        assert len(r.merge) == 3
        assert min(r.with_remap + r.remap + r.without + r.merge) > 0
    text = page.read_text()
    assert "AUC table" in text and "### Cost of the remap" in text
    assert "python -m benchmarks.managed_ids_cost --tiny" in text
    rows = [
        line for line in text.splitlines() if line.startswith("| 32 |") or line.startswith("| 48 |")
    ]
    assert len(rows) == 2 and all(len(row.split("|")) == 12 for row in rows)
