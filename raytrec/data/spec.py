"""Which Arrow columns make up a training row, and how each becomes a model input.

A :class:`FeatureSpec` names the dense (float) columns, the sparse features (id-list or single-id
columns, or dense columns bucketized into ids), the label column(s) and an optional row-id column.
It is pure data (frozen, picklable, no torch or Arrow imports), validated on construction, so a bad
spec fails on the driver rather than inside a rank. :mod:`raytrec.data.arrow_kjt` applies it.

A :class:`CategoricalFeature` reads a column of categories (strings, or integers used as
categories) and turns each into an id by a vocabulary or by hashing; :func:`fit_vocabulary` is the
pure part of building a vocabulary from value counts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Literal, TypeAlias

__all__ = [
    "BucketizedFeature",
    "CategoricalFeature",
    "ColumnKind",
    "FeatureSpec",
    "IdPolicy",
    "NullIdPolicy",
    "SparseFeature",
    "SpecError",
    "criteo_spec",
    "fit_vocabulary",
    "parquet_layout",
]

IdPolicy: TypeAlias = Literal["modulo", "hash", "strict", "raw"]
NullIdPolicy: TypeAlias = Literal["error", "drop"]
# What a column must hold: "numeric" is any integer, floating or boolean column; "ids" is an
# integer column (one id per row) or a list / large_list of integers; "integer" is an integer
# column; "categories" is a string or integer column, or a list of either; "weights" is a list /
# large_list of floating point or integer numbers, or a numeric column (one weight per row, next
# to a one-id-per-row ids column).
ColumnKind: TypeAlias = Literal["numeric", "ids", "integer", "categories", "weights"]
Encoding: TypeAlias = Literal["vocabulary", "hash", "hash64"]

_ID_POLICIES: tuple[IdPolicy, ...] = ("modulo", "hash", "strict", "raw")
_NULL_ID_POLICIES: tuple[NullIdPolicy, ...] = ("error", "drop")


class SpecError(ValueError):
    """A feature spec field holds a value outside its allowed set; names the field."""

    def __init__(self, owner: str, field: str, value: object, allowed: str) -> None:
        super().__init__(f"{owner}.{field} must be {allowed}, got {value!r}")
        self.field = field
        self.value = value
        self.allowed = allowed


def _check_name(owner: str, field: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise SpecError(owner, field, value, "a non-empty string")


def _check_unique(owner: str, field: str, names: Sequence[str]) -> None:
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SpecError(owner, field, tuple(names), f"free of duplicates (repeated: {dupes})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseFeature:
    """An id-list feature read from ``column`` (default: ``name``).

    The column is ``list<int>`` / ``large_list<int>`` (any length, empty allowed; a null list is
    an empty list) or a plain integer column (one id per row; a null is an empty list). Ids map
    into ``[0, num_embeddings)`` by ``id_policy`` (default ``"strict"``):

    - ``"modulo"``: ``id % num_embeddings``; a negative id is an error (it signals corrupt data,
      and a silent wrap would alias it onto a valid row);
    - ``"hash"``: splitmix64 of the id's 64-bit pattern (unsalted: the same in every feature),
      then modulo; accepts any id, negative or huge;
    - ``"strict"``: any id ``< 0`` or ``>= num_embeddings`` is an error;
    - ``"raw"``: the ids as they are, any int64 (a table with managed ids maps them to rows in
      the model, docs/managed_ids.md).

    ``null_id_policy`` says what a null *inside* a list means: ``"error"`` or ``"drop"`` (remove it
    and shorten the list).

    ``weights``: the column of the ids' weights (a weighted feature), ``list<float>`` with one
    finite weight per id of the row (a plain numeric column next to a plain integer ids column);
    a null weights list stands for an empty one. Its lengths must equal the ids' (a null id
    dropped by ``null_id_policy="drop"`` drops its weight). None: the feature is unweighted
    (weight 1 wherever a batch carries weights).
    """

    name: str
    column: str | None = None
    num_embeddings: int
    id_policy: IdPolicy = "strict"
    null_id_policy: NullIdPolicy = "error"
    weights: str | None = None

    def __post_init__(self) -> None:
        owner = "SparseFeature"
        _check_name(owner, "name", self.name)
        if self.column is None:
            object.__setattr__(self, "column", self.name)  # frozen: normalize once, here
        _check_name(owner, "column", self.column)
        n = self.num_embeddings
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise SpecError(owner, "num_embeddings", n, "an int >= 1")
        object.__setattr__(self, "num_embeddings", int(n))  # numpy ints -> int
        if self.id_policy not in _ID_POLICIES:
            raise SpecError(owner, "id_policy", self.id_policy, f"one of {_ID_POLICIES}")
        if self.null_id_policy not in _NULL_ID_POLICIES:
            raise SpecError(
                owner, "null_id_policy", self.null_id_policy, f"one of {_NULL_ID_POLICIES}"
            )
        if self.weights is not None:
            _check_name(owner, "weights", self.weights)
            if self.weights == self.column:
                raise SpecError(owner, "weights", self.weights, "a column other than the ids'")

    @property
    def source_column(self) -> str:
        """The Arrow column this feature reads (``column``, which defaults to ``name``)."""
        return self.column if self.column is not None else self.name


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketizedFeature:
    """A numeric column turned into a single-id feature: the id of value ``x`` is the number of
    ``boundaries`` that are ``<= x`` (so ``num_embeddings == len(boundaries) + 1``). A null value
    gives an empty list; NaN is a bad value; ±inf land in the first or last bucket."""

    name: str
    source_column: str
    boundaries: tuple[float, ...]

    def __post_init__(self) -> None:
        owner = "BucketizedFeature"
        _check_name(owner, "name", self.name)
        _check_name(owner, "source_column", self.source_column)
        try:
            bounds = tuple(float(b) for b in self.boundaries)
        except (TypeError, ValueError):
            raise SpecError(owner, "boundaries", self.boundaries, "a sequence of floats") from None
        ok = len(bounds) >= 1 and all(math.isfinite(b) for b in bounds)
        if not ok or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise SpecError(
                owner, "boundaries", self.boundaries, "non-empty, finite and strictly increasing"
            )
        object.__setattr__(self, "boundaries", bounds)  # accept lists; store a hashable tuple

    @property
    def num_embeddings(self) -> int:
        return len(self.boundaries) + 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class CategoricalFeature:
    """A column of categories turned into ids: strings, or integers used as categories (their
    decimal text), one per row or a list per row (a null value or list is an empty list).

    - ``encoding="vocabulary"``: the value at index ``i`` of ``vocabulary`` gets id ``i + 1``;
      id 0 stands for every value not in it (out of vocabulary). So ``vocabulary`` holds at
      most ``num_embeddings - 1`` values.
    - ``encoding="hash"``: the first 8 bytes of the BLAKE2b hash of the value's UTF-8 text,
      modulo ``num_embeddings``: the same in every process and run, no vocabulary to keep.
    - ``encoding="hash64"``: the same hash as a signed int64, not folded: a raw id for a table
      with managed ids (docs/managed_ids.md).
    """

    name: str
    column: str | None = None
    num_embeddings: int
    encoding: Encoding = "hash"
    vocabulary: tuple[str, ...] | None = dataclasses.field(default=None, hash=False)
    # A digest of the vocabulary: hashing a spec (which the conversion caches by) stays cheap.
    vocabulary_sha256: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        owner = "CategoricalFeature"
        _check_name(owner, "name", self.name)
        if self.column is None:
            object.__setattr__(self, "column", self.name)
        _check_name(owner, "column", self.column)
        n = self.num_embeddings
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise SpecError(owner, "num_embeddings", n, "an int >= 1")
        object.__setattr__(self, "num_embeddings", int(n))
        if self.encoding not in ("vocabulary", "hash", "hash64"):
            raise SpecError(owner, "encoding", self.encoding, "'vocabulary', 'hash' or 'hash64'")
        if self.encoding != "vocabulary":
            if self.vocabulary is not None:
                raise SpecError(owner, "vocabulary", "...", f"None with encoding={self.encoding!r}")
            return
        if self.vocabulary is None or isinstance(self.vocabulary, str):
            raise SpecError(owner, "vocabulary", self.vocabulary, "a sequence of strings")
        vocabulary = tuple(self.vocabulary)
        if not all(isinstance(v, str) for v in vocabulary):
            raise SpecError(owner, "vocabulary", vocabulary[:5], "a sequence of strings")
        if len(vocabulary) > n - 1:
            raise SpecError(
                owner,
                "vocabulary",
                f"{len(vocabulary)} values",
                f"at most num_embeddings - 1 = {n - 1} values (id 0 is out of vocabulary)",
            )
        if len(set(vocabulary)) != len(vocabulary):
            raise SpecError(owner, "vocabulary", "...", "free of duplicates")
        object.__setattr__(self, "vocabulary", vocabulary)
        digest = hashlib.sha256("\0".join(vocabulary).encode()).hexdigest()
        object.__setattr__(self, "vocabulary_sha256", digest)

    def __hash__(self) -> int:
        return hash(
            (self.name, self.column, self.num_embeddings, self.encoding, self.vocabulary_sha256)
        )

    @property
    def source_column(self) -> str:
        return self.column if self.column is not None else self.name


def fit_vocabulary(counts: Mapping[str, int], *, size: int, min_count: int = 1) -> tuple[str, ...]:
    """The vocabulary of a categorical feature from its values' counts in the training data:
    the ``size`` most frequent values seen at least ``min_count`` times, most frequent first
    (ties in text order, so the result depends on the counts alone)."""
    kept = [(v, c) for v, c in counts.items() if c >= min_count]
    kept.sort(key=lambda vc: (-vc[1], vc[0]))
    return tuple(v for v, _ in kept[:size])


Feature: TypeAlias = SparseFeature | BucketizedFeature | CategoricalFeature


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureSpec:
    """The columns of a training row: ``dense`` floats (in order: ``dense_features[:, j]``),
    ``sparse`` features (in KeyedJaggedTensor key order), ``labels`` (one column gives labels of
    shape ``[B]``, several give ``[B, n]``) and an optional integer ``row_id`` column."""

    dense: tuple[str, ...]
    sparse: tuple[Feature, ...]
    labels: tuple[str, ...] = ("label",)
    row_id: str | None = None

    def __post_init__(self) -> None:
        owner = "FeatureSpec"
        for field in ("dense", "sparse", "labels"):
            value = getattr(self, field)
            if isinstance(value, str) or not isinstance(value, Sequence):
                raise SpecError(owner, field, value, "a tuple")
            object.__setattr__(self, field, tuple(value))
        for name in self.dense:
            _check_name(owner, "dense", name)
        for name in self.labels:
            _check_name(owner, "labels", name)
        for feature in self.sparse:
            if not isinstance(feature, SparseFeature | BucketizedFeature | CategoricalFeature):
                raise SpecError(
                    owner,
                    "sparse",
                    feature,
                    "SparseFeature, BucketizedFeature or CategoricalFeature",
                )
        if not self.sparse:
            raise SpecError(owner, "sparse", self.sparse, "non-empty")
        if not self.labels:
            raise SpecError(owner, "labels", self.labels, "non-empty")
        if self.row_id is not None:
            _check_name(owner, "row_id", self.row_id)
        _check_unique(owner, "dense", self.dense)
        _check_unique(owner, "sparse", self.sparse_names)
        _check_unique(owner, "labels", self.labels)
        self.expected_types()  # raises if one column is asked to be two different kinds

    @property
    def sparse_names(self) -> tuple[str, ...]:
        """The KeyedJaggedTensor keys, in order."""
        return tuple(f.name for f in self.sparse)

    @property
    def num_dense(self) -> int:
        return len(self.dense)

    @property
    def is_weighted(self) -> bool:
        """Whether batches carry id weights (weight 1 for the features without a column)."""
        return any(isinstance(f, SparseFeature) and f.weights is not None for f in self.sparse)

    @property
    def num_embeddings(self) -> tuple[int, ...]:
        """The id range of each sparse feature, in key order."""
        return tuple(f.num_embeddings for f in self.sparse)

    def required_columns(self) -> tuple[str, ...]:
        """Every column the conversion reads, each once, in first-use order."""
        return tuple(self.expected_types())

    def expected_types(self) -> dict[str, ColumnKind]:
        """Column name -> the kind of Arrow type it must have (see :data:`ColumnKind`)."""
        kinds: dict[str, ColumnKind] = {}

        def need(column: str, kind: ColumnKind, field: str) -> None:
            old = kinds.setdefault(column, kind)
            if old != kind:
                raise SpecError(
                    "FeatureSpec", field, column, f"used as one kind only (both {old} and {kind})"
                )

        for name in self.dense:
            need(name, "numeric", "dense")
        for f in self.sparse:
            if isinstance(f, SparseFeature):
                need(f.source_column, "ids", "sparse")
                if f.weights is not None:
                    need(f.weights, "weights", "sparse")
            elif isinstance(f, CategoricalFeature):
                need(f.source_column, "categories", "sparse")
            else:
                need(f.source_column, "numeric", "sparse")
        for name in self.labels:
            need(name, "numeric", "labels")
        if self.row_id is not None:
            need(self.row_id, "integer", "row_id")
        return kinds


def criteo_spec(
    num_embeddings: int | Sequence[int] = 10_000,
    *,
    id_policy: IdPolicy = "strict",
    row_id: str | None = "row_id",
) -> FeatureSpec:
    """Criteo's layout: dense ``dense_0..12``, sparse ``cat_0..25``, ``label`` and ``row_id``."""
    sizes = [num_embeddings] * 26 if isinstance(num_embeddings, int) else list(num_embeddings)
    if len(sizes) != 26:
        raise SpecError("criteo_spec", "num_embeddings", num_embeddings, "an int or 26 ints")
    return FeatureSpec(
        dense=tuple(f"dense_{i}" for i in range(13)),
        sparse=tuple(
            SparseFeature(name=f"cat_{i}", num_embeddings=n, id_policy=id_policy)
            for i, n in enumerate(sizes)
        ),
        labels=("label",),
        row_id=row_id,
    )


def parquet_layout(
    sparse: Sequence[tuple[str, int]],
    *,
    num_dense: int,
    id_policy: IdPolicy = "strict",
    weights: Mapping[str, str] | None = None,
) -> FeatureSpec:
    """raytrec's Parquet layout (``data.source="parquet"``): dense ``dense_0 ..
    dense_{num_dense-1}``, one id-list column per ``(feature, num_embeddings)`` named like the
    feature (with its weights column ``weights[feature]``, for a weighted feature), ``label``
    and ``row_id``."""
    weights = weights or {}
    return FeatureSpec(
        dense=tuple(f"dense_{j}" for j in range(num_dense)),
        sparse=tuple(
            SparseFeature(
                name=name, num_embeddings=n, id_policy=id_policy, weights=weights.get(name)
            )
            for name, n in sparse
        ),
        labels=("label",),
        row_id="row_id",
    )
