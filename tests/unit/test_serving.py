"""Export, load and evaluate without Ray: the two formats a job writes, built here in one process.

A final model is DCP's save of ``DLRMTrain.state_dict()`` (keys ``model.<DLRM key>``); a
checkpoint nests it under ``model.`` again and is committed with a manifest. Both are written
here with DCP's no-process-group path from a model with random weights, exported, loaded, and
compared with a DLRM built independently from TorchRec's constructors and the state dict.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchrec.models.dlrm import DLRM_DCN, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from jobs.export import main as export_main
from raytrec._quiet import quiet_known_warnings
from raytrec.checkpoint.errors import CheckpointError
from raytrec.checkpoint.layout import CheckpointStore, data_files
from raytrec.checkpoint.manifest import Manifest, signature_for
from raytrec.config import DataConfig, ModelConfig, TrainConfig, criteo_tables
from raytrec.config.file import dump as yaml_text
from raytrec.data.arrow_kjt import BadInputError
from raytrec.data.from_config import parquet_spec
from raytrec.data.generate import auc, write_synthetic_parquet
from raytrec.data.spec import BucketizedFeature, FeatureSpec, SparseFeature
from raytrec.models import build_dlrm_model
from raytrec.serving.evaluate import evaluate
from raytrec.serving.export import (
    MODEL_JSON,
    STATE_FILE,
    export,
    load_exported,
    load_model,
    load_program,
    make_batch,
    read_unsharded_state,
    score,
)
from raytrec.serving.model_spec import MODEL_SPEC, ModelSpec, SpecFileError, write_model_spec

IDS = 40  # ids per feature in the generated data and rows per table
DIM = 8
CONFIG = TrainConfig(
    model=ModelConfig(
        arch="dlrm_dcn",
        # 4 of the data's 26 sparse columns: the layout reads the model's features only.
        tables=criteo_tables(num_features=4, num_embeddings=IDS, embedding_dim=DIM),
        dense_arch_layers=(16, DIM),
        over_arch_layers=(16, 1),
        dcn_num_layers=2,
        dcn_low_rank_dim=4,
    ),
)
NUM_DENSE = 13


def trained_like_model(seed: int = 5) -> DLRMTrain:
    """A DLRMTrain with every tensor random (embeddings too), as training would leave it."""
    quiet_known_warnings()
    model = DLRMTrain(
        build_dlrm_model(
            CONFIG.model, NUM_DENSE, torch.device("cpu"), 0, embedding_device=torch.device("cpu")
        )
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def reference_model(path: Path) -> DLRM_DCN:
    """The exported model rebuilt with TorchRec alone from model.json and model.pt, as
    docs/serving.md shows."""
    cfg = json.loads((path / MODEL_JSON).read_text())["spec"]
    assert cfg["model_kind"] == "DLRM_DCN"
    tables = [
        EmbeddingBagConfig(
            name=t["name"],
            num_embeddings=t["num_embeddings"],
            embedding_dim=t["embedding_dim"],
            feature_names=t["features"],
        )
        for t in cfg["model"]["tables"]
    ]
    model = DLRM_DCN(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables),
        dense_in_features=cfg["num_dense"],
        dense_arch_layer_sizes=cfg["model"]["dense_arch_layers"],
        over_arch_layer_sizes=cfg["model"]["over_arch_layers"],
        dcn_num_layers=cfg["model"]["dcn_num_layers"],
        dcn_low_rank_dim=cfg["model"]["dcn_low_rank_dim"],
    )
    model.load_state_dict(torch.load(path / STATE_FILE, weights_only=True))
    return model.eval()


def save_final_model(model: DLRMTrain, path: Path, *, spec: bool = True) -> None:
    """What ``RankWorker.save`` writes: DCP of the train module's state dict, plus the spec."""
    dcp.save(model.state_dict(), checkpoint_id=str(path), no_dist=True)
    if spec:
        write_model_spec(str(path), ModelSpec.for_config(CONFIG, NUM_DENSE))


