"""Typed, validated configuration for a raytrec job.

One small frozen dataclass per component. Each validates itself on
construction with pure arithmetic and raises :class:`ConfigError` naming the
field, the value and what is allowed, so a bad job fails on the driver before
any rank actor starts. Checks that need two components together (a feature
that no table serves, fused Adam on CPU) live in :func:`validate_job`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, get_args

from raytrec.checkpoint.config import CheckpointConfig
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.faults import FaultConfig
from raytrec.errors import ConfigError
from raytrec.sync.stragglers import StragglerSpec
from raytrec.topology import Layout, Topology, TopologyError

__all__ = [
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ScalingConfig",
    "ShardingConfig",
    "SyncConfig",
    "TableConfig",
    "TrainConfig",
]

ModelArch = Literal["dlrm", "dlrm_dcn", "deepfm", "two_tower"]
TwoTowerLoss = Literal["in_batch_softmax", "logistic"]
EmbeddingOptimizer = Literal["sgd", "adagrad", "rowwise_adagrad", "adam"]
DenseOptimizer = Literal["sgd", "adagrad", "adam"]
ShardingType = Literal["table_wise", "column_wise", "row_wise", "table_row_wise"]
Backend = Literal["auto", "gloo", "nccl"]
ReadAhead = Literal["auto", "background", "inline"]
DataSourceKind = Literal["synthetic", "parquet", "generated"]
PoolingName = Literal["sum", "mean"]
OnBadRows = Literal["error", "skip"]
ParquetRead = Literal["indexed", "streaming"]
EvalMetric = Literal["eval_auc", "eval_ne", "eval_log_loss"]
CategoryEncoding = Literal["vocabulary", "hash"]
IdPolicyName = Literal["modulo", "hash", "strict"]

#: Architectures whose interaction needs one embedding_dim for every table: DLRM's dot products
#: and DCN's cross layers take the pooled embeddings as one [B, F, D] block. DeepFM concatenates
#: them flat, so its tables may differ.
SAME_DIM_ARCHS: tuple[str, ...] = ("dlrm", "dlrm_dcn")
#: Architectures that need dense features (DLRM's dense arch makes a vector of the tables'
#: width out of them); DeepFM without dense columns scores from the sparse features alone.
DENSE_ARCHS: tuple[str, ...] = ("dlrm", "dlrm_dcn")

# What TorchRec 1.8's planner offers a CPU compute device (checked on gloo).
CPU_SHARDING_TYPES: tuple[str, ...] = ("table_wise", "column_wise")
CPU_EMBEDDING_OPTIMIZERS: tuple[str, ...] = ("sgd", "adagrad", "rowwise_adagrad")
# The fused embedding optimizers whose FBGEMM kernels take a weight decay (EXACT_SGD and
# EXACT_ADAGRAD ignore it).
EMBEDDING_WEIGHT_DECAY: tuple[str, ...] = ("rowwise_adagrad", "adam")


#: A weighted feature ``f`` reads its weights from the Parquet column ``f + WEIGHTS_SUFFIX``.
WEIGHTS_SUFFIX = "_weights"

#: The largest nice value Linux gives a process (``scaling.rank_niceness``).
MAX_NICENESS = 19


def _positive_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{field} must be a positive integer, got {value!r}")


def _non_negative_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{field} must be a non-negative integer, got {value!r}")


def _positive_float(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{field} must be a positive number, got {value!r}")


def _non_negative_float(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(f"{field} must be a number >= 0, got {value!r}")


def _one_of(field: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{field}={value!r} is not one of {', '.join(map(repr, allowed))}")


# Names TorchRec cannot give an embedding table: its tables are the entries of an nn.ModuleDict,
# which refuses a key that is one of its own attributes (tests/test_config.py checks the list
# against torch's).
RESERVED_TABLE_NAMES: frozenset[str] = frozenset(
    (
        "T_destination",
        "add_module",
        "apply",
        "bfloat16",
        "buffers",
        "call_super_init",
        "children",
        "clear",
        "compile",
        "cpu",
        "cuda",
        "double",
        "dump_patches",
        "eval",
        "extra_repr",
        "float",
        "forward",
        "get_buffer",
        "get_extra_state",
        "get_parameter",
        "get_submodule",
        "half",
        "ipu",
        "items",
        "keys",
        "load_state_dict",
        "modules",
        "mtia",
        "named_buffers",
        "named_children",
        "named_modules",
        "named_parameters",
        "parameters",
        "pop",
        "register_backward_hook",
        "register_buffer",
        "register_forward_hook",
        "register_forward_pre_hook",
        "register_full_backward_hook",
        "register_full_backward_pre_hook",
        "register_load_state_dict_post_hook",
        "register_load_state_dict_pre_hook",
        "register_module",
        "register_parameter",
        "register_state_dict_post_hook",
        "register_state_dict_pre_hook",
        "requires_grad_",
        "set_extra_state",
        "set_submodule",
        "share_memory",
        "state_dict",
        "to",
        "to_empty",
        "train",
        "type",
        "update",
        "values",
        "xpu",
        "zero_grad",
        "training",
    )
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableConfig:
    """One embedding table and the sparse features that look it up.

    - ``weighted``: each id of the table's features carries a float weight and the pooled
      vector is the weighted sum of the ids' rows. In Parquet the weights of feature ``f`` are
      the ``list<float>`` column ``f_weights``, as long as ``f``'s id list in every row. A
      weighted table needs ``pooling="sum"``, and so does every other table of the model (see
      :class:`ModelConfig`).
    - ``sharding_types``: the sharding types TorchRec's planner may choose for this table (its
      ``ParameterConstraints.sharding_types``); None: ``sharding.sharding_type``.
    - ``min_partition``: the narrowest column-wise shard the planner may cut
      (``ParameterConstraints.min_partition``); None: TorchRec's default (128 columns).
    - ``pooling_factor``: the mean number of ids per row the planner assumes for each of the
      table's features when it balances ranks (``ParameterConstraints.pooling_factors``);
      None: TorchRec's default (1.0).
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    features: tuple[str, ...]
    pooling: PoolingName = "sum"  # how a list's ids become one vector: their sum or mean
    weighted: bool = False  # ids carry weights, from the list<float> column <feature>_weights
    sharding_types: tuple[ShardingType, ...] | None = None  # planner's choices; None: the default
    min_partition: int | None = None  # narrowest column-wise shard; None: TorchRec's 128
    pooling_factor: float | None = None  # mean ids per row, for the planner; None: 1.0

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigError(f"table name must be a non-empty string, got {self.name!r}")
        where = f"tables[{self.name}]"
        if self.name in RESERVED_TABLE_NAMES or "." in self.name:
            raise ConfigError(
                f"table name {self.name!r} cannot be used: TorchRec keeps tables in an "
                "nn.ModuleDict, whose own attributes and dotted names are not allowed as keys "
                "(e.g. use 't_items')"
            )
        _one_of(f"{where}.pooling", self.pooling, get_args(PoolingName))
        _positive_int(f"{where}.num_embeddings", self.num_embeddings)
        _positive_int(f"{where}.embedding_dim", self.embedding_dim)
        object.__setattr__(self, "features", tuple(self.features))
        if not self.features:
            raise ConfigError(f"{where}.features must name at least one feature")
        if not isinstance(self.weighted, bool):
            raise ConfigError(f"{where}.weighted must be true or false, got {self.weighted!r}")
        if self.weighted and self.pooling != "sum":
            raise ConfigError(
                f"{where}.weighted=True needs {where}.pooling='sum', got {self.pooling!r}: "
                "PyTorch's EmbeddingBag takes per-id weights only when it sums"
            )
        if self.sharding_types is not None:
            if isinstance(self.sharding_types, str):
                raise ConfigError(
                    f"{where}.sharding_types must be a list of sharding types, "
                    f"got {self.sharding_types!r}"
                )
            object.__setattr__(self, "sharding_types", tuple(self.sharding_types))
            if not self.sharding_types:
                raise ConfigError(f"{where}.sharding_types must not be empty (None: the default)")
            for i, kind in enumerate(self.sharding_types):
                _one_of(f"{where}.sharding_types[{i}]", kind, get_args(ShardingType))
        if self.min_partition is not None:
            _positive_int(f"{where}.min_partition", self.min_partition)
        if self.pooling_factor is not None:
            _positive_float(f"{where}.pooling_factor", self.pooling_factor)


