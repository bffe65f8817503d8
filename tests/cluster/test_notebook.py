"""examples/quickstart.ipynb runs top to bottom in a fresh kernel and trains (local Ray cluster)."""

from __future__ import annotations

import ast
import base64
import math
import pathlib
import struct

import pytest

pytestmark = pytest.mark.cluster

NOTEBOOK = pathlib.Path(__file__).resolve().parents[2] / "examples" / "quickstart.ipynb"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def outputs_text(cell: dict) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out["text"])
        elif "data" in out and "text/plain" in out["data"]:
            parts.append(out["data"]["text/plain"])
    return "".join(parts)


def png_size(b64: str) -> tuple[int, int, int]:
    data = base64.b64decode(b64)
    assert data[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    return width, height, len(data)


def test_quickstart_notebook_trains_and_plots(tmp_path: pathlib.Path) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    # No stored outputs: what the test reads below was produced by this run.
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
    NotebookClient(
        nb,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    ).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]

    assert "2 gangs x 1 rank(s)" in outputs_text(code[0])
    assert (tmp_path / "quickstart.yaml").is_file()

    # The training cell printed one line per interval of log_every=5 steps, then the summary.
    train_text = outputs_text(code[2])
    steps = [
        int(line.split()[2].split("/")[0])
        for line in train_text.splitlines()
        if line.startswith("[raytrec] step")
    ]
    assert steps == [5, 10, 15, 20, 25, 30, 35, 40]
    assert "40 steps in" in train_text

    # The dataframe has one row per interval, and the loss plots are real images.
    assert "loss" in outputs_text(code[3])
    images = [
        out["data"]["image/png"]
        for c in code[4:6]
        for out in c.get("outputs", [])
        if "data" in out and "image/png" in out["data"]
    ]
    assert len(images) == 2
    for b64 in images:
        width, height, size = png_size(b64)
        assert width >= 300 and height >= 200 and size > 10_000
    runs = list((tmp_path / "runs").glob("quickstart-*/metrics.png"))
    assert len(runs) == 1

    # The last cell's value: first and last interval losses; training lowered the loss.
    final = ast.literal_eval(outputs_text(code[-1]))
    first, last = final["first_loss"], final["last_loss"]
    assert math.isfinite(first) and math.isfinite(last)
    assert 0 < last < first, final
