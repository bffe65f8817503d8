"""The model's config: its embedding tables (:class:`TableConfig`) and architecture
(:class:`ModelConfig`). Rules that span tables (unique names, one width for DLRM, sum pooling
with weights, the two towers' features) are checked here; see :mod:`raytrec.config.base`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from annotated_types import Ge, Gt, Le, Lt, MinLen
from pydantic import field_validator, model_validator

from raytrec.config.base import (
    ConfigError,
    ConfigModel,
    Name,
    PositiveFloat,
    PositiveInt,
    Seq,
)

__all__ = ["UVM_KERNELS", "IdsConfig", "ModelConfig", "TableConfig", "criteo_tables"]

ModelArch = Literal["dlrm", "dlrm_dcn", "deepfm", "two_tower"]
TwoTowerLoss = Literal["in_batch_softmax", "logistic"]
ShardingType = Literal["table_wise", "column_wise", "row_wise", "table_row_wise"]
PoolingName = Literal["sum", "mean"]
#: FBGEMM's fused kernels TorchRec's planner may place a table with: ``fused`` keeps the table in
#: device memory (HBM on a GPU, RAM on a CPU rank); ``fused_uvm_caching`` keeps it in host memory
#: mapped into the GPU (UVM) with a cache of its hottest rows in HBM; ``fused_uvm`` reads it from
#: UVM on every lookup. The UVM kernels exist on GPU ranks only.
ComputeKernel = Literal["fused", "fused_uvm_caching", "fused_uvm"]
UVM_KERNELS: tuple[str, ...] = ("fused_uvm_caching", "fused_uvm")
#: The precision of a table's weights; FBGEMM keeps the fused optimizer's state in fp32 either way.
EmbeddingPrecision = Literal["fp32", "fp16"]
Layers = Annotated[Seq[PositiveInt], MinLen(1)]
IdsPolicy = Literal["fixed", "managed"]
Eviction = Literal["lru", "lfu"]

#: Architectures whose interaction needs one embedding_dim for every table: DLRM's dot products
#: and DCN's cross layers take the pooled embeddings as one [B, F, D] block. DeepFM concatenates
#: them flat, so its tables may differ.
SAME_DIM_ARCHS: tuple[str, ...] = ("dlrm", "dlrm_dcn")
#: Architectures that need dense features (DLRM's dense arch makes a vector of the tables'
#: width out of them); DeepFM without dense columns scores from the sparse features alone.
DENSE_ARCHS: tuple[str, ...] = ("dlrm", "dlrm_dcn")

#: A weighted feature ``f`` reads its weights from the Parquet column ``f + WEIGHTS_SUFFIX``.
WEIGHTS_SUFFIX = "_weights"

# Names TorchRec cannot give an embedding table: its tables are the entries of an nn.ModuleDict,
# which refuses a key that is one of its own attributes (tests/unit/test_config.py checks the list
# against torch's).
RESERVED_TABLE_NAMES: frozenset[str] = frozenset(
    """
    T_destination add_module apply bfloat16 buffers call_super_init children clear compile cpu
    cuda double dump_patches eval extra_repr float forward get_buffer get_extra_state
    get_parameter get_submodule half ipu items keys load_state_dict modules mtia named_buffers
    named_children named_modules named_parameters parameters pop register_backward_hook
    register_buffer register_forward_hook register_forward_pre_hook register_full_backward_hook
    register_full_backward_pre_hook register_load_state_dict_post_hook
    register_load_state_dict_pre_hook register_module register_parameter
    register_state_dict_post_hook register_state_dict_pre_hook requires_grad_ set_extra_state
    set_submodule share_memory state_dict to to_empty train type update values xpu zero_grad
    training
    """.split()  # noqa: SIM905 (a word list, kept compact)
)


class IdsConfig(ConfigModel):
    """How a table's raw ids become its rows (docs/managed_ids.md)."""

    policy: IdsPolicy = "fixed"
    """`fixed`: ids are rows, as the data delivers them (`data.id_policy`, vocabularies).
    `managed`: raw int64 ids of any size are mapped to rows while training, collision-free
    between live ids: new ids are admitted and stale ones evicted at each job-wide sync, by one
    decision every rank of the job applies; an id not admitted reads the table's default row
    (row `budget - 1`)."""
    budget: Annotated[int, Ge(2)] | None = None
    """With `managed`: the rows the map may use, the default row included (at most
    `num_embeddings`); null: `num_embeddings`."""
    eviction: Eviction = "lru"
    """With `managed`: which live id gives up its row when a new one needs it: `lru` the least
    recently seen, `lfu` the least often seen (counts since admission)."""


