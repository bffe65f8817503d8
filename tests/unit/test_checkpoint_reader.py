"""The checkpoint reader (``raytrec.checkpoint.reader.DirectReader``) on DCP checkpoints written
by DCP's own ``FileSystemWriter``, loaded with ``dcp.load(no_dist=True)``: every kind of
destination gets the saved values, contiguous ones in place, and a bad record fails the load
before any destination is written. Milliseconds each.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan

from raytrec.checkpoint import reader as reader_module
from raytrec.checkpoint.reader import DirectReader


def saved_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "table": torch.randn(1000, 16, generator=g),  # 64,000 bytes: many chunks below
        "half": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "steps": torch.tensor(41, dtype=torch.int64),  # 0-d
        "transposed": torch.randn(6, 4, generator=g).t(),  # saved with strides (1, 4)
        "columns": torch.randn(7, 3, generator=g),
        "same_shape": torch.randn(7, 3, generator=g),  # the same pickle as "columns"
        "wide": torch.randn(5, 2, generator=g),
        "empty": torch.empty(0, 16),
        "note": {"kept": "as bytes"},  # DCP writes a non-tensor as a pickled byte item
    }


def save(path: Path, state: dict[str, Any]) -> None:
    dcp.save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True)


def test_every_destination_gets_the_saved_values_contiguous_ones_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = saved_state()
    save(tmp_path, state)
    big = torch.full((7, 8), -1.0)
    dest: dict[str, Any] = {
        "table": torch.zeros(1000, 16),
        "half": torch.zeros(7, 3, dtype=torch.bfloat16),
        "steps": torch.tensor(0, dtype=torch.int64),
        "transposed": torch.zeros(4, 6),
        "columns": big[:, 2:5],  # not contiguous: read into scratch, then copied
        "same_shape": torch.zeros(7, 3),
        "wide": torch.zeros(5, 2, dtype=torch.float64),  # another dtype: copied with a cast
        "empty": torch.zeros(0, 16),
        "note": {"kept": None},
    }
    pointers = {k: v.data_ptr() for k, v in dest.items() if isinstance(v, torch.Tensor)}
    unpickled: list[object] = []
    load = torch.load

    def counted(f: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("map_location") == "meta":
            unpickled.append(f)
        return load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counted)
    reader = DirectReader(str(tmp_path), thread_count=3, chunk_bytes=4096)
    dcp.load(dest, storage_reader=reader, no_dist=True)

    for key in ("table", "half", "steps", "transposed", "columns", "same_shape", "empty"):
        assert dest[key].dtype == state[key].dtype and torch.equal(dest[key], state[key]), key
    assert torch.equal(dest["wide"], state["wide"].double())
    assert dest["note"] == {"kept": "as bytes"}
    assert {k: v.data_ptr() for k, v in dest.items() if isinstance(v, torch.Tensor)} == pointers
    assert torch.equal(big[:, :2], torch.full((7, 2), -1.0))  # only the slice was written
    assert torch.equal(big[:, 5:], torch.full((7, 3), -1.0))
    # Each tensor record was placed from its header; the transposed one spans its whole storage.
    layouts = {index.fqn: layout for index, layout in reader.records.items()}
    # (DCP plans no read for the empty tensor.)
    assert set(layouts) == {"table", "half", "steps", "transposed", "columns", "same_shape", "wide"}
    assert len(unpickled) == len(layouts) - 1  # "same_shape" reused the header of "columns"
    assert all(layout is not None for layout in layouts.values())
    assert layouts["transposed"] is not None and layouts["transposed"].meta.stride() == (1, 4)


def test_the_same_values_as_dcps_own_reader(tmp_path: Path) -> None:
    state = saved_state()
    save(tmp_path, state)

    def fresh() -> dict[str, Any]:
        return {
            k: torch.zeros_like(v.contiguous()) if isinstance(v, torch.Tensor) else {"kept": None}
            for k, v in state.items()
        }

    ours, theirs = fresh(), fresh()
    dcp.load(ours, storage_reader=DirectReader(str(tmp_path)), no_dist=True)
    dcp.load(theirs, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value), key
        else:
            assert ours[key] == value


def test_a_record_it_cannot_place_goes_through_dcps_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = saved_state()
    save(tmp_path, state)
    # Records written on a machine of the other byte order are left to torch.load, which swaps.
    monkeypatch.setattr(reader_module, "sys", types.SimpleNamespace(byteorder="big"))
    dest = {"table": torch.zeros(1000, 16), "half": torch.zeros(7, 3, dtype=torch.bfloat16)}
    reader = DirectReader(str(tmp_path))
    dcp.load(dest, storage_reader=reader, no_dist=True)
    assert set(reader.records.values()) == {None}
    assert torch.equal(dest["table"], state["table"]) and torch.equal(dest["half"], state["half"])


def record_offsets(path: Path) -> dict[str, tuple[int, int]]:
    md = FileSystemReader(str(path)).read_metadata()
    return {index.fqn: (info.offset, info.length) for index, info in md.storage_data.items()}


def test_a_garbled_record_fails_the_load_before_any_destination_is_written(
    tmp_path: Path,
) -> None:
    state = {"a": torch.arange(64.0), "b": torch.arange(64.0) * 2}
    save(tmp_path, state)
    offset, length = record_offsets(tmp_path)["b"]
    data = tmp_path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[offset : offset + length] = b"\x5a" * length  # the whole record of "b"
    data.write_bytes(bytes(raw))
    dest = {"a": torch.full((64,), -1.0), "b": torch.full((64,), -1.0)}
    expected = rf"__0_0.distcp byte {offset}: not a readable torch.save record \('b'"
    reader = DirectReader(str(tmp_path))
    with pytest.raises(CheckpointException, match=expected):
        dcp.load(dest, storage_reader=reader, no_dist=True)
    assert not reader.started_reading
    assert torch.equal(dest["a"], torch.full((64,), -1.0))  # "a"'s record was fine: untouched
    assert torch.equal(dest["b"], torch.full((64,), -1.0))


class _CutAfterChecks(DirectReader):
    """Cuts the data file after the header checks, as a file shrunk under a load would be."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        plan = super().prepare_local_plan(plan)
        data = Path(self.path) / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[: self.cut])
        return plan

    cut = 0


def test_a_file_cut_after_the_checks_fails_naming_where(tmp_path: Path) -> None:
    save(tmp_path, {"a": torch.arange(4096.0)})
    offset, _ = record_offsets(tmp_path)["a"]
    reader = _CutAfterChecks(str(tmp_path), thread_count=1)
    reader.cut = offset + 1024  # inside the tensor's bytes (they start within the record)
    with pytest.raises(CheckpointException, match=r"__0_0.distcp: the file ends at byte \d+"):
        dcp.load({"a": torch.zeros(4096)}, storage_reader=reader, no_dist=True)
    assert reader.started_reading  # the load says the destinations may be partly written


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="thread_count must be >= 1, got 0"):
        DirectReader(str(tmp_path), thread_count=0)
    with pytest.raises(ValueError, match="chunk_bytes must be >= 4096, got 10"):
        DirectReader(str(tmp_path), chunk_bytes=10)
