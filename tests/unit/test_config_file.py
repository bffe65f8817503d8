"""The YAML config format: load, override and dump; errors name the key and what is allowed."""

from __future__ import annotations

import enum
import os
import pathlib
import textwrap

import pytest
import yaml
from pydantic import Field, model_validator

from jobs.train import JOB_DEFAULTS, build_config, main
from raytrec.cluster.topology import Layout
from raytrec.config import (
    ConfigError,
    ModelConfig,
    ScalingConfig,
    SyncConfig,
    TableConfig,
    TrainConfig,
    criteo_tables,
)
from raytrec.config.base import ConfigModel, Lax, Seq, validate
from raytrec.config.file import (
    apply_override,
    dump,
    load_config,
    parse_override,
    read_yaml,
    to_dict,
)


def write(tmp_path: pathlib.Path, text: str, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def a_config() -> TrainConfig:
    """A config far from the defaults in every section."""
    return TrainConfig(
        model=ModelConfig(
            arch="dlrm_dcn",
            tables=(
                TableConfig(name="users", num_embeddings=1000, embedding_dim=8, features=("u",)),
                TableConfig(
                    name="t_items", num_embeddings=50, embedding_dim=8, features=("i", "j")
                ),
            ),
            dense_arch_layers=(32, 8),
            dcn_num_layers=1,
        ),
        scaling=ScalingConfig(
            num_workers=8, gang_size=2, ranks_per_host=4, layout="replicas_within_host"
        ),
        sync=SyncConfig(sync_every=8, levels=((2, 2),)),
        num_steps=17,
        storage_path="/tmp/somewhere",
        name="exp-1",
    )


def test_dump_and_load_round_trip(tmp_path: pathlib.Path) -> None:
    config = a_config()
    text = dump(config)
    # Plain YAML readers see the documented structure.
    plain = yaml.safe_load(text)
    assert plain["scaling"]["layout"] == "replicas_within_host"
    assert plain["scaling"]["num_workers"] == 8
    assert plain["model"]["tables"][1] == {
        "name": "t_items",
        "num_embeddings": 50,
        "embedding_dim": 8,
        "features": ["i", "j"],
        "pooling": "sum",
        "weighted": False,
        "sharding_types": None,
        "min_partition": None,
        "pooling_factor": None,
        "compute_kernel": "fused",
        "cache_load_factor": None,
        "precision": "fp32",
        "ids": {"policy": "fixed", "budget": None, "eviction": "lru"},
    }
    assert plain["sync"]["levels"] == [[2, 2]]
    loaded = load_config(write(tmp_path, text))
    assert loaded == config
    assert loaded.scaling.layout is Layout.REPLICAS_WITHIN_HOST
    assert loaded.model.tables[1].features == ("i", "j")
    assert loaded.sync.levels == ((2, 2),)
    assert validate(TrainConfig, to_dict(config)) == config
    assert load_config(write(tmp_path, dump(TrainConfig()), "d.yaml")) == TrainConfig()


def test_model_keys_from_yaml_and_overrides(tmp_path: pathlib.Path) -> None:
    """DeepFM with per-table dims, a weighted table and per-table sharding, read from YAML."""
    path = write(
        tmp_path,
        textwrap.dedent(
            """
            model:
              arch: deepfm
              deep_fm_dimension: 12
              tables:
                - {name: users, num_embeddings: 100, embedding_dim: 8, features: [u]}
                - name: t_items
                  num_embeddings: 50
                  embedding_dim: 16
                  features: [i]
                  weighted: true
                  sharding_types: [column_wise]
                  min_partition: 8
            data: {source: parquet, path: /data, num_dense: 0}
            """
        ),
    )
    config = load_config(
        path,
        [
            "model.tables[0].sharding_types=[table_wise, column_wise]",
            "model.tables[1].pooling_factor=2.5",
        ],
    )
    users, items = config.model.tables
    assert config.model.arch == "deepfm" and config.model.deep_fm_dimension == 12
    assert (users.embedding_dim, items.embedding_dim) == (8, 16)
    assert items.weighted and not users.weighted
    assert users.sharding_types == ("table_wise", "column_wise")
    assert items.sharding_types == ("column_wise",) and items.min_partition == 8
    assert items.pooling_factor == 2.5
    assert config.data.num_dense == 0
    assert load_config(write(tmp_path, dump(config), "again.yaml")) == config
    with pytest.raises(
        ConfigError,
        match=r"^model.tables\[1\].sharding_types\[0\]='diagonal': must be 'table_wise'",
    ):
        load_config(path, ["model.tables[1].sharding_types=[diagonal]"])


def test_keys_left_out_take_the_defaults(tmp_path: pathlib.Path) -> None:
    path = write(
        tmp_path,
        """
        scaling:
          num_workers: 6
        sync: {sync_every: 2}
        """,
    )
    config = load_config(path)
    assert config == TrainConfig(
        scaling=ScalingConfig(num_workers=6), sync=SyncConfig(sync_every=2)
    )
    assert load_config(write(tmp_path, "", "empty.yaml")) == TrainConfig()


def test_precedence_defaults_file_overrides(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, "num_steps: 50\nscaling: {num_workers: 8}\n")
    config = load_config(
        path,
        ["scaling.num_workers=2", ("seed", 7)],
        defaults=[("num_steps", 600), ("log_every", 5)],
    )
    assert config.num_steps == 50  # the file beats the job's defaults
    assert config.log_every == 5  # the job's default beats the class default (20)
    assert config.scaling.num_workers == 2  # overrides beat the file
    assert config.seed == 7


def test_overrides_parse_values_as_yaml() -> None:
    assert parse_override("scaling.num_workers=8") == ("scaling.num_workers", 8)
    assert parse_override("scaling.use_gpu=true") == ("scaling.use_gpu", True)
    assert parse_override("optimizer.eps=1e-8") == ("optimizer.eps", 1e-8)
    assert parse_override("model.dense_arch_layers=[64, 8]") == (
        "model.dense_arch_layers",
        [64, 8],
    )
    assert parse_override("storage_path=s3://bucket/runs") == ("storage_path", "s3://bucket/runs")
    assert parse_override("name=a=b") == ("name", "a=b")
    with pytest.raises(ConfigError, match=r"override 'sync_every' must look like KEY=VALUE"):
        parse_override("sync_every")


def test_list_overrides_by_index_every_entry_and_from_the_end() -> None:
    config = load_config(
        overrides=[
            "model.tables[*].embedding_dim=8",
            "model.dense_arch_layers[-1]=8",
            "model.tables[3].num_embeddings=77",
        ]
    )
    default_tables = criteo_tables()
    assert [t.embedding_dim for t in config.model.tables] == [8] * len(default_tables)
    assert config.model.dense_arch_layers == (64, 8)
    assert [t.num_embeddings for t in config.model.tables] == [
        77 if i == 3 else t.num_embeddings for i, t in enumerate(default_tables)
    ]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "scaling.gang_sise=2",
            r"unknown key 'scaling.gang_sise' \(did you mean 'scaling.gang_size'\?\); allowed keys "
            r"under 'scaling': num_workers, gang_size, ranks_per_host, layout, use_gpu, "
            r"cpus_per_rank, backend",
        ),
        (
            "nmu_steps=3",
            r"unknown key 'nmu_steps' \(did you mean 'num_steps'\?\); allowed keys at ",
        ),
        ("model.tables[26].name=x", r"model.tables\[26\] is out of range: model.tables has 26"),
        ("model.tables.name=x", r"model.tables is a list: use model.tables\[i\] or"),
        ("scaling[0]=x", r"scaling is a mapping, not a list"),
        ("log_every.x=1", r"log_every is 20, not a mapping: it has no key 'x'"),
        ("num_steps.x=1", r"num_steps={x: 1}: must be a valid integer"),
        ("model.tables[0].sharding_types[0]=x", r"sharding_types is not set; set it whole first"),
        ("model.tables[0].nmae=x", r"unknown key 'model.tables\[0\].nmae' \(did you mean "),
        ("scaling..x=1", r"bad key 'scaling..x'"),
        ("faults=[]", r"unknown key 'faults' \(it moved to 'testing.faults'\)"),
        ("sync.merge=touched_mean", r"^sync.merge was removed: .*lowered the AUC in every "),
    ],
)
def test_bad_override_keys_name_the_path(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("scaling: {use_gpu: 'yes'}", r"^scaling.use_gpu='yes': must be a valid boolean$"),
        ("model: {arch: dlrm3}", r"^model.arch='dlrm3': must be 'dlrm', 'dlrm_dcn', 'deepfm' or"),
        (
            "scaling: {layout: diagonal}",
            r"^scaling.layout='diagonal': must be 'replicas_within_host' or "
            r"'replicas_across_hosts'$",
        ),
        ("num_steps: 1.5", r"^num_steps=1.5: must be a valid integer$"),
        (
            "optimizer: {embedding_lr: true}",
            r"^optimizer.embedding_lr=true: must be a valid number",
        ),
        ("model: {dense_arch_layers: 64}", r"^model.dense_arch_layers=64: must be a valid list$"),
        ("model: {dense_arch_layers: []}", r"^model.dense_arch_layers=\[\]: must have at least 1"),
        ("sync: {levels: [[2]]}", r"^sync.levels\[0\]\[1\] is required$"),
        ("name: 12", r"^name=12: must be a valid string$"),
        ("scaling: 4", r"^scaling=4: must be a mapping$"),
        (
            "model: {tables: [{name: a, embedding_dim: 8}]}",
            r"^model.tables\[0\].num_embeddings is required; model.tables\[0\].features is "
            r"required$",
        ),
        (
            "model: {tables: [{name: a, num_embeddings: many, embedding_dim: 8, features: [f]}]}",
            r"^model.tables\[0\].num_embeddings='many': must be a valid integer$",
        ),
        (
            "model: {tables: [{name: keys, num_embeddings: 4, embedding_dim: 16, features: [f]}]}",
            r"^model.tables\[0\].name: table name 'keys' cannot be used",
        ),
        ("scaling: {sharding_type: row_wise}", r"unknown key 'scaling.sharding_type'; allowed"),
        # Values of the right type are checked by the classes themselves.
        ("scaling: {gang_size: 3}", r"scaling.gang_size=3 does not divide scaling.num_workers=4"),
        ("sync: {sync_every: 0}", r"^sync.sync_every=0: must be greater than 0$"),
        ("- a\n- b", r"must hold a mapping of keys"),
        ("scaling: {num_workers: 2\n", r"is not valid YAML"),
        ("seed: 1\nseed: 2\n", r"key 'seed' appears twice"),
    ],
)
def test_bad_files_name_key_value_and_allowed(
    tmp_path: pathlib.Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_yaml_reads_exponent_floats_as_numbers() -> None:
    # Plain YAML 1.1 (PyYAML's default) reads 1e-8 as the string '1e-8'.
    assert yaml.safe_load("eps: 1e-8") == {"eps": "1e-8"}
    assert read_yaml("eps: 1e-8\nlr: 5E+2\nn: 100") == {"eps": 1e-8, "lr": 500.0, "n": 100}


def test_missing_file_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"cannot read config file /no/such/file.yaml"):
        load_config("/no/such/file.yaml")