def save_checkpoint_dir(model: DLRMTrain, root: Path, step: int) -> str:
    """A committed checkpoint laid out as ``save_checkpoint`` lays it out (without the
    optimizer and random state export never reads), and without its spec."""
    store = CheckpointStore(str(root))
    pending = store.begin(step)
    dcp.save({"model": model.state_dict()}, checkpoint_id=pending.write_uri, no_dist=True)
    dense = {k: tuple(v.shape) for k, v in model.state_dict().items() if "sparse_arch" not in k}
    manifest = Manifest(
        step=step,
        generation=0,
        gang_size=1,
        num_gangs=1,
        sharding_type="table_wise",
        signature=signature_for(CONFIG, dense),
        files=data_files(pending.write_uri),
        extra={},
        created_unix=time.time(),
    )
    return store.commit(pending, manifest).uri


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rows")
    write_synthetic_parquet(
        out, rows=600, files=2, row_groups_per_file=2, seed=11, num_embeddings=IDS
    )
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("saved")
    model = trained_like_model()
    save_final_model(model, root / "final_model")
    checkpoint = save_checkpoint_dir(model, root / "checkpoints", step=40)
    exported = export(str(root / "final_model"), root / "export")
    return {"model": model, "root": root, "checkpoint": checkpoint, "exported": exported}


def dlrm_state(model: DLRMTrain) -> dict[str, torch.Tensor]:
    return {k[len("model.") :]: v for k, v in model.state_dict().items()}


# -- the spec ------------------------------------------------------------------------------


def test_model_spec_round_trips_and_matches_the_training_layout() -> None:
    spec = ModelSpec.for_config(CONFIG, NUM_DENSE)
    assert spec.features == parquet_spec(CONFIG)  # the layout Parquet training reads
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict())), where="x") == spec
    custom = FeatureSpec(
        dense=("a",),
        sparse=(
            *(
                SparseFeature(name=f, num_embeddings=IDS, id_policy="hash")
                for f in spec.model.features
            ),
            BucketizedFeature(name="b", source_column="a", boundaries=(0.0, 1.5)),
        ),
        labels=("y",),
        row_id=None,
    )
    other = ModelSpec(model=CONFIG.model, num_dense=1, features=custom)
    assert ModelSpec.from_dict(other.to_dict(), where="x") == other
    assert other.to_dict()["model_kind"] == "DLRM_DCN"
    with pytest.raises(SpecFileError, match="x has format_version 9"):
        ModelSpec.from_dict({**spec.to_dict(), "format_version": 9}, where="x")
    with pytest.raises(SpecFileError, match="lacks the model's sparse features"):
        ModelSpec(
            model=CONFIG.model,
            num_dense=1,
            features=FeatureSpec(dense=("a",), sparse=custom.sparse[-1:]),
        )


# -- export --------------------------------------------------------------------------------


def test_both_formats_read_back_full_size_under_dlrm_names(saved: dict[str, object]) -> None:
    model = saved["model"]
    assert isinstance(model, DLRMTrain)
    expected = dlrm_state(model)
    root = saved["root"]
    assert isinstance(root, Path)
    for uri, kind, step in (
        (str(root / "final_model"), "final_model", None),
        (str(saved["checkpoint"]), "checkpoint", 40),
    ):
        state, got_step, got_kind = read_unsharded_state(uri)
        assert (got_kind, got_step) == (kind, step)
        assert state.keys() == expected.keys()
        assert "sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight" in state
        for key, value in expected.items():
            assert torch.equal(state[key], value), key


