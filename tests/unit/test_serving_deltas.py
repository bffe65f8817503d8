"""Deltas beside a base export: base + every delta equals, bit for bit, a full export of the
model at the last published step; a missing, repeated, out-of-place, foreign or corrupt delta is
refused naming it; a half-written delta is not seen. Built in one process without Ray."""

from __future__ import annotations

import re
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_serving import IDS, save_final_model, trained_like_model
from torchrec.models.dlrm import DLRMTrain

from raytrec.serving import deltas
from raytrec.serving.deltas import (
    DELTAS,
    DeltaError,
    DeltaWriter,
    TableRows,
    published_deltas,
    write_delta,
)
from raytrec.serving.export import STATE_FILE, base_id, export, load_exported, load_model

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def full_export(model: DLRMTrain, root: Path, name: str) -> Path:
    """``raytrec.export`` of ``model`` saved as a job saves its final model."""
    save_final_model(model, root / f"{name}_saved")
    export(str(root / f"{name}_saved"), root / name, program=False, quiet=True)
    return root / name


def train_a_little(
    model: DLRMTrain, seed: int, fraction: float
) -> tuple[dict[str, TableRows], dict[str, torch.Tensor]]:
    """Changes a random ``fraction`` of each table's rows and every dense tensor, as a few
    training steps would; what changed, as a delta holds it (rows, dense state)."""
    g = torch.Generator().manual_seed(seed)
    rows: dict[str, TableRows] = {}
    with torch.no_grad():
        for key, value in model.model.state_dict().items():
            if "embedding_bags" in key:
                ids = torch.randperm(value.shape[0], generator=g)[: int(fraction * value.shape[0])]
                value[ids] += torch.randn(len(ids), value.shape[1], generator=g)
                rows[key] = (ids, value[ids])
            else:
                value += torch.randn(value.shape, generator=g)
    dense = {k: v for k, v in model.model.state_dict().items() if "embedding_bags" not in k}
    return rows, dense