# --- config classes added later are covered without changes -----------------------------------


class Mode(enum.StrEnum):
    FAST = "fast"
    SAFE = "safe"


class Member(ConfigModel):
    host: str
    """The member's host."""
    weight: float = 1.0
    """Its weight."""


class Elastic(ConfigModel):
    min_gangs: int = 1
    """At least."""
    max_gangs: int | None = None
    """At most."""
    mode: Lax[Mode] = Mode.SAFE
    """How."""

    @model_validator(mode="after")
    def _bounds(self) -> Elastic:
        if self.max_gangs is not None and self.max_gangs < self.min_gangs:
            raise ConfigError(f"elastic.max_gangs={self.max_gangs} is below elastic.min_gangs")
        return self


class Root(ConfigModel):
    elastic: Elastic | None = None
    """An optional section."""
    members: Seq[Member] = ()
    """A list of sections."""
    limits: dict[str, int] = Field(default={})
    """A mapping."""
    steps: int = 10
    """A number."""


def test_new_config_classes_are_covered_generically(tmp_path: pathlib.Path) -> None:
    path = write(
        tmp_path,
        """
        members:
          - {host: a}
          - {host: b, weight: 2}
        limits: {gpu: 8}
        """,
    )
    root = load_config(path, ["elastic.max_gangs=4", "elastic.mode=fast"], cls=Root)
    assert root == Root(
        elastic=Elastic(max_gangs=4, mode=Mode.FAST),
        members=(Member(host="a"), Member(host="b", weight=2.0)),
        limits={"gpu": 8},
    )
    assert isinstance(root.members[1].weight, float)
    assert load_config(write(tmp_path, dump(root), "r.yaml"), cls=Root) == root
    with pytest.raises(ConfigError, match=r"elastic.mode='slow': must be 'fast' or 'safe'"):
        load_config(overrides=["elastic.mode=slow"], cls=Root)
    with pytest.raises(ConfigError, match=r"unknown key 'elastic.min_gang' \(did you mean "):
        load_config(overrides=["elastic.min_gang=2"], cls=Root)
    with pytest.raises(ConfigError, match=r"elastic.max_gangs=0 is below"):
        load_config(overrides=["elastic.min_gangs=2", "elastic.max_gangs=0"], cls=Root)
    with pytest.raises(ConfigError, match=r"limits.gpu='eight': must be a valid integer"):
        load_config(overrides=["limits={gpu: eight}"], cls=Root)
    with pytest.raises(ConfigError, match=r"members\[0\].host is required"):
        load_config(overrides=["members=[{weight: 1}]"], cls=Root)