class TableConfig(ConfigModel):
    """One embedding table and the sparse features that look it up."""

    name: Name
    """The table's name, unique in the model. Not a dotted name, nor an attribute of
    `nn.ModuleDict` (TorchRec keeps the tables in one), such as `items` or `keys`."""
    num_embeddings: PositiveInt
    """Rows of the table."""
    embedding_dim: PositiveInt
    """Width of each row (the pooled embedding)."""
    features: Annotated[Seq[Name], MinLen(1)]
    """The sparse features that look this table up."""
    pooling: PoolingName = "sum"
    """How a list's ids become one vector: their sum or mean."""
    weighted: bool = False
    """Each id of the table's features carries a float weight and the pooled vector is the
    weighted sum of the ids' rows. In Parquet the weights of feature `f` are the `list<float>`
    column `f_weights`, as long as `f`'s id list in every row. Needs `pooling: sum`, and so does
    every other table of the model."""
    sharding_types: Annotated[Seq[ShardingType], MinLen(1)] | None = None
    """The sharding types TorchRec's planner may choose for this table (its
    `ParameterConstraints.sharding_types`); null: `sharding.sharding_type`."""
    min_partition: PositiveInt | None = None
    """The narrowest column-wise shard the planner may cut
    (`ParameterConstraints.min_partition`); null: TorchRec's default (128 columns)."""
    pooling_factor: PositiveFloat | None = None
    """The mean number of ids per row the planner assumes for each of the table's features when
    it balances ranks (`ParameterConstraints.pooling_factors`); null: TorchRec's default (1.0)."""
    compute_kernel: ComputeKernel = "fused"
    """Where the table lives (`ParameterConstraints.compute_kernels`): `fused` in device memory;
    `fused_uvm_caching` in host memory with its hottest rows cached in HBM, for tables larger
    than HBM; `fused_uvm` in host memory, no cache. The UVM kernels need `scaling.use_gpu`."""
    cache_load_factor: Annotated[float, Gt(0), Le(1)] | None = None
    """With `fused_uvm_caching`: the share of the table's rows the HBM cache holds
    (`CacheParams.load_factor`); null: TorchRec's default (0.2)."""
    precision: EmbeddingPrecision = "fp32"
    """The precision of the table's weights (`EmbeddingBagConfig.data_type`): `fp16` halves their
    memory; the fused optimizer's state stays fp32 and replica syncs average in fp32."""
    ids: IdsConfig = IdsConfig()
    """How raw ids map to rows: `fixed` (as delivered) or `managed` (a map kept while
    training, docs/managed_ids.md)."""

    @property
    def managed(self) -> bool:
        """Whether the table's ids are managed (``ids.policy == "managed"``)."""
        return self.ids.policy == "managed"

    @property
    def id_budget(self) -> int:
        """The rows a managed table's map uses (``ids.budget``, default ``num_embeddings``)."""
        return self.ids.budget if self.ids.budget is not None else self.num_embeddings

    @model_validator(mode="after")
    def _budget_fits(self) -> TableConfig:
        if self.ids.budget is not None and self.ids.budget > self.num_embeddings:
            raise ConfigError(
                f"model.tables[{self.name}].ids.budget={self.ids.budget} exceeds "
                f"num_embeddings={self.num_embeddings}: the map hands out rows of the table"
            )
        return self

    @field_validator("name")
    @classmethod
    def _torchrec_can_hold(cls, name: str) -> str:
        if name in RESERVED_TABLE_NAMES or "." in name:
            raise ConfigError(
                f"table name {name!r} cannot be used: TorchRec keeps tables in an nn.ModuleDict, "
                "whose own attributes and dotted names are not allowed as keys (e.g. use "
                "'t_items')"
            )
        return name

    @model_validator(mode="after")
    def _cache_needs_caching(self) -> TableConfig:
        if self.cache_load_factor is not None and self.compute_kernel != "fused_uvm_caching":
            raise ConfigError(
                f"model.tables[{self.name}].cache_load_factor={self.cache_load_factor!r} needs "
                f"compute_kernel='fused_uvm_caching' (got {self.compute_kernel!r}): only that "
                "kernel has a cache"
            )
        return self

    @model_validator(mode="after")
    def _weights_need_sum(self) -> TableConfig:
        if self.weighted and self.pooling != "sum":
            raise ConfigError(
                f"weighted=True needs pooling='sum', got {self.pooling!r}: PyTorch's "
                "EmbeddingBag takes per-id weights only when it sums"
            )
        return self


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