def test_export_layout_and_state_dict(saved: dict[str, object]) -> None:
    exported = saved["exported"]
    root = saved["root"]
    model = saved["model"]
    assert isinstance(root, Path) and isinstance(model, DLRMTrain)
    out = root / "export"
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "model.pt", "model.pt2"]
    doc = json.loads((out / MODEL_JSON).read_text())
    assert doc["format"] == "raytrec-model" and doc["spec"]["model_kind"] == "DLRM_DCN"
    assert doc["source"] == {"uri": str(root / "final_model"), "kind": "final_model", "step": None}
    assert doc["spec"]["num_dense"] == NUM_DENSE and doc["program_error"] is None
    state = torch.load(out / STATE_FILE, weights_only=True)
    expected = dlrm_state(model)
    assert state.keys() == expected.keys() == doc["state_dict"].keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
        assert doc["state_dict"][key] == list(value.shape)
    assert state["sparse_arch.embedding_bag_collection.embedding_bags.t_cat_3.weight"].shape == (
        IDS,
        DIM,
    )
    assert exported == load_exported(out)[1]


def test_loaded_model_scores_equal_plain_torchrec(saved: dict[str, object], data: Path) -> None:
    root = saved["root"]
    assert isinstance(root, Path)
    loaded = load_model(root / "export")
    reference = reference_model(root / "export")
    table = pq.read_table(data)  # held-out rows: the model never saw them
    spec = ModelSpec.for_config(CONFIG, NUM_DENSE)
    for rows in (table.slice(0, 1), table.slice(1, 257), table.to_pandas().iloc[300:310]):
        batch, row_ids = make_batch(rows, spec)
        ours = score(loaded, batch)
        with torch.no_grad():
            theirs = torch.sigmoid(
                reference(batch.dense_features, batch.sparse_features).double()
            ).reshape(-1)
        assert ours.shape == (len(rows),) and row_ids is not None and len(row_ids) == len(rows)
        assert torch.allclose(ours, theirs, atol=1e-6, rtol=0)
        assert bool(((ours > 0.01) & (ours < 0.99)).all())
        assert len(rows) == 1 or float(ours.std()) > 1e-3  # the rows do not all score the same


def test_serving_rows_need_no_label_or_row_id(saved: dict[str, object], data: Path) -> None:
    root = saved["root"]
    assert isinstance(root, Path)
    loaded = load_model(root / "export")
    table = pq.read_table(data).slice(0, 20)
    features = table.drop_columns(["label", "row_id", "click_prob"])
    spec = ModelSpec.for_config(CONFIG, NUM_DENSE)
    with_all, ids = make_batch(table, spec)
    bare, no_ids = make_batch(features.to_pylist(), spec)
    assert no_ids is None and ids is not None and list(ids) == list(range(20))
    assert torch.equal(score(loaded, bare), score(loaded, with_all))


def test_program_scores_like_the_module(saved: dict[str, object], data: Path) -> None:
    root = saved["root"]
    assert isinstance(root, Path)
    loaded, program = load_model(root / "export"), load_program(root / "export")
    table = pq.read_table(data)
    spec = ModelSpec.for_config(CONFIG, NUM_DENSE)
    for start, size in ((0, 1), (1, 2), (3, 3), (6, 200)):  # other sizes than the traced one
        batch, _ = make_batch(table.slice(start, size), spec)
        with torch.no_grad():
            logits = program(batch.dense_features, batch.sparse_features)
        assert torch.allclose(
            torch.sigmoid(logits.reshape(-1).double()), score(loaded, batch), atol=1e-6
        )


