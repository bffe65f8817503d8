"""What a job that starts from a checkpoint is checked for on the driver: the fingerprint of the
data a run read and the refusal to resume onto changed data; an export passed as a checkpoint."""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any

import pytest

from raytrec.checkpoint.errors import CheckpointError
from raytrec.checkpoint.layout import CheckpointStore, read_manifest
from raytrec.checkpoint.manifest import Manifest, ModelSignature
from raytrec.config import ConfigError, TrainConfig
from raytrec.data.fingerprint import data_changes, data_fingerprint
from raytrec.data.parquet import ParquetSource
from raytrec.data.spec import criteo_spec
from raytrec.data.synthetic import SyntheticCriteo
from raytrec.preflight import check_checkpoint, check_same_data


def checkpoint_with(root: pathlib.Path, data: dict[str, Any] | None) -> str:
    """A committed checkpoint whose manifest records ``data`` (as a save by fit() does)."""
    store = CheckpointStore(str(root))
    pending = store.begin(4)
    signature = ModelSignature(
        arch="dlrm", tables=(), embedding_optimizer="sgd", dense_optimizer="sgd", dense_params={}
    )
    manifest = Manifest(
        step=4,
        generation=0,
        gang_size=1,
        num_gangs=1,
        sharding_type="table_wise",
        signature=signature,
        files={},
        extra={"step": 4} if data is None else {"step": 4, "data": data},
        created_unix=1.0,
    )
    return store.commit(pending, manifest).uri


@pytest.fixture
def files(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "data"
    (root / "part").mkdir(parents=True)
    for name in ("a.parquet", "b.parquet", "part/c.parquet"):
        (root / name).write_bytes(b"x" * 64)  # listed and stat'ed only: never read
    (root / "_SUCCESS").write_bytes(b"")  # not data: not in the fingerprint
    return root


def parquet(root: pathlib.Path) -> ParquetSource:
    return ParquetSource(paths=str(root), spec=criteo_spec(100))


def test_parquet_fingerprint_lists_each_file_with_size_and_mtime(files: pathlib.Path) -> None:
    fp = data_fingerprint(parquet(files))
    assert fp is not None and fp["kind"] == "parquet"
    names = [os.path.relpath(f["path"], files) for f in fp["files"]]
    assert names == ["a.parquet", "b.parquet", os.path.join("part", "c.parquet")]
    stat = os.stat(files / "a.parquet")
    assert (fp["files"][0]["size"], fp["files"][0]["mtime_ns"]) == (64, stat.st_mtime_ns)
    assert data_changes(fp, data_fingerprint(parquet(files))) == []


def test_resume_onto_changed_files_is_refused_naming_each(
    files: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    uri = checkpoint_with(tmp_path / "checkpoints", data_fingerprint(parquet(files)))
    assert read_manifest(uri).extra["data"]["kind"] == "parquet"
    check_same_data(uri, data_fingerprint(parquet(files)))  # the same files: resumes

    (files / "b.parquet").unlink()  # removed
    (files / "d.parquet").write_bytes(b"y" * 10)  # added
    (files / "a.parquet").write_bytes(b"x" * 65)  # changed: its size
    c = files / "part" / "c.parquet"
    st = os.stat(c)
    os.utime(c, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # changed: rewritten in place
    with pytest.raises(ConfigError) as refused:
        check_same_data(uri, data_fingerprint(parquet(files)))
    message = str(refused.value)
    assert message.startswith(f"{uri} cannot be resumed on this data")
    for line in (
        f"file changed: {files / 'a.parquet'} (size 64 bytes, now 65)",
        f"file removed: {files / 'b.parquet'}",
        f"file changed: {c} (modified since the checkpoint's job read it)",
        f"file added: {files / 'd.parquet'}",
    ):
        assert line in message
    assert "init_from" in message


def test_synthetic_settings_and_source_kind_are_compared(
    files: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    saved = data_fingerprint(SyntheticCriteo(num_sparse=4, num_embeddings=(10, 20, 30, 40)))
    assert saved is not None
    uri = checkpoint_with(tmp_path / "checkpoints", saved)
    same = SyntheticCriteo(num_sparse=4, num_embeddings=(10, 20, 30, 40))
    check_same_data(uri, data_fingerprint(same))
    other = SyntheticCriteo(num_sparse=4, num_embeddings=(10, 20, 30, 40), seed=7)
    with pytest.raises(ConfigError, match=re.escape("synthetic data setting seed: saved 0, now 7")):
        check_same_data(uri, data_fingerprint(other))
    with pytest.raises(ConfigError, match="data source: saved 'synthetic', now 'parquet'"):
        check_same_data(uri, data_fingerprint(parquet(files)))
    with pytest.raises(ConfigError, match="this job's source has none"):
        check_same_data(uri, None)  # a source of the caller's own


def test_a_checkpoint_without_a_fingerprint_is_not_checked(tmp_path: pathlib.Path) -> None:
    uri = checkpoint_with(tmp_path / "checkpoints", None)
    check_same_data(uri, data_fingerprint(SyntheticCriteo(seed=3)))


def test_an_export_directory_is_refused_as_a_start(tmp_path: pathlib.Path) -> None:
    export = tmp_path / "exports" / "ctr"
    export.mkdir(parents=True)
    (export / "model.pt").write_bytes(b"")  # what raytrec.export writes, minus the rest
    with pytest.raises(CheckpointError, match=r"ctr is a raytrec.export directory .* not a"):
        check_checkpoint(str(export), TrainConfig())