class ModelConfig(ConfigModel):
    """The model over the given tables: TorchRec's DLRM, DLRM-DCN, a DeepFM of TorchRec's parts,
    or a two-tower retrieval model.

    DLRM and DLRM-DCN need one embedding_dim for every table; DeepFM and the two-tower model
    allow one per table. When any table is weighted, every table must be sum-pooled: TorchRec's
    EmbeddingBagCollection passes weights to all of its tables.
    """

    arch: ModelArch = "dlrm"
    """`dlrm` (TorchRec's `DLRM`), `dlrm_dcn` (`DLRM_DCN`, a low-rank cross network as
    interaction), `deepfm` (TorchRec's `SparseArch`, `FMInteractionArch` with its `DeepFM` and
    `FactorizationMachine` modules, and DLRM's dense and over arches, so the output is a logit)
    or `two_tower` (a retrieval model: a user tower over the dense features and the pooled
    embeddings of `user_features`, an item tower over those of every other feature, each an MLP
    of `tower_layers`; a row's score is the dot product of its two vectors, and each table
    serves one tower)."""
    tables: Annotated[Seq[TableConfig], MinLen(1)] = criteo_tables()
    """The embedding tables; by default the 26 Criteo-style tables `t_cat_0` .. `t_cat_25`
    (10000 rows, 16 wide), one per feature `cat_0` .. `cat_25`."""
    dense_arch_layers: Layers = (64, 16)
    """The MLP over the dense features. DLRM and DLRM-DCN need its last size equal to the
    tables' embedding_dim; for DeepFM the last size is the width of the dense features' vector
    that joins the embeddings (not used without dense features)."""
    over_arch_layers: Annotated[Layers, MinLen(2)] = (64, 1)
    """The MLP that makes the logit: hidden sizes, then 1."""
    dcn_num_layers: PositiveInt = 2
    """DLRM-DCN's cross network: its number of layers."""
    dcn_low_rank_dim: PositiveInt = 16
    """DLRM-DCN's cross network: the rank of each layer's low-rank weight."""
    deep_fm_dimension: PositiveInt = 16
    """DeepFM's deep part: the width of its layer over all embeddings."""
    user_features: Seq[Name] = ()
    """The features of the user tower (two_tower only)."""
    tower_layers: Layers = (64, 32)
    """Both towers' layer sizes (two_tower only); the last is the width of the vector each
    tower outputs."""
    two_tower_loss: TwoTowerLoss = "in_batch_softmax"
    """`in_batch_softmax` (each positive row's item against every item of its batch, a softmax
    over the scores divided by `temperature`; negative rows are candidates only) or `logistic`
    (binary cross-entropy of each row's score against its label: negatives sampled in the
    data)."""
    temperature: PositiveFloat = 0.05
    """Divides the scores of `in_batch_softmax`."""
    dropout: Annotated[float, Ge(0), Lt(1)] = 0.0
    """Dropout probability after every hidden layer of the dense and over arch (not after the
    dense arch's output, not on the logit); active in training, off in evaluation and
    serving."""

    @model_validator(mode="after")
    def _tables_fit_together(self) -> ModelConfig:
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
        if self.arch in SAME_DIM_ARCHS and self.dense_arch_layers[-1] != self.embedding_dim:
            raise ConfigError(
                f"model.dense_arch_layers[-1]={self.dense_arch_layers[-1]} must equal the tables' "
                f"embedding_dim={self.embedding_dim} (model.arch={self.arch!r})"
            )
        if self.over_arch_layers[-1] != 1:
            raise ConfigError(
                f"model.over_arch_layers[-1]={self.over_arch_layers[-1]} must be 1 (one logit)"
            )
        return self

    @model_validator(mode="after")
    def _towers(self) -> ModelConfig:
        if self.arch != "two_tower":
            if self.user_features:
                raise ConfigError("model.user_features applies to model.arch='two_tower' only")
            return self
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
        return self

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