def test_checkpoint_without_spec_exports_with_the_config(
    saved: dict[str, object], tmp_path: Path
) -> None:
    uri = str(saved["checkpoint"])
    with pytest.raises(CheckpointError, match=r"holds no model spec .*pass config="):
        export(uri, tmp_path / "a")
    exported = export(uri, tmp_path / "b", config=CONFIG, program=False)
    assert exported.step == 40 and exported.program is None and exported.source_kind == "checkpoint"
    root = saved["root"]
    assert isinstance(root, Path)
    a = torch.load(tmp_path / "b" / STATE_FILE, weights_only=True)
    b = torch.load(root / "export" / STATE_FILE, weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_refuses_what_it_cannot_read(saved: dict[str, object], tmp_path: Path) -> None:
    root = saved["root"]
    assert isinstance(root, Path)
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        export(str(root / "final_model"), root / "export")
    with pytest.raises(CheckpointError, match="the directory does not exist"):
        export(str(tmp_path / "nothing"), tmp_path / "x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no model raytrec wrote"):
        export(str(tmp_path / "empty"), tmp_path / "x")
    # A save that never committed: its marker is missing.
    store = CheckpointStore(str(tmp_path / "ckpts"))
    pending = store.begin(3)
    dcp.save({"model": {"x": torch.zeros(2)}}, checkpoint_id=pending.write_uri, no_dist=True)
    with pytest.raises(CheckpointError, match="no commit marker"):
        export(pending.write_uri, tmp_path / "y", config=CONFIG)
    # A spec for another model.
    other = TrainConfig(
        model=ModelConfig(
            tables=criteo_tables(num_embeddings=IDS + 1, embedding_dim=DIM),
            dense_arch_layers=(16, DIM),
        )
    )
    with pytest.raises(
        CheckpointError, match=r"does not fit its model spec: .*t_cat_0.weight' has shape"
    ):
        export(str(root / "final_model"), tmp_path / "z", config=other)
    assert (root / "final_model" / MODEL_SPEC).is_file()


# -- evaluate ------------------------------------------------------------------------------


def test_evaluate_equals_closed_form_metrics(saved: dict[str, object], data: Path) -> None:
    root = saved["root"]
    assert isinstance(root, Path)
    for source in (str(data), DataConfig(source="parquet", path=str(data))):
        metrics = evaluate(str(root / "export"), source, batch_size=128)
        assert metrics.rows == 600 and metrics.step is None
        table = pq.read_table(data)
        batch, _ = make_batch(table, ModelSpec.for_config(CONFIG, NUM_DENSE))
        p = score(load_model(root / "export"), batch).numpy()
        y = table.column("label").to_numpy().astype(np.float64)
        log_loss = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
        assert metrics.log_loss == pytest.approx(log_loss, abs=1e-9)
        assert metrics.auc == pytest.approx(auc(p, y), abs=1e-9)
        base = y.mean()
        ne = log_loss / -(base * np.log(base) + (1 - base) * np.log(1 - base))
        assert metrics.ne == pytest.approx(ne, rel=1e-9)
    # Straight from the checkpoint (exported to a temporary directory first): the same numbers.
    again = evaluate(str(saved["checkpoint"]), str(data), config=CONFIG)
    assert again.step == 40 and again.auc == pytest.approx(metrics.auc, abs=1e-12)


def test_export_command(
    saved: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = saved["root"]
    assert isinstance(root, Path)
    assert export_main([str(root / "final_model"), str(tmp_path / "a"), "--no-program"]) == 0
    assert (
        f"exported final_model {root / 'final_model'} to {tmp_path / 'a'}"
        in capsys.readouterr().out
    )
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["model.json", "model.pt"]
    # A checkpoint without its spec: refused, then exported with the job's config.
    assert export_main([str(saved["checkpoint"]), str(tmp_path / "b")]) == 2
    assert "pass config=" in capsys.readouterr().err
    config = tmp_path / "job.yaml"
    config.write_text(yaml_text(CONFIG))
    assert (
        export_main(
            [str(saved["checkpoint"]), str(tmp_path / "b"), "--config", str(config), "--no-program"]
        )
        == 0
    )
    assert "(step 40)" in capsys.readouterr().out


def test_the_functions_are_raytrec_names() -> None:
    import raytrec
    from raytrec.serving import evaluate as evaluate_module

    assert raytrec.export is export and raytrec.load_model is load_model
    assert raytrec.make_batch is make_batch and raytrec.evaluate is evaluate
    assert raytrec.predict is evaluate_module.predict
    assert {"export", "load_model", "make_batch", "evaluate", "predict"} <= set(raytrec.__all__)


def test_evaluate_reads_rows_without_row_ids_and_names_a_missing_column(
    saved: dict[str, object], data: Path, tmp_path: Path
) -> None:
    root = saved["root"]
    assert isinstance(root, Path)
    table = pq.read_table(data)
    pq.write_table(table.drop_columns(["row_id"]), tmp_path / "no_ids.parquet")
    (tmp_path / "bad").mkdir()
    pq.write_table(table.drop_columns(["dense_3"]), tmp_path / "bad" / "part.parquet")
    without = evaluate(str(root / "export"), str(tmp_path / "no_ids.parquet"))
    with_ids = evaluate(str(root / "export"), str(data))
    assert (without.rows, without.log_loss, without.auc) == (
        with_ids.rows,
        pytest.approx(with_ids.log_loss, abs=1e-12),
        pytest.approx(with_ids.auc, abs=1e-12),
    )
    with pytest.raises(BadInputError, match=r"missing_column.*column 'dense_3'"):
        evaluate(str(root / "export"), str(tmp_path / "bad"))


def test_a_model_trained_with_dropout_exports_and_scores_without_it(
    tmp_path: Path, data: Path
) -> None:
    """Dropout adds no state and is off in eval: the export, its program and plain TorchRec
    score alike."""
    noisy = TrainConfig(model=CONFIG.model.replace(dropout=0.3))
    model = trained_like_model()  # built without dropout: its state is the same either way
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "final"), no_dist=True)
    write_model_spec(str(tmp_path / "final"), ModelSpec.for_config(noisy, NUM_DENSE))
    exported = export(str(tmp_path / "final"), tmp_path / "export")
    assert exported.spec.model.dropout == 0.3 and exported.program is not None
    loaded, program = load_model(tmp_path / "export"), load_program(tmp_path / "export")
    assert not loaded.training and any(isinstance(m, torch.nn.Dropout) for m in loaded.modules())
    reference = reference_model(tmp_path / "export")
    batch, _ = make_batch(pq.read_table(data).slice(0, 64), exported.spec)
    with torch.no_grad():
        theirs = torch.sigmoid(reference(batch.dense_features, batch.sparse_features).double())
        from_program = program(batch.dense_features, batch.sparse_features)
    ours = score(loaded, batch)
    assert torch.equal(ours, score(loaded, batch))  # no dropout at scoring
    assert torch.allclose(ours, theirs.reshape(-1), atol=1e-6, rtol=0)
    assert torch.allclose(torch.sigmoid(from_program.reshape(-1).double()), ours, atol=1e-6)