def test_apply_override_creates_optional_sections() -> None:
    tree: dict = {"elastic": None}
    apply_override(tree, "elastic.min_gangs", 3)
    assert tree == {"elastic": {"min_gangs": 3}}


# --- the job's command line -------------------------------------------------------------------


def test_job_defaults_and_shortcut_flags() -> None:
    config = build_config([])
    defaults = dict(JOB_DEFAULTS)  # type: ignore[arg-type]
    assert config.num_steps == defaults["num_steps"] == 1000
    assert config.optimizer.embedding == "rowwise_adagrad"
    # The job's model is the classes' default model with the job's table size.
    assert config.model.arch == ModelConfig().arch
    assert {t.num_embeddings for t in config.model.tables} == {
        defaults["model.tables[*].num_embeddings"]
    }
    assert [t.name for t in config.model.tables] == [t.name for t in ModelConfig().tables]
    assert config.data.source == defaults["data.source"] == "generated"

    config = build_config(
        [
            "--num-workers",
            "4",
            "--gang-size",
            "2",
            "--steps",
            "30",
            "--log-every",
            "10",
            "--batch-size",
            "64",
            "--sync-every",
            "2",
            "--arch",
            "dlrm_dcn",
            "--sharding-type",
            "column_wise",
            "--embedding-optimizer",
            "sgd",
            "--num-embeddings",
            "500",
            "--embedding-dim",
            "8",
            "--layout",
            "replicas_within_host",
            "--seed",
            "3",
            "--storage-path",
            "/tmp/r",
            "--data",
            "/data/x.parquet",
            "--epochs",
            "2",
        ]
    )
    assert (config.scaling.num_workers, config.scaling.gang_size) == (4, 2)
    assert config.scaling.layout is Layout.REPLICAS_WITHIN_HOST
    assert (config.num_steps, config.log_every, config.seed) == (30, 10, 3)
    assert config.data.batch_size == 64 and config.sync.sync_every == 2
    assert config.model.arch == "dlrm_dcn" and config.sharding.sharding_type == "column_wise"
    assert config.optimizer.embedding == "sgd"
    assert {(t.num_embeddings, t.embedding_dim) for t in config.model.tables} == {(500, 8)}
    assert config.model.dense_arch_layers == (64, 8)
    assert config.storage_path == "/tmp/r"
    assert (config.data.source, config.data.path, config.data.epochs) == (
        "parquet",
        "/data/x.parquet",
        2,
    )


