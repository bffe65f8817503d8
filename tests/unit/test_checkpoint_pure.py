"""Checkpoint management without processes or tensors on a model: config, save policy,
manifest compatibility, naming, atomic commit, listing, keep-last-K, verification, and the
row-wise optimizer-state conversion. Milliseconds each.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import posixpath
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch

from raytrec.checkpoint.config import (
    CheckpointConfig,
    SavedCheckpoint,
    checkpoint_root,
    checkpoints_to_remove,
    save_decision,
)
from raytrec.checkpoint.errors import CheckpointError
from raytrec.checkpoint.layout import (
    MANIFEST,
    MARKER,
    CheckpointStore,
    checkpoint_name,
    data_files,
    read_manifest,
)
from raytrec.checkpoint.manifest import (
    Manifest,
    ModelSignature,
    TableShard,
    TableSpec,
    check_compatible,
    mismatches,
    signature_for,
)
from raytrec.checkpoint.reshard import convert_rowwise_state
from raytrec.config import ConfigError, ModelConfig, TrainConfig, criteo_tables

# -- CheckpointConfig -------------------------------------------------------------------


def test_config_defaults_keep_everything_and_never_save() -> None:
    c = CheckpointConfig()
    assert (c.num_to_keep, c.every_n_steps, c.every_minutes, c.checkpoint_at_end) == (
        None,
        None,
        None,
        False,
    )
    assert not c.periodic
    assert CheckpointConfig(every_minutes=0.5).periodic


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_to_keep", 0, r"checkpoint\.num_to_keep=0: must be greater than 0"),
        ("num_to_keep", True, r"checkpoint\.num_to_keep=true: must be a valid integer"),
        ("every_n_steps", -3, r"checkpoint\.every_n_steps=-3: must be greater than 0"),
        ("every_n_steps", 2.0, r"checkpoint\.every_n_steps=2\.0: must be a valid integer"),
        ("every_minutes", 0, r"checkpoint\.every_minutes=0: must be greater than 0"),
        ("every_minutes", math.nan, r"checkpoint\.every_minutes=\.nan: must be a finite number"),
        ("every_minutes", math.inf, r"checkpoint\.every_minutes=\.inf: must be a finite number"),
        ("every_minutes", "5", r"checkpoint\.every_minutes='5': must be a valid number"),
        ("checkpoint_at_end", 1, r"checkpoint\.checkpoint_at_end=1: must be a valid boolean"),
    ],
)
def test_config_rejects_bad_values(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointConfig(**{field: value})  # type: ignore[arg-type]


def test_checkpoint_root_for_paths_and_uris() -> None:
    assert checkpoint_root("runs/job-1") == "runs/job-1/checkpoints"
    assert checkpoint_root("s3://bucket/runs/job-1/") == "s3://bucket/runs/job-1/checkpoints"
    assert checkpoint_root("file:///tmp/r") == "file:///tmp/r/checkpoints"


# -- the save policy ----------------------------------------------------------------------


def simulate(config: CheckpointConfig, *, steps: int, sync_every: int, step_s: float) -> list[int]:
    """Runs the policy over a job with a fake clock; returns the steps that were saved."""
    saved, last_step, last_s = [], 0, 0.0
    for step in range(1, steps + 1):
        now = step * step_s
        d = save_decision(
            config,
            step=step,
            now_s=now,
            last_save_step=last_step,
            last_save_s=last_s,
            sync_every=sync_every,
            final_step=steps,
        )
        if d.save:
            saved.append(step)
            last_step, last_s = step, now
    return saved


def test_policy_every_n_steps_at_production_length() -> None:
    saved = simulate(CheckpointConfig(every_n_steps=1000), steps=100_000, sync_every=4, step_s=0.05)
    assert saved == list(range(1000, 100_001, 1000))


def test_policy_waits_for_the_next_sync_boundary() -> None:
    # 10 steps are due at step 10, but replicas only agree at multiples of 4.
    saved = simulate(CheckpointConfig(every_n_steps=10), steps=100, sync_every=4, step_s=1.0)
    assert saved == [12, 24, 36, 48, 60, 72, 84, 96]


def test_policy_every_minutes_with_a_fake_clock() -> None:
    # 0.7 s per step: one minute is 85.7 steps, due at 86, then at the boundary 88.
    saved = simulate(CheckpointConfig(every_minutes=1.0), steps=400, sync_every=4, step_s=0.7)
    assert saved == [88, 176, 264, 352]
    d = save_decision(
        CheckpointConfig(every_minutes=1.0),
        step=88,
        now_s=61.6,
        last_save_step=0,
        last_save_s=0.0,
        sync_every=4,
    )
    assert d.save and d.reason == "every_minutes=1: 1.03 minutes since step 0"


def test_policy_either_trigger_and_at_end() -> None:
    both = CheckpointConfig(every_n_steps=50, every_minutes=1.0, checkpoint_at_end=True)
    # 2 s per step: the clock fires every 30 steps, before the step count does.
    assert simulate(both, steps=100, sync_every=2, step_s=2.0) == [30, 60, 90, 100]
    assert simulate(CheckpointConfig(), steps=100, sync_every=2, step_s=2.0) == []
    at_end = CheckpointConfig(checkpoint_at_end=True)
    assert simulate(at_end, steps=100, sync_every=2, step_s=2.0) == [100]


def test_policy_reasons() -> None:
    c = CheckpointConfig(every_n_steps=8)
    kw = {"now_s": 0.0, "last_save_s": 0.0, "sync_every": 4}
    assert save_decision(c, step=8, last_save_step=0, **kw).reason == (
        "every_n_steps=8: 8 steps since step 0"
    )
    assert save_decision(c, step=6, last_save_step=0, **kw).reason == (
        "step 6 is not a sync boundary (sync_every=4)"
    )
    assert save_decision(c, step=8, last_save_step=8, **kw).reason == "step 8 is already saved"
    assert save_decision(c, step=4, last_save_step=0, **kw).reason == "not due"


# -- manifest and compatibility ---------------------------------------------------------------


def signature(**changes: object) -> ModelSignature:
    tables = criteo_tables(num_features=26, num_embeddings=10_000, embedding_dim=16)
    config = TrainConfig(model=ModelConfig(tables=tables))
    sig = signature_for(config, {"dense.0.weight": (64, 13), "dense.0.bias": (64,)})
    return dataclasses.replace(sig, **changes)  # type: ignore[arg-type]


def manifest_for(step: int, files: dict[str, int], **changes: object) -> Manifest:
    return Manifest(
        step=step,
        generation=2,
        gang_size=4,
        num_gangs=3,
        sharding_type="table_wise",
        signature=signature(**changes),
        files=files,
        extra={"samples": [1, 2, 3], "source": {"epoch": 0}},
        created_unix=1.0,
    )


def test_manifest_round_trips_through_json() -> None:
    shards = (TableShard(row_offset=0, col_offset=0, rows=10, cols=8),)
    sig = signature()
    sig = dataclasses.replace(
        sig, tables=(dataclasses.replace(sig.tables[0], shards=shards), *sig.tables[1:])
    )
    m = dataclasses.replace(manifest_for(7, {"__0_0.distcp": 123}), signature=sig)
    back = Manifest.from_json(m.to_json(), where="x")
    assert back == m
    assert back.signature.tables[0].column_shards() == [(0, 8)]


def test_compatible_signatures_ignore_layout() -> None:
    # Saved from 2-way column-wise shards, loaded table-wise: that is resharding, not a mismatch.
    a = signature()
    shards = (
        TableShard(row_offset=0, col_offset=0, rows=10_000, cols=8),
        TableShard(row_offset=0, col_offset=8, rows=10_000, cols=8),
    )
    b = dataclasses.replace(
        a, tables=tuple(dataclasses.replace(t, shards=shards) for t in a.tables)
    )
    assert mismatches(b, a) == []
    check_compatible(b, a, where="ckpt")


def test_every_mismatch_is_named_with_saved_and_expected() -> None:
    expected = signature()
    tables = list(expected.tables)
    saved_tables = [
        dataclasses.replace(tables[0], num_embeddings=99),
        dataclasses.replace(tables[1], embedding_dim=8),
        *tables[2:25],  # t_cat_25 missing
        TableSpec(name="t_extra", num_embeddings=5, embedding_dim=16),
    ]
    saved = dataclasses.replace(
        expected,
        arch="dlrm_dcn",
        tables=tuple(saved_tables),
        embedding_optimizer="rowwise_adagrad",
        dense_optimizer="sgd",
        dense_params={"dense.0.weight": (64, 12), "dense.9.weight": (1,)},
    )
    assert mismatches(saved, expected) == [
        "model arch: saved 'dlrm_dcn', expected 'dlrm'",
        "embedding optimizer: saved 'rowwise_adagrad', expected 'adagrad'",
        "dense optimizer: saved 'sgd', expected 'adagrad'",
        "table 't_cat_0' num_embeddings: saved 99, expected 10000",
        "table 't_cat_1' embedding_dim: saved 8, expected 16",
        "table 't_cat_25': in this model but missing from the checkpoint",
        "table 't_extra': in the checkpoint but not in this model",
        "dense parameter 'dense.0.weight' shape: saved [64, 12], expected [64, 13]",
        "dense parameter 'dense.0.bias': in this model but missing from the checkpoint",
        "dense parameter 'dense.9.weight': in the checkpoint but not in this model",
    ]
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint ckpt7 does not fit this model: model arch: .*; embedding optimizer",
    ):
        check_compatible(saved, expected, where="ckpt7")


def test_mismatch_check_at_production_size() -> None:
    # 1000 tables, one of them off by a row.
    tables = tuple(
        TableSpec(name=f"t{i}", num_embeddings=1_000_000 + i, embedding_dim=128)
        for i in range(1000)
    )
    expected = dataclasses.replace(signature(), tables=tables)
    saved_tables = list(tables)
    saved_tables[617] = dataclasses.replace(tables[617], num_embeddings=1_000_000)
    saved = dataclasses.replace(expected, tables=tuple(saved_tables))
    assert mismatches(saved, expected) == [
        "table 't617' num_embeddings: saved 1000000, expected 1000617"
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"\x00\xffgarbage", r"corrupt: its manifest is not valid JSON"),
        (b'{"format": "other"}', r"not a raytrec-checkpoint manifest"),
        (b'{"format": "raytrec-checkpoint", "format_version": 9}', r"format_version 9"),
        (
            b'{"format": "raytrec-checkpoint", "format_version": 1, "step": 3}',
            r"corrupt: its manifest lacks or mistypes a field \(KeyError: 'model_arch'\)",
        ),
    ],
)
def test_malformed_manifests(text: bytes, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        Manifest.from_json(text, where="c")


# -- layout: commit, listing, pruning, verification ---------------------------------------------


@pytest.fixture
def memory_root() -> Iterator[str]:
    root = f"memory://ckpt-{uuid.uuid4().hex}/run/checkpoints"
    yield root
    fs = fsspec.filesystem("memory")
    path = root[len("memory://") :].split("/")[0]
    if fs.exists("/" + path):
        fs.rm("/" + path, recursive=True)


def fake_save(store: CheckpointStore, step: int, payload: bytes = b"x" * 100) -> None:
    """A save as the in-rank code does it: data files into the pending directory, then commit."""
    pending = store.begin(step)
    fs, path = fsspec.core.url_to_fs(pending.write_uri)
    fs.pipe_file(posixpath.join(path, "__0_0.distcp"), payload)
    fs.pipe_file(posixpath.join(path, ".metadata"), b"meta")
    store.commit(pending, manifest_for(step, data_files(pending.write_uri)))


def test_local_commit_is_a_rename_of_a_hidden_directory(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    assert store.atomic_rename and store.committed() == [] and store.latest() is None
    pending = store.begin(40)
    assert os.path.basename(pending.write_uri).startswith(".checkpoint_0000000040.tmp-")
    assert pending.final_uri == str(tmp_path / "checkpoints" / "checkpoint_0000000040")
    Path(pending.write_uri, "__0_0.distcp").write_bytes(b"abc")
    # Written but not committed: not listed, and reported as uncommitted.
    assert store.committed() == []
    assert store.uncommitted() == [os.path.basename(pending.write_uri)]
    ref = store.commit(pending, manifest_for(40, data_files(pending.write_uri)))
    assert ref.step == 40 and ref.name == "checkpoint_0000000040"
    assert sorted(os.listdir(ref.uri)) == sorted(["__0_0.distcp", MANIFEST, MARKER])
    assert not os.path.exists(pending.write_uri)
    assert store.committed() == [ref] and store.latest() == ref and store.uncommitted() == []
    m = read_manifest(ref.uri)
    assert m.step == 40 and m.files == {"__0_0.distcp": 3} and m.extra["samples"] == [1, 2, 3]


def test_file_uri_and_plain_path_name_the_same_checkpoints(tmp_path: Path) -> None:
    fake_save(CheckpointStore(f"file://{tmp_path}/c"), 8)
    plain = CheckpointStore(str(tmp_path / "c"))
    assert [r.step for r in plain.committed()] == [8]
    uri_store = CheckpointStore(f"file://{tmp_path}/c")
    assert uri_store.atomic_rename
    (ref,) = uri_store.committed()
    assert ref.uri == f"file://{tmp_path}/c/checkpoint_0000000008"
    assert read_manifest(ref.uri).step == 8


def test_object_store_commit_is_the_marker(memory_root: str) -> None:
    store = CheckpointStore(memory_root)
    assert not store.atomic_rename
    pending = store.begin(12)
    assert pending.write_uri == pending.final_uri == f"{memory_root}/checkpoint_0000000012"
    fs, path = fsspec.core.url_to_fs(pending.write_uri)
    fs.pipe_file(posixpath.join(path, "__0_0.distcp"), b"abcd")
    # The directory has its final name, but without the marker it is not a checkpoint.
    assert store.committed() == [] and store.uncommitted() == ["checkpoint_0000000012"]
    with pytest.raises(CheckpointError, match="incomplete: it has no commit marker"):
        read_manifest(pending.final_uri)
    store.commit(pending, manifest_for(12, data_files(pending.write_uri)))
    assert [r.step for r in store.committed()] == [12] and store.uncommitted() == []
    assert read_manifest(pending.final_uri).files == {"__0_0.distcp": 4}


@pytest.mark.parametrize("where", ["local", "memory"])
def test_keep_last_k_at_production_count(tmp_path: Path, memory_root: str, where: str) -> None:
    root = str(tmp_path / "c") if where == "local" else memory_root
    store = CheckpointStore(root)
    count = 20 if where == "local" else 300
    for step in range(10, 10 * count + 1, 10):
        fake_save(store, step)
    # A save that died half-way, and one that never started writing.
    store.begin(10 * count + 10)
    fs, path = fsspec.core.url_to_fs(root)
    assert len(store.uncommitted()) == 1
    removed = store.prune(3)
    assert len(removed) == count - 3 + 1
    assert [r.step for r in store.committed()] == [10 * count - 20, 10 * count - 10, 10 * count]
    assert store.uncommitted() == []
    assert sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False)) == [
        checkpoint_name(s) for s in (10 * count - 20, 10 * count - 10, 10 * count)
    ]
    assert store.prune(None) == []  # None keeps every committed checkpoint


def test_prune_spares_the_named_pending_directory(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    old = store.begin(1)
    mine = store.begin(2)
    assert store.prune(None, keep=posixpath.basename(mine.write_uri)) == [
        posixpath.basename(old.write_uri)
    ]
    assert os.path.isdir(mine.write_uri)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_saving_a_step_again_replaces_it(tmp_path: Path, memory_root: str, where: str) -> None:
    """After a rewind, a step is saved again; the new checkpoint replaces the old one."""
    store = CheckpointStore(str(tmp_path) if where == "local" else memory_root)
    fake_save(store, 5, b"old")
    fake_save(store, 5, b"newer")
    (ref,) = store.committed()
    assert read_manifest(ref.uri).files["__0_0.distcp"] == 5
    assert store.uncommitted() == []


def rewrite(path: Path, name: str, data: bytes) -> None:
    (path / name).write_bytes(data)


def commit_manifest(path: Path, doc: dict[str, object]) -> None:
    """Writes an edited manifest and a matching commit marker, as a writer would."""
    text = json.dumps(doc).encode()
    (path / MANIFEST).write_bytes(text)
    marker = {"step": doc["step"], "manifest_sha256": hashlib.sha256(text).hexdigest()}
    (path / MARKER).write_text(json.dumps(marker))


def test_verification_names_each_problem(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    fake_save(store, 3, b"0123456789")
    ref = store.latest()
    assert ref is not None
    path = Path(ref.uri)

    def expect(message: str) -> None:
        with pytest.raises(CheckpointError, match=message):
            read_manifest(ref.uri)

    read_manifest(ref.uri)
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*c9: the directory does not"):
        read_manifest(str(tmp_path / "c9"))
    (path / "__0_0.distcp").write_bytes(b"01234")
    expect(r"corrupt: data file __0_0.distcp has 5 bytes, manifest.json records 10 \(truncated")
    (path / "__0_0.distcp").unlink()
    expect(r"corrupt: data file __0_0.distcp listed in manifest.json is missing")
    doc = json.loads((path / MANIFEST).read_bytes())
    doc["files"] = {".metadata": 4}
    commit_manifest(path, doc)
    read_manifest(ref.uri)
    (path / MANIFEST).write_text(json.dumps({**doc, "step": 4}))  # edited after the commit
    expect(r"corrupt: manifest.json does not match the digest in _COMMITTED")
    (path / MARKER).write_bytes(b"\x00")
    expect(r"corrupt: its commit marker _COMMITTED is unreadable")
    (path / MANIFEST).unlink()
    expect(r"incomplete: manifest.json is missing")
    (path / MARKER).unlink()
    expect(r"incomplete: it has no commit marker \(_COMMITTED\), so its save never finished")


def test_unknown_filesystem_is_a_checkpoint_error() -> None:
    with pytest.raises(CheckpointError, match="cannot open checkpoint location 'nosuchfs://x'"):
        CheckpointStore("nosuchfs://x")


# -- row-wise optimizer state across column layouts ------------------------------------------------


def rowwise_states(sq_grads: torch.Tensor, blocks: list[tuple[int, int]]) -> torch.Tensor:
    """Row-wise Adagrad's accumulator for a layout: per block, the mean over its columns."""
    return torch.cat([sq_grads[:, c : c + w].mean(dim=1) for c, w in blocks])