def criteo_tables(
    num_features: int = 26,
    num_embeddings: int | Sequence[int] = 10_000,
    embedding_dim: int = 16,
    feature_prefix: str = "cat_",
) -> tuple[TableConfig, ...]:
    """One table per Criteo-style sparse feature (``cat_0`` ... ``cat_25``)."""
    sizes = (
        [num_embeddings] * num_features if isinstance(num_embeddings, int) else list(num_embeddings)
    )
    if len(sizes) != num_features:
        raise ConfigError(f"num_embeddings has {len(sizes)} entries, expected {num_features}")
    return tuple(
        TableConfig(
            name=f"t_{feature_prefix}{i}",
            num_embeddings=sizes[i],
            embedding_dim=embedding_dim,
            features=(f"{feature_prefix}{i}",),
        )
        for i in range(num_features)
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model over the given tables: TorchRec's DLRM, DLRM-DCN or a DeepFM of TorchRec's parts.

    - ``arch``: ``"dlrm"`` (TorchRec's ``DLRM``), ``"dlrm_dcn"`` (``DLRM_DCN``, a low-rank cross
      network as interaction) or ``"deepfm"`` (TorchRec's DeepFM parts: ``SparseArch``,
      ``FMInteractionArch`` with its ``DeepFM`` and ``FactorizationMachine`` modules, and
      DLRM's dense and over arches, so the output is a logit).
    - ``dense_arch_layers``: the MLP over the dense features. DLRM and DLRM-DCN need its last
      size equal to the tables' embedding_dim; for DeepFM the last size is the width of the
      dense features' vector that joins the embeddings (not used without dense features).
    - ``over_arch_layers``: the MLP that makes the logit; the last size is 1.
    - ``dcn_num_layers``, ``dcn_low_rank_dim``: DLRM-DCN's cross network.
    - ``deep_fm_dimension``: DeepFM's deep part, the width of its layer over all embeddings.
    - ``"two_tower"`` (:class:`raytrec.two_tower.TwoTower`, a retrieval model): a user tower over
      the dense features and the pooled embeddings of ``user_features``, an item tower over
      those of every other feature, each an MLP of ``tower_layers`` (the last size is the
      embedding both towers output); the score of a row is the dot product of its two
      vectors. Each table serves one tower; per-table dims are allowed.
    - ``user_features``: the features of the user tower (two_tower only).
    - ``tower_layers``: both towers' layer sizes (two_tower only).
    - ``two_tower_loss``: ``"in_batch_softmax"`` (each positive row's item against every item
      of its batch, a softmax over the scores divided by ``temperature``; negative rows are
      candidates only) or ``"logistic"`` (binary cross-entropy of each row's score against its
      label: negatives sampled in the data).
    - ``temperature``: divides the scores of ``in_batch_softmax``.

    DLRM and DLRM-DCN need one embedding_dim for every table; DeepFM and the two-tower model
    allow one per table.
    When any table is weighted, every table must be sum-pooled: TorchRec's
    EmbeddingBagCollection passes weights to all of its tables.
    """

    arch: ModelArch = "dlrm"
    tables: tuple[TableConfig, ...] = dataclasses.field(default_factory=criteo_tables)
    dense_arch_layers: tuple[int, ...] = (64, 16)
    over_arch_layers: tuple[int, ...] = (64, 1)
    dcn_num_layers: int = 2
    dcn_low_rank_dim: int = 16
    deep_fm_dimension: int = 16
    user_features: tuple[str, ...] = ()
    tower_layers: tuple[int, ...] = (64, 32)
    two_tower_loss: TwoTowerLoss = "in_batch_softmax"
    temperature: float = 0.05
    #: Dropout probability after every hidden layer of the dense and over arch (not after the
    #: dense arch's output, not on the logit); active in training, off in evaluation and serving.
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _one_of("model.arch", self.arch, get_args(ModelArch))
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, int | float)
            or not 0 <= self.dropout < 1
        ):
            raise ConfigError(
                f"model.dropout must be a probability in [0, 1), got {self.dropout!r}"
            )
        object.__setattr__(self, "tables", tuple(self.tables))
        object.__setattr__(self, "dense_arch_layers", tuple(self.dense_arch_layers))
        object.__setattr__(self, "over_arch_layers", tuple(self.over_arch_layers))
        if not self.tables:
            raise ConfigError("model.tables must hold at least one table")
        names = [t.name for t in self.tables]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"model.tables has duplicate table names {dupes}")
        features = [f for t in self.tables for f in t.features]
        dupes = sorted({f for f in features if features.count(f) > 1})
        if dupes:
            raise ConfigError(f"model.tables: features {dupes} are served by more than one table")
        dims = {t.embedding_dim for t in self.tables}
        if len(dims) != 1 and self.arch in SAME_DIM_ARCHS:
            by_dim = ", ".join(
                f"{d}: {[t.name for t in self.tables if t.embedding_dim == d]}"
                for d in sorted(dims)
            )
            raise ConfigError(
                f"model.arch={self.arch!r} needs one embedding_dim for all tables, got {by_dim}; "
                "per-table dims are allowed with model.arch='deepfm' or 'two_tower'"
            )
        weighted = [t.name for t in self.tables if t.weighted]
        mean = [t.name for t in self.tables if t.pooling != "sum"]
        if weighted and mean:
            raise ConfigError(
                f"model.tables: weighted tables {weighted} need every table sum-pooled, but "
                f"{mean} use pooling='mean' (TorchRec's EmbeddingBagCollection passes the "
                "weights to all its tables, and PyTorch's EmbeddingBag takes them only when it "
                "sums)"
            )
        for field in ("dense_arch_layers", "over_arch_layers"):
            layers = getattr(self, field)
            if not layers:
                raise ConfigError(f"model.{field} must not be empty")
            for i, size in enumerate(layers):
                _positive_int(f"model.{field}[{i}]", size)
        if self.arch in SAME_DIM_ARCHS and self.dense_arch_layers[-1] != self.embedding_dim:
            raise ConfigError(
                f"model.dense_arch_layers[-1]={self.dense_arch_layers[-1]} must equal the tables' "
                f"embedding_dim={self.embedding_dim} (model.arch={self.arch!r})"
            )
        if self.over_arch_layers[-1] != 1:
            raise ConfigError(
                f"model.over_arch_layers[-1]={self.over_arch_layers[-1]} must be 1 (one logit)"
            )
        if len(self.over_arch_layers) < 2:
            raise ConfigError(
                f"model.over_arch_layers={list(self.over_arch_layers)} needs at least two sizes "
                "(TorchRec's OverArch: hidden layers, then 1)"
            )
        _positive_int("model.dcn_num_layers", self.dcn_num_layers)
        _positive_int("model.dcn_low_rank_dim", self.dcn_low_rank_dim)
        _positive_int("model.deep_fm_dimension", self.deep_fm_dimension)
        self._check_towers()

    def _check_towers(self) -> None:
        object.__setattr__(self, "user_features", tuple(self.user_features))
        object.__setattr__(self, "tower_layers", tuple(self.tower_layers))
        _one_of("model.two_tower_loss", self.two_tower_loss, get_args(TwoTowerLoss))
        _positive_float("model.temperature", self.temperature)
        if not self.tower_layers:
            raise ConfigError("model.tower_layers must not be empty")
        for i, size in enumerate(self.tower_layers):
            _positive_int(f"model.tower_layers[{i}]", size)
        if self.arch != "two_tower":
            if self.user_features:
                raise ConfigError("model.user_features applies to model.arch='two_tower' only")
            return
        if self.dropout:
            raise ConfigError(
                "model.dropout applies to the dense and over arches, which "
                "model.arch='two_tower' has none of; set it to 0"
            )
        unknown = sorted(set(self.user_features) - set(self.features))
        if unknown or not self.user_features:
            raise ConfigError(
                f"model.user_features must name some of the tables' features {list(self.features)}"
                f" for the user tower, got {list(self.user_features)}"
            )
        if set(self.user_features) == set(self.features):
            raise ConfigError(
                "model.user_features names every feature: the item tower needs at least one"
            )
        split = [
            t.name
            for t in self.tables
            if 0 < len(set(t.features) & set(self.user_features)) < len(t.features)
        ]
        if split:
            raise ConfigError(
                f"model.tables {split} serve features of both towers; a table serves one tower"
            )

    @property
    def item_features(self) -> tuple[str, ...]:
        """The item tower's features (two_tower): every feature not in the user tower."""
        return tuple(f for f in self.features if f not in self.user_features)

    @property
    def embedding_dim(self) -> int:
        """The first table's embedding_dim: every table's for DLRM and DLRM-DCN."""
        return self.tables[0].embedding_dim

    @property
    def features(self) -> tuple[str, ...]:
        return tuple(f for t in self.tables for f in t.features)

    @property
    def is_weighted(self) -> bool:
        """Whether any table is weighted: the model's embedding collection then takes weights."""
        return any(t.weighted for t in self.tables)

    @property
    def weights_columns(self) -> dict[str, str]:
        """Weighted feature -> the Parquet column of its id weights."""
        return {f: f"{f}{WEIGHTS_SUFFIX}" for t in self.tables if t.weighted for f in t.features}

    @property
    def needs_dense(self) -> bool:
        """Whether the architecture needs at least one dense feature."""
        return self.arch in DENSE_ARCHS

    def check_num_dense(self, num_dense: int) -> None:
        """Refuses zero dense features for an architecture that needs them."""
        if num_dense == 0 and self.needs_dense:
            raise ConfigError(
                f"model.arch={self.arch!r} needs dense features, the data has none "
                "(data.num_dense=0): its dense arch makes the vector its interaction starts "
                "from; use model.arch='deepfm' for data without dense columns"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Fused (in-backward) embedding optimizer and the dense optimizer."""

    embedding: EmbeddingOptimizer = "adagrad"
    embedding_lr: float = 0.05
    dense: DenseOptimizer = "adagrad"
    dense_lr: float = 0.05
    eps: float = 1e-8
    #: L2 penalty on the dense parameters, added to their gradient (torch's weight_decay).
    dense_weight_decay: float = 0.0
    #: Weight decay of the embedding rows a batch looks up, applied by FBGEMM's fused optimizer
    #: on GPU ranks: L2 (added to the gradient) for rowwise_adagrad, decoupled for adam; sgd
    #: and adagrad have none, and FBGEMM's CPU kernels ignore it.
    embedding_weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _one_of("optimizer.embedding", self.embedding, get_args(EmbeddingOptimizer))
        _one_of("optimizer.dense", self.dense, get_args(DenseOptimizer))
        _positive_float("optimizer.embedding_lr", self.embedding_lr)
        _positive_float("optimizer.dense_lr", self.dense_lr)
        _positive_float("optimizer.eps", self.eps)
        _non_negative_float("optimizer.dense_weight_decay", self.dense_weight_decay)
        _non_negative_float("optimizer.embedding_weight_decay", self.embedding_weight_decay)
        if self.embedding_weight_decay and self.embedding not in EMBEDDING_WEIGHT_DECAY:
            raise ConfigError(
                f"optimizer.embedding_weight_decay={self.embedding_weight_decay!r} is not "
                f"supported by FBGEMM's fused {self.embedding!r} optimizer; allowed with "
                f"optimizer.embedding in {', '.join(map(repr, EMBEDDING_WEIGHT_DECAY))}, "
                "else set it to 0"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    """How TorchRec shards each table inside a gang."""

    sharding_type: ShardingType = "table_wise"

    def __post_init__(self) -> None:
        _one_of("sharding.sharding_type", self.sharding_type, get_args(ShardingType))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """How many gangs of how many ranks, where they run, and on what device."""

    num_workers: int = 4  # ranks in the job (T); as in Ray Train's ScalingConfig
    gang_size: int = 2  # ranks holding one copy of the model (L); num_gangs = T / L
    ranks_per_host: int | None = None  # None: one gang per host
    layout: Layout | str = Layout.REPLICAS_ACROSS_HOSTS
    use_gpu: bool = False
    cpus_per_rank: float = 1.0
    backend: Backend = "auto"
    rank_niceness: int | None = 0  # rank processes' nice increment (0-19); None: Ray's 15

    def __post_init__(self) -> None:
        _positive_int("scaling.num_workers", self.num_workers)
        _positive_int("scaling.gang_size", self.gang_size)
        if self.gang_size > self.num_workers:
            raise ConfigError(
                f"scaling.gang_size={self.gang_size} is larger than "
                f"scaling.num_workers={self.num_workers}; allowed: a divisor of num_workers"
            )
        if self.num_workers % self.gang_size:
            divisors = [d for d in range(1, self.num_workers + 1) if self.num_workers % d == 0]
            raise ConfigError(
                f"scaling.gang_size={self.gang_size} does not divide "
                f"scaling.num_workers={self.num_workers}; allowed gang sizes: {divisors}"
            )
        if self.ranks_per_host is not None:
            _positive_int("scaling.ranks_per_host", self.ranks_per_host)
        _positive_float("scaling.cpus_per_rank", self.cpus_per_rank)
        _one_of("scaling.backend", self.backend, get_args(Backend))
        if self.rank_niceness is not None and (
            isinstance(self.rank_niceness, bool)
            or not isinstance(self.rank_niceness, int)
            or not 0 <= self.rank_niceness <= MAX_NICENESS
        ):
            raise ConfigError(
                f"scaling.rank_niceness={self.rank_niceness!r} is not allowed; allowed: an "
                f"integer from 0 to {MAX_NICENESS}, or None for Ray's default for workers (15)"
            )
        if self.backend == "nccl" and not self.use_gpu:
            raise ConfigError("scaling.backend='nccl' needs scaling.use_gpu=True")
        try:
            object.__setattr__(self, "layout", Layout(self.layout))
        except ValueError:
            allowed = ", ".join(repr(x.value) for x in Layout)
            raise ConfigError(f"scaling.layout={self.layout!r} is not one of {allowed}") from None
        try:
            self.topology()
        except TopologyError as e:
            raise ConfigError(f"scaling: {e}") from None

    @property
    def world_size(self) -> int:
        return self.num_workers

    @property
    def num_gangs(self) -> int:
        return self.num_workers // self.gang_size

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.use_gpu else "gloo"

    def topology(self) -> Topology:
        return Topology(
            world_size=self.world_size,
            gang_size=self.gang_size,
            ranks_per_host=self.ranks_per_host or self.gang_size,
            layout=Layout(self.layout),
        )


DenseSync = Literal["every_step", "with_schedule"]


def _multiples(base: int, first: int) -> str:
    return ", ".join(str(base * k) for k in range(first, first + 3)) + ", ..."


def _check_sync_levels(levels: tuple[tuple[int, int], ...], sync_every: int) -> None:
    """The lower levels of a hierarchy nest: periods and group sizes each divide the next."""
    for i, level in enumerate(levels):
        if not isinstance(level, tuple) or len(level) != 2:
            raise ConfigError(
                f"sync.levels[{i}]={level!r} must be a (period, gangs per group) pair"
            )
        _positive_int(f"sync.levels[{i}].period", level[0])
        _positive_int(f"sync.levels[{i}].group_size", level[1])
        if level[1] < 2:
            raise ConfigError(
                f"sync.levels[{i}].group_size={level[1]} must be at least 2 gangs; "
                "a single gang is already averaged every step inside itself"
            )
    for i in range(1, len(levels)):
        (p0, s0), (p1, s1) = levels[i - 1], levels[i]
        if p1 <= p0 or p1 % p0:
            raise ConfigError(
                f"sync.levels[{i}].period={p1} must be a multiple of, and larger than, "
                f"sync.levels[{i - 1}].period={p0}; allowed: {_multiples(p0, 2)}"
            )
        if s1 <= s0 or s1 % s0:
            raise ConfigError(
                f"sync.levels[{i}].group_size={s1} must be a multiple of, and larger than, "
                f"sync.levels[{i - 1}].group_size={s0}, so each group is a union of whole "
                f"lower-level groups; allowed: {_multiples(s0, 2)}"
            )
    if levels:
        top = levels[-1][0]
        if sync_every <= top or sync_every % top:
            raise ConfigError(
                f"sync.sync_every={sync_every} (the job-wide level) must be a multiple of, and "
                f"larger than, the last level's period sync.levels[{len(levels) - 1}].period="
                f"{top}; allowed: {_multiples(top, 2)}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """When, and among which gangs, replicas average their state.

    The top level of the schedule is the job-wide sync every ``sync_every``
    steps (all live gangs). ``levels`` adds lower levels beneath it for
    hierarchical SGD: ``(period, group_size)`` pairs, the group size counted in
    gangs, e.g. ``levels=((2, 8), (4, 32)), sync_every=8`` is seed 002's
    ``{2: 8, 4: 32, 8: all}``. At a step only the highest level that is due
    syncs. Periods and group sizes each divide the next, so levels nest.
    With no levels this is local SGD every ``sync_every`` steps (1: synchronous).

    ``warmup_steps``: steps 1..warmup_steps sync job-wide every step first.
    ``optimizer_state_every``: None averages the fused optimizer state with every
    sync (when ``sync_optimizer_state``); k averages it only at syncs on
    multiples of k (a delayed optimizer-state schedule).
    ``dense``: ``"every_step"`` averages dense gradients over all live gangs
    every step, so dense parameters are identical everywhere; ``"with_schedule"``
    averages dense gradients only inside the gang (DDP) and averages dense
    parameters and dense optimizer state at the schedule's syncs, in the same
    groups as the embeddings, so a slow gang stalls only its group.
    """

    sync_every: int = 4
    sync_optimizer_state: bool = True
    levels: tuple[tuple[int, int], ...] = ()
    warmup_steps: int = 0
    optimizer_state_every: int | None = None
    dense: DenseSync = "every_step"

    def __post_init__(self) -> None:
        _positive_int("sync.sync_every", self.sync_every)
        try:
            levels = tuple(tuple(level) for level in self.levels)
        except TypeError:
            raise ConfigError(
                f"sync.levels={self.levels!r} must be a sequence of (period, gangs per group) pairs"
            ) from None
        object.__setattr__(self, "levels", levels)
        _check_sync_levels(self.levels, self.sync_every)
        if (
            isinstance(self.warmup_steps, bool)
            or not isinstance(self.warmup_steps, int)
            or self.warmup_steps < 0
        ):
            raise ConfigError(
                f"sync.warmup_steps must be a non-negative integer, got {self.warmup_steps!r}"
            )
        _one_of("sync.dense", self.dense, get_args(DenseSync))
        every = self.optimizer_state_every
        if every is not None:
            _positive_int("sync.optimizer_state_every", every)
            if not self.sync_optimizer_state:
                raise ConfigError(
                    f"sync.optimizer_state_every={every} needs sync.sync_optimizer_state=True"
                )
            first = self.periods[0]
            if every % first:
                raise ConfigError(
                    f"sync.optimizer_state_every={every} must be a multiple of the shortest "
                    f"sync period {first}, so optimizer state travels with a sync; allowed: "
                    f"{_multiples(first, 1)}"
                )

    @property
    def periods(self) -> tuple[int, ...]:
        """Every level's period, lowest level first, ending with ``sync_every``."""
        return (*(p for p, _ in self.levels), self.sync_every)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ColumnsConfig:
    """Which Parquet columns hold a row's parts. The defaults are raytrec's own layout, so only
    what differs needs naming.

    - ``label``: the label column (0/1).
    - ``row_id``: an integer column naming each row (in error messages, predict's output and the
      consumption logs); None: the data has none, and rows are named by their file and their
      index in it.
    - ``dense``: the dense (numeric) input columns, in order; None: ``dense_0`` ..
      ``dense_{data.num_dense-1}``; an empty list: no dense input.
    - ``features``: sparse feature -> the column holding its ids (a list per row, or one value
      per row); a feature not named here reads the column of its own name.
    - ``categorical``: sparse feature -> how the categories in its column (strings, or integers
      used as categories) become ids: ``"vocabulary"`` (the most frequent values of the training
      data get ids 1.., every other value id 0; the vocabulary is saved with the model) or
      ``"hash"`` (a stable hash modulo the table's rows). Features not named here hold integer
      ids, mapped by ``data.id_policy``.
    """

    label: str = "label"
    row_id: str | None = "row_id"
    dense: tuple[str, ...] | None = None
    features: dict[str, str] = dataclasses.field(default_factory=dict)
    categorical: dict[str, CategoryEncoding] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for field in ("label", "row_id"):
            value = getattr(self, field)
            if (value is not None or field == "label") and (
                not isinstance(value, str) or not value
            ):
                raise ConfigError(f"data.columns.{field} must be a column name, got {value!r}")
        if self.dense is not None:
            object.__setattr__(self, "dense", tuple(self.dense))
            if any(not isinstance(c, str) or not c for c in self.dense):
                raise ConfigError(f"data.columns.dense must be column names, got {self.dense!r}")
        object.__setattr__(self, "features", dict(self.features))
        object.__setattr__(self, "categorical", dict(self.categorical))
        for feature, column in self.features.items():
            if not isinstance(column, str) or not column:
                raise ConfigError(
                    f"data.columns.features[{feature!r}] must be a column name, got {column!r}"
                )
        for feature, encoding in self.categorical.items():
            _one_of(f"data.columns.categorical[{feature!r}]", encoding, get_args(CategoryEncoding))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where training rows come from and how each rank batches them.

    ``source`` picks the stream when :func:`raytrec.fit` is given no source object:

    - ``"synthetic"``: rows generated in each rank
      (:class:`~raytrec.data.synthetic.SyntheticCriteo`), no I/O; endless, so ``epochs`` does
      not apply.
    - ``"parquet"``: the Parquet files at ``path`` (a file, a directory or a pyarrow URI such as
      ``s3://bucket/prefix``), read by Ray Data (``parquet_read``). Columns (``columns`` maps
      your own names): ``dense_0`` .. ``dense_{num_dense-1}`` (numbers), one id-list column per
      sparse feature named like the feature, ``<feature>_weights`` (``list<float>``) for each
      feature of a weighted table, ``label`` and ``row_id``.
    - ``"generated"``: Parquet written once from the synthetic teacher model (with its oracle
      AUC known) into ``path`` (default: ``<storage_path>/data/<a name from the sizes>``, reused
      when already there), then read like ``"parquet"`` (its ids span the largest table and
      are folded into smaller ones: ``id_policy="modulo"``); ``generated_rows`` rows, or when
      that is None sized so the job trains ``epochs`` passes over it in ``num_steps`` steps.

    With ``num_steps=None`` (:class:`TrainConfig`) the job trains every batch of ``epochs``
    passes over Parquet data (``"parquet"``, ``"generated"``), and no more.

    ``parquet_read`` says how ranks read Parquet: ``"indexed"``, each rank its own batches, each
    batch at a fixed place in the data, so a lost gang's uncommitted batches are read again by
    the survivors and a resume from a checkpoint continues on the same rows; or
    ``"streaming"``, one pipeline cut among the ranks by ``streaming_split`` (batches have no
    ids: a loss leaves them untrained, counted in ``Result.lost_batches``).

    ``shuffle_window_rows`` shuffles rows, not only row groups: each epoch's rows, in the
    seeded row-group order, are cut into windows of this many consecutive rows, and the rows of
    each window are permuted (seeded by ``shuffle_seed``, the epoch and the window), so rows of
    neighbouring row groups mix. Read by index, a batch is read from its window(s): the order
    is a pure function of the seed and the data, so replays and resumes read the same rows.
    Streaming, it is Ray Data's local shuffle buffer of this many rows in each rank.
    """

    batch_size: int = 256  # rows per rank per step
    source: DataSourceKind = "synthetic"
    path: str | None = None
    epochs: int = 1  # passes over Parquet data
    shuffle_seed: int | None = None  # None: files in sorted order; else a seeded order per epoch
    #: Rows permuted together within each epoch (needs shuffle_seed); None: rows keep their
    #: order within a row group (indexed) or file (streaming).
    shuffle_window_rows: int | None = None
    on_bad_rows: OnBadRows = "error"  # "skip" drops rows holding a bad value and counts them
    parquet_read: ParquetRead = "indexed"  # "indexed": replayable batches; or "streaming"
    # How integer ids map into a table's rows: "strict" (an id outside [0, num_embeddings) is
    # bad input), "modulo" (folded into range) or "hash" (hashed into range).
    id_policy: IdPolicyName = "strict"
    # Dense columns of a Parquet source (dense_0 ..); None: 13, or as many as columns.dense
    # names; 0: none (model.arch="deepfm" only).
    num_dense: int | None = None
    columns: ColumnsConfig = dataclasses.field(default_factory=ColumnsConfig)
    # A category must appear this many times in the training data to get a vocabulary id.
    vocabulary_min_count: int = 1
    generated_files: int = 4
    #: Rows per epoch of data.source="generated"; None: enough for num_steps steps.
    generated_rows: int | None = None
    #: Rows of a held-out split of data.source="generated": the same teacher, other rows,
    #: written beside the training data and evaluated on (eval.path) unless eval.path is set;
    #: 0: none.
    generated_held_out_rows: int = 0
    prefetch_batches: int = 4  # batches each rank fetches ahead of training
    # Where a rank makes its batches: "background" (a read-ahead thread, overlapping training),
    # "inline" (between intervals, on the training thread), "auto" (background on GPU ranks,
    # inline on CPU ranks, where a thread competes with training for the cores).
    read_ahead: ReadAhead = "auto"  # "background" thread or "inline"; "auto": thread on GPU only

    def __post_init__(self) -> None:
        _positive_int("data.batch_size", self.batch_size)
        _one_of("data.source", self.source, get_args(DataSourceKind))
        _positive_int("data.epochs", self.epochs)
        _one_of("data.on_bad_rows", self.on_bad_rows, get_args(OnBadRows))
        _one_of("data.parquet_read", self.parquet_read, get_args(ParquetRead))
        _one_of("data.id_policy", self.id_policy, get_args(IdPolicyName))
        if not isinstance(self.columns, ColumnsConfig):
            raise ConfigError(f"data.columns must be a ColumnsConfig, got {self.columns!r}")
        named = self.columns.dense
        if self.num_dense is None:
            object.__setattr__(self, "num_dense", 13 if named is None else len(named))
        else:
            _non_negative_int("data.num_dense", self.num_dense)
            if named is not None and self.num_dense != len(named):
                raise ConfigError(
                    f"data.num_dense={self.num_dense} but data.columns.dense names {len(named)} "
                    "columns; leave num_dense out"
                )
        _positive_int("data.vocabulary_min_count", self.vocabulary_min_count)
        _positive_int("data.generated_files", self.generated_files)
        _non_negative_int("data.prefetch_batches", self.prefetch_batches)
        _one_of("data.read_ahead", self.read_ahead, get_args(ReadAhead))
        if self.shuffle_seed is not None:
            _non_negative_int("data.shuffle_seed", self.shuffle_seed)
        if self.shuffle_window_rows is not None:
            _positive_int("data.shuffle_window_rows", self.shuffle_window_rows)
            if self.shuffle_seed is None:
                raise ConfigError(
                    f"data.shuffle_window_rows={self.shuffle_window_rows} needs "
                    "data.shuffle_seed: the rows' order is drawn from it"
                )
        if self.generated_rows is not None:
            _positive_int("data.generated_rows", self.generated_rows)
        _non_negative_int("data.generated_held_out_rows", self.generated_held_out_rows)
        if self.source == "parquet" and not self.path:
            raise ConfigError("data.path must name Parquet files when data.source='parquet'")
        if self.path is not None and (not isinstance(self.path, str) or not self.path):
            raise ConfigError(f"data.path must be null or a non-empty string, got {self.path!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Evaluation on held-out rows while the job trains.

    - ``path``: held-out Parquet in the training data's schema (a file or directory); None
      (the default) evaluates nothing. ``fit(..., eval_source=PATH)`` sets it too.
    - ``every_n_steps``: evaluate at the first interval boundary at or after every this many
      steps, and always at the end; None: at the end only.
    - ``batch_size``: rows per rank per evaluation step; None: ``data.batch_size``.
    - ``max_rows``: evaluate on the first this many rows only; None: every row.
    - ``early_stopping_patience``: stop the job once ``early_stopping_metric`` has not
      improved on its best by more than ``early_stopping_min_delta`` for this many evaluations
      in a row (it ends like a finished job: synced, checkpointed when checkpoints are
      configured, saved); None: never. Needs ``every_n_steps``.
    - ``early_stopping_metric``: ``eval_auc`` (higher is better), ``eval_ne`` or
      ``eval_log_loss`` (lower is better).
    """

    path: str | None = None
    every_n_steps: int | None = None
    batch_size: int | None = None
    max_rows: int | None = None
    early_stopping_patience: int | None = None
    early_stopping_metric: EvalMetric = "eval_auc"
    early_stopping_min_delta: float = 0.0

    def __post_init__(self) -> None:
        if self.path is not None and (not isinstance(self.path, str) or not self.path):
            raise ConfigError(f"eval.path must be a non-empty path or None, got {self.path!r}")
        for field in ("every_n_steps", "batch_size", "max_rows", "early_stopping_patience"):
            if getattr(self, field) is not None:
                _positive_int(f"eval.{field}", getattr(self, field))
        _one_of("eval.early_stopping_metric", self.early_stopping_metric, get_args(EvalMetric))
        delta = self.early_stopping_min_delta
        if isinstance(delta, bool) or not isinstance(delta, int | float) or not delta >= 0:
            raise ConfigError(f"eval.early_stopping_min_delta must be a number >= 0, got {delta!r}")
        if self.early_stopping_patience is not None and self.every_n_steps is None:
            raise ConfigError(
                "eval.early_stopping_patience needs eval.every_n_steps: without it the model "
                "is evaluated at the end only"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one training job needs, apart from the data source."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
    scaling: ScalingConfig = dataclasses.field(default_factory=ScalingConfig)
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    elastic: ElasticConfig = dataclasses.field(default_factory=ElasticConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    faults: FaultConfig = dataclasses.field(default_factory=FaultConfig)  # injected, for tests
    stragglers: StragglerSpec | None = None  # injected stalls, for straggler experiments
    #: Steps every rank trains; None (the default): every batch of data.epochs passes over
    #: Parquet data (data.source "parquet" or "generated"), worked out from the files before
    #: training. The endless synthetic source needs it set.
    num_steps: int | None = None
    log_every: int = 20
    #: Seeds the dense and embedding initialisation and generated data: two CPU runs with
    #: the same seed, config and shape end with bitwise-identical weights.
    seed: int = 0
    storage_path: str = "runs"
    name: str = "raytrec"

    def __post_init__(self) -> None:
        if self.num_steps is not None:
            _positive_int("num_steps", self.num_steps)
        _positive_int("log_every", self.log_every)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        for field, cls in (
            ("model", ModelConfig),
            ("optimizer", OptimizerConfig),
            ("sharding", ShardingConfig),
            ("scaling", ScalingConfig),
            ("sync", SyncConfig),
            ("data", DataConfig),
            ("elastic", ElasticConfig),
            ("checkpoint", CheckpointConfig),
            ("eval", EvalConfig),
            ("faults", FaultConfig),
        ):
            if not isinstance(getattr(self, field), cls):
                raise ConfigError(f"{field} must be a {cls.__name__}, got {getattr(self, field)!r}")
        if self.stragglers is not None and not isinstance(self.stragglers, StragglerSpec):
            raise ConfigError(
                f"stragglers must be a StragglerSpec or None, got {self.stragglers!r}"
            )
        if (
            self.num_steps is None
            and self.data.source == "generated"
            and self.data.generated_rows is None
        ):
            raise ConfigError(
                "num_steps=None takes the job's length from the data, and data.source="
                "'generated' sizes its data from num_steps: set data.generated_rows or num_steps"
            )
        self.elastic.resolved_max_gangs(self.scaling.num_gangs)  # min <= initial <= max
        self.faults.check_targets(
            num_ranks=self.scaling.world_size,
            num_gangs=self.scaling.num_gangs,
            num_nodes=self.scaling.topology().num_hosts,
        )
        if not self.scaling.use_gpu:
            if self.optimizer.embedding not in CPU_EMBEDDING_OPTIMIZERS:
                raise ConfigError(
                    f"optimizer.embedding={self.optimizer.embedding!r} cannot run on CPU ranks: "
                    "FBGEMM's CPU kernels refuse it ('Optimizer adam is not supported in CPU "
                    f"mode'); on CPU use one of {', '.join(map(repr, CPU_EMBEDDING_OPTIMIZERS))}, "
                    "or set scaling.use_gpu=True"
                )
            if self.optimizer.embedding_weight_decay:
                raise ConfigError(
                    f"optimizer.embedding_weight_decay={self.optimizer.embedding_weight_decay!r} "
                    "cannot run on CPU ranks: FBGEMM's CPU kernels ignore it; set it to 0, or "
                    "set scaling.use_gpu=True (or use optimizer.dense_weight_decay)"
                )
            for field, kinds in self.sharding_choices():
                for kind in kinds:
                    if kind not in CPU_SHARDING_TYPES:
                        raise ConfigError(
                            f"{field}={kind!r} has no CPU kernel in TorchRec 1.8's planner; on "
                            f"CPU use one of {', '.join(map(repr, CPU_SHARDING_TYPES))}, or set "
                            "scaling.use_gpu=True"
                        )
        if self.data.source in ("parquet", "generated"):
            assert self.data.num_dense is not None  # DataConfig resolves it
            self.model.check_num_dense(self.data.num_dense)

    def sharding_choices(self) -> list[tuple[str, tuple[str, ...]]]:
        """``(config field, sharding types)`` the planner may use: each table's own
        ``sharding_types``, else ``sharding.sharding_type``."""
        default = ("sharding.sharding_type", (self.sharding.sharding_type,))
        return [
            (f"model.tables[{t.name}].sharding_types", t.sharding_types)
            if t.sharding_types is not None
            else default
            for t in self.model.tables
        ]

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    @property
    def feed_in_background(self) -> bool:
        """``data.read_ahead`` resolved: whether ranks make batches on a read-ahead thread."""
        if self.data.read_ahead == "auto":
            return self.scaling.use_gpu
        return self.data.read_ahead == "background"


def validate_features(model: ModelConfig, source_features: Sequence[str]) -> None:
    """Every sparse feature of the data is served by a table, and the other way round."""
    served = set(model.features)
    unserved = [f for f in source_features if f not in served]
    if unserved:
        raise ConfigError(
            f"sparse features {unserved} from the data source are served by no table "
            f"(model.tables[*].features serves {sorted(served)})"
        )
    missing = [f for f in model.features if f not in set(source_features)]
    if missing:
        raise ConfigError(
            f"model.tables[*].features names {missing}, which the data source does not provide "
            f"(it provides {list(source_features)})"
        )