def test_export_and_load_print_nothing(saved: dict[str, object], tmp_path: Path) -> None:
    """In a fresh process, as a user runs them: exporting, loading and calling the program
    print no warning or notice of the stack (TorchRec's non-strict to_dict warning on the root
    logger, torch.fx's is_fx_tracing notice) and no log record at all."""
    import subprocess
    import sys
    import textwrap

    root = saved["root"]
    assert isinstance(root, Path)
    script = textwrap.dedent(
        f"""
        import logging, torch
        logging.basicConfig()  # as Ray and notebooks do: every record reaches stderr
        from raytrec.serving.export import example_batch, export, load_exported, load_program
        export({str(root / "final_model")!r}, {str(tmp_path / "quiet")!r})
        model, info = load_exported({str(tmp_path / "quiet")!r})
        program = load_program({str(tmp_path / "quiet")!r})
        batch = example_batch(info.spec)
        with torch.no_grad():
            program(batch.dense_features, batch.sparse_features)
            model(batch.dense_features, batch.sparse_features)
        print("exported and scored")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr
    exported, scored = done.stdout.splitlines()  # export's own line, then the script's
    assert exported.startswith("[raytrec] exported final_model ") and exported.endswith(
        "model.pt, model.json, model.pt2"
    )
    assert scored == "exported and scored"
    assert done.stderr == "", done.stderr