@pytest.mark.parametrize(
    ("saved", "target"),
    [
        ([(0, 128), (128, 128)], [(0, 256)]),  # column-wise -> table-wise
        ([(0, 128), (128, 64)], [(0, 192)]),  # unequal widths
        ([(0, 64), (64, 64), (128, 64), (192, 64)], [(0, 128), (128, 128)]),  # merge blocks
    ],
)
def test_rowwise_conversion_is_exact_for_unions_of_blocks(
    saved: list[tuple[int, int]], target: list[tuple[int, int]]
) -> None:
    rows = 1000
    dim = sum(w for _, w in saved)
    sq = torch.rand(rows, dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = convert_rowwise_state(
        rowwise_states(sq, saved).float(),
        rows=rows,
        dim=dim,
        saved_blocks=saved,
        target_blocks=target,
    )
    assert out.dtype == torch.float32 and out.shape == (rows * len(target),)
    torch.testing.assert_close(out, rowwise_states(sq, target).float(), rtol=1e-6, atol=0)


def test_rowwise_conversion_to_finer_blocks_copies_bit_for_bit() -> None:
    rows = 50
    saved = torch.rand(rows, generator=torch.Generator().manual_seed(1)) * 1e-3
    out = convert_rowwise_state(
        saved, rows=rows, dim=256, saved_blocks=[(0, 256)], target_blocks=[(0, 128), (128, 128)]
    )
    assert torch.equal(out, torch.cat([saved, saved]))


def test_rowwise_conversion_refuses_bad_layouts() -> None:
    with pytest.raises(CheckpointError, match=r"target column blocks \[\(0, 100\)\] do not tile"):
        convert_rowwise_state(
            torch.zeros(4), rows=4, dim=128, saved_blocks=[(0, 128)], target_blocks=[(0, 100)]
        )
    with pytest.raises(CheckpointError, match=r"row-wise state has shape \[5\], expected \[8\]"):
        convert_rowwise_state(
            torch.zeros(5),
            rows=4,
            dim=8,
            saved_blocks=[(0, 4), (4, 4)],
            target_blocks=[(0, 8)],
        )


# -- pyarrow filesystems ------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pyarrow_filesystem_when_fsspec_lacks_the_protocol(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``s3://`` without s3fs goes through pyarrow's filesystem, as Ray Train's storage does.

    fsspec's resolver is made to fail as it does for a protocol whose package is missing, so
    ``file://`` takes the same path on pyarrow's LocalFileSystem: listing, the marker commit
    (no rename through the wrapper), verification, and DCP writing and reading the tensors.
    """
    import torch.distributed.checkpoint as dcp
    from fsspec.implementations.arrow import ArrowFSWrapper

    from raytrec.checkpoint import layout
    from raytrec.checkpoint.storage import storage_reader, storage_writer

    def missing(uri: str, **_: object) -> None:
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(layout, "url_to_fs", missing)
    store = CheckpointStore(f"file://{tmp_path}/c")
    assert isinstance(store.fs, ArrowFSWrapper) and not store.atomic_rename
    pending = store.begin(6)
    state = {"w": torch.arange(12.0).reshape(3, 4), "nested": {"s": torch.tensor([7, 8])}}
    dcp.save(state, storage_writer=storage_writer(pending.write_uri), no_dist=True)
    assert store.committed() == []
    ref = store.commit(pending, manifest_for(6, data_files(pending.write_uri)))
    assert [r.step for r in store.committed()] == [6]
    assert read_manifest(ref.uri).files.keys() == {".metadata", "__0_0.distcp"}
    back = {"w": torch.zeros(3, 4), "nested": {"s": torch.zeros(2, dtype=torch.int64)}}
    dcp.load(back, storage_reader=storage_reader(ref.uri), no_dist=True)
    assert torch.equal(back["w"], state["w"]) and torch.equal(
        back["nested"]["s"], state["nested"]["s"]
    )
    with pytest.raises(CheckpointError, match=r"cannot open checkpoint location 'nosuch://x'"):
        CheckpointStore("nosuch://x")


# -- keeping the best checkpoints ------------------------------------------------------------


def scored(*scores: float | None) -> list[SavedCheckpoint]:
    return [SavedCheckpoint(name=f"c{i}", step=10 * (i + 1), score=v) for i, v in enumerate(scores)]


def test_without_a_score_the_newest_are_kept() -> None:
    saved = scored(0.9, 0.1, 0.5, 0.2)
    assert checkpoints_to_remove(saved, CheckpointConfig(num_to_keep=2)) == ["c0", "c1"]
    assert checkpoints_to_remove(saved, CheckpointConfig()) == []


@pytest.mark.parametrize(
    ("order", "kept"),
    [("max", {"c0", "c2", "c5"}), ("min", {"c1", "c3", "c5"})],
)
def test_the_best_k_by_score_and_the_newest_are_kept(order: str, kept: set[str]) -> None:
    # c5 (the newest) has no score: it ranks last but is kept, as what a rebuild starts from.
    saved = scored(0.9, 0.1, 0.8, 0.2, math.nan, None)
    config = CheckpointConfig(
        num_to_keep=2, checkpoint_score_attribute="eval_auc", checkpoint_score_order=order
    )
    removed = checkpoints_to_remove(saved, config)
    assert set(removed) == {c.name for c in saved} - kept
    assert removed == sorted(removed, key=lambda n: int(n[1:]))  # oldest first


def test_equal_scores_keep_the_newer() -> None:
    config = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="loss")
    assert checkpoints_to_remove(scored(0.5, 0.5, 0.1), config) == ["c0"]


def test_prune_ranks_by_the_metrics_in_each_manifest(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    for step, auc in [(10, 0.70), (20, 0.75), (30, 0.72), (40, None)]:
        pending = store.begin(step)
        manifest = manifest_for(step, data_files(pending.write_uri))
        metrics = {} if auc is None else {"eval_auc": auc}
        store.commit(pending, dataclasses.replace(manifest, extra={"metrics": metrics}))
    config = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="eval_auc")
    assert store.prune(config) == ["checkpoint_0000000010", "checkpoint_0000000030"]
    assert [r.step for r in store.committed()] == [20, 40]


def test_ranked_by_an_evaluation_metric_a_checkpoint_is_saved_at_every_evaluation() -> None:
    config = CheckpointConfig(checkpoint_score_attribute="eval_ne", checkpoint_score_order="min")
    base = dict(now_s=0.0, last_save_step=8, last_save_s=0.0, sync_every=1)
    decision = save_decision(config, step=12, evaluated=True, **base)  # type: ignore[arg-type]
    assert decision.save and "eval_ne" in decision.reason
    assert not save_decision(config, step=12, **base).save  # type: ignore[arg-type]
    by_loss = CheckpointConfig(checkpoint_score_attribute="loss")
    assert not save_decision(by_loss, step=12, evaluated=True, **base).save  # type: ignore[arg-type]
    # A stop on request saves, so the job can be resumed.
    assert save_decision(config, step=12, stopping=True, **base).save  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "checkpoint_score_attribute",
            "accuracy",
            r"checkpoint_score_attribute='accuracy': must be 'eval_auc', 'eval_ne'",
        ),
        (
            "checkpoint_score_order",
            "desc",
            r"checkpoint_score_order='desc': must be 'max' or 'min'",
        ),
    ],
)
def test_score_settings_are_checked(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointConfig(**{field: value})  # type: ignore[arg-type]


def test_fused_step_counters_come_back_per_kernel_or_as_their_common_value() -> None:
    from raytrec.checkpoint.state import _step_counter_values

    saved = torch.tensor([7, 7, 7], dtype=torch.int64)
    assert _step_counter_values(saved, 3, step=9, uri="c") == [7, 7, 7]
    assert _step_counter_values(saved, 2, step=9, uri="c") == [7, 7]  # another plan
    assert _step_counter_values(torch.tensor([5, 6]), 2, step=9, uri="c") == [5, 6]
    with pytest.raises(CheckpointError, match=r"checkpoint c: .* 2 fused-optimizer step counters"):
        _step_counter_values(torch.tensor([5, 6]), 3, step=9, uri="c")
    # Saved without counters (an older checkpoint): the saved step.
    assert _step_counter_values(None, 2, step=9, uri="c") == [9, 9]
    assert _step_counter_values(None, 0, step=9, uri="c") == []