def test_set_beats_flags_and_flags_beat_the_file(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, "num_steps: 40\nsync: {sync_every: 8}\nscaling: {num_workers: 2}\n")
    config = build_config(["--config", path, "--steps", "30", "--set", "num_steps=20"])
    assert config.num_steps == 20
    assert config.sync.sync_every == 8  # from the file
    assert config.scaling.num_workers == 2


def test_main_exit_codes_and_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--set", "scaling.gang_sise=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("raytrec: configuration error: unknown key 'scaling.gang_sise'")
    assert main(["--print-config", "--steps", "12"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == to_dict(build_config(["--steps", "12"]))
    assert printed["num_steps"] == 12


def test_a_relative_storage_path_under_ray_job_submit_goes_to_the_home_directory() -> None:
    from raytrec.cluster import resolve_storage_path

    submitted = {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}", "HOME": "/home/op"}
    assert resolve_storage_path("runs", submitted) == "/home/op/raytrec_results/runs"
    assert resolve_storage_path("a/../b", submitted) == "/home/op/raytrec_results/b"
    assert resolve_storage_path("/mnt/shared/runs", submitted) == "/mnt/shared/runs"
    # Run by hand: the working directory, as ever.
    assert resolve_storage_path("runs", {"HOME": "/home/op"}) == os.path.abspath("runs")