def assert_equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A base export, three deltas published after it, and a full export at the last one."""
    root = tmp_path_factory.mktemp("deltas")
    model = trained_like_model(1)
    base = full_export(model, root, "base")
    writer = DeltaWriter(str(base), base_id(base))
    for seq, (step, fraction) in enumerate([(4, 0.1), (8, 0.3), (12, 0.05)], start=1):
        rows, dense = train_a_little(model, seed=100 + seq, fraction=fraction)
        assert writer.publish(step, rows, dense) == seq
    writer.wait()
    return {"base": base, "full": full_export(model, root, "full"), "root": root}


def copy_of(published: dict[str, Path], tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(published["base"], out)
    return out


def test_base_and_every_delta_equal_a_full_export_bit_for_bit(
    published: dict[str, Path],
) -> None:
    base, full = published["base"], published["full"]
    assert sorted(p.name for p in (base / DELTAS).iterdir()) == ["000001", "000002", "000003"]
    applied, info = load_exported(base)
    assert info.step == 12 and info.program is None
    expected = torch.load(full / STATE_FILE, weights_only=True)
    assert_equal_states(applied.state_dict(), expected)
    assert_equal_states(load_model(full).state_dict(), expected)
    # The base alone is the model before the deltas.
    base_state = torch.load(base / STATE_FILE, weights_only=True)
    assert not torch.equal(
        base_state["over_arch.model.1.weight"], expected["over_arch.model.1.weight"]
    )
    # A delta holds the touched rows only: far smaller than the tables.
    rows = torch.load(base / DELTAS / "000003" / "rows.pt", weights_only=True)
    assert all(t["ids"].numel() == int(0.05 * IDS) for t in rows.values())


def test_a_missing_delta_is_refused(published: dict[str, Path], tmp_path: Path) -> None:
    out = copy_of(published, tmp_path)
    shutil.rmtree(out / DELTAS / "000002")
    with pytest.raises(
        DeltaError, match=r"delta 2 is missing: .*000003 \(delta 3\) follows .*000001"
    ):
        load_model(out)
    shutil.rmtree(out / DELTAS / "000001")
    with pytest.raises(DeltaError, match=r"delta 1 is missing: .*000003 .* follows the base"):
        load_model(out)


def test_a_repeated_or_renamed_delta_is_refused(published: dict[str, Path], tmp_path: Path) -> None:
    out = copy_of(published, tmp_path)
    shutil.copytree(out / DELTAS / "000002", out / DELTAS / "000004")
    with pytest.raises(
        DeltaError, match=r"delta 2 is published more than once: .*000002, .*000004"
    ):
        load_model(out)
    shutil.rmtree(out / DELTAS / "000002")
    with pytest.raises(DeltaError, match="sequence 2, its name 000004"):
        load_model(out)


def test_a_delta_of_another_base_is_refused(published: dict[str, Path], tmp_path: Path) -> None:
    other = full_export(trained_like_model(1), tmp_path, "other")  # same weights, another export
    shutil.copytree(published["base"] / DELTAS, other / DELTAS)
    with pytest.raises(DeltaError, match=f"000001 belongs to base {base_id(published['base'])}"):
        load_model(other)


def test_a_corrupt_delta_is_refused(published: dict[str, Path], tmp_path: Path) -> None:
    out = copy_of(published, tmp_path)
    file = out / DELTAS / "000002" / "dense.pt"
    data = bytearray(file.read_bytes())
    data[-100] ^= 1
    file.write_bytes(bytes(data))
    with pytest.raises(DeltaError, match=r"000002 is corrupt: dense.pt does not match"):
        load_model(out)


def test_unpublished_deltas_are_not_seen(published: dict[str, Path], tmp_path: Path) -> None:
    out = copy_of(published, tmp_path)
    # A publish that died: its hidden temporary directory, and a directory without a manifest.
    shutil.copytree(out / DELTAS / "000003", out / DELTAS / ".000004.abc")
    shutil.copytree(out / DELTAS / "000003", out / DELTAS / "000004")
    (out / DELTAS / "000004" / "manifest.json").unlink()
    assert [Path(p).name for p, _ in published_deltas(str(out))] == ["000001", "000002", "000003"]
    expected = torch.load(published["full"] / STATE_FILE, weights_only=True)
    assert_equal_states(load_model(out).state_dict(), expected)
    # The next publish takes number 4, over the unpublished leftover.
    rows, dense = {}, {k: v for k, v in expected.items() if "embedding_bags" not in k}
    write_delta(str(out), base_id=base_id(out), seq=4, step=13, rows=rows, dense=dense)
    assert load_exported(out)[1].step == 13


def test_a_failed_publish_leaves_nothing_visible_and_is_raised(
    published: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = copy_of(published, tmp_path)
    writer = DeltaWriter(str(out), base_id(out))
    assert writer.seq == 3

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    writer.publish(16, {}, {})
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    assert sorted(p.name for p in (out / DELTAS).iterdir()) == ["000001", "000002", "000003"]
    monkeypatch.undo()
    with pytest.raises(DeltaError, match=r"delta 6 cannot be published .* the next delta is 4"):
        write_delta(str(out), base_id=base_id(out), seq=6, step=20, rows={}, dense={})
    assert writer.publish(16, {}, {}) == 4
    writer.wait()
    assert load_exported(out)[1].step == 16


def test_publish_writes_the_tensors_as_they_were_when_called(
    published: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training goes on while the delta is written: what it changes is not in the delta."""
    out = copy_of(published, tmp_path)
    go = threading.Event()
    write = deltas.write_delta

    def held_back(*args: Any, **kwargs: Any) -> str:
        go.wait(timeout=30)
        return write(*args, **kwargs)

    monkeypatch.setattr(deltas, "write_delta", held_back)
    model = load_model(out)
    table = "sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight"
    state = model.state_dict()
    expected = {k: v.clone() for k, v in state.items()}
    dense = {k: v for k, v in state.items() if "embedding_bags" not in k}
    ids = torch.tensor([3, 7])
    rows = {table: (ids, state[table][ids])}
    writer = DeltaWriter(str(out), base_id(out))
    writer.publish(20, rows, dense)
    for value in [*dense.values(), *rows[table]]:
        value.add_(1)  # the next training step, in place
    go.set()
    writer.wait()
    assert_equal_states(load_model(out).state_dict(), expected)


def test_the_documented_loader_without_raytrec(published: dict[str, Path], tmp_path: Path) -> None:
    """The code docs/serving.md shows gives the same state, and refuses a gap."""
    code = re.search(r"<!-- delta-loader -->\n```python\n(.*?)```", DOCS.read_text(), re.S)
    assert code is not None
    scope: dict[str, object] = {}
    exec(code.group(1), scope)
    load_state = scope["load_state"]
    expected = torch.load(published["full"] / STATE_FILE, weights_only=True)
    assert_equal_states(load_state(str(published["base"])), expected)  # type: ignore[operator]
    out = copy_of(published, tmp_path)
    shutil.rmtree(out / DELTAS / "000002")
    with pytest.raises(ValueError, match="000003"):
        load_state(str(out))  # type: ignore[operator]
