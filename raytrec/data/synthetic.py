"""A deterministic, Criteo-like synthetic data source with a planted teacher model.

Rows look like Criteo's: ``num_dense`` heavy-tailed non-negative values (log1p-transformed and
standardized) and ``num_sparse`` variable-length id lists whose ids follow a truncated power law.
Labels are drawn from a fixed logistic "teacher" (a dense weight vector plus a hashed per-(feature,
id) bias), so they are learnable and :meth:`SyntheticCriteo.teacher_logits` gives the oracle score
against which a trained model's AUC can be judged.

Batch ``s`` of shard ``r`` comes from ``np.random.default_rng([seed, r, s])`` alone, so any batch
can be regenerated without replaying the stream (e.g. on resume from a checkpoint at step ``s``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from raytrec.data.source import Batch, BatchShard, BatchSource

__all__ = [
    "SyntheticCriteo",
    "SyntheticShard",
    "batch_id",
    "click_rate_intercept",
    "require",
    "split_batch_id",
]

_TARGET_CLICK_RATE = 0.25  # Criteo's click rate is ~25.6%.
_DENSE_LOGIT_STD = 0.8  # spread of the dense part of the teacher logit
_SPARSE_LOGIT_STD = 1.4  # per-id bias spread, summed over all features
_CALIBRATION_ROWS = 16_384
_DENSE_LOG_STD = 1.5  # spread of log(raw dense value): heavy-tailed, like Criteo's counts
_U64 = np.uint64


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorized splitmix64 finalizer; uint64 arithmetic wraps, which is what the hash wants."""
    z = x + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def _hash_normal(h: np.ndarray) -> np.ndarray:
    """Maps uint64 hashes to ~N(0, 1): the sum of their four 16-bit words (Irwin-Hall, n=4)."""
    words = np.ascontiguousarray(h).view(np.uint16).reshape(-1, 4).astype(np.float64)
    return ((words @ np.ones(4) + 2.0) / 65536.0 - 2.0) * math.sqrt(3.0)  # matmul: fast row sum


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free form


def click_rate_intercept(logits: np.ndarray, rate: float = _TARGET_CLICK_RATE) -> float:
    """The intercept that makes the mean of ``sigmoid(logits + b)`` ``rate`` (Newton's method)."""
    b = 0.0
    for _ in range(20):
        p = _sigmoid(logits + b)
        b -= (p.mean() - rate) / max(float((p * (1.0 - p)).mean()), 1e-6)
    return float(b)


def require(owner: object, field: str, ok: bool, allowed: str) -> None:
    """Raises ValueError naming ``owner``'s class and ``field`` unless ``ok``."""
    if not ok:
        value = getattr(owner, field)
        raise ValueError(f"{type(owner).__name__}.{field} must be {allowed}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class _Params:
    """Per-source constants: the feature laws and the teacher (which depends on seed only)."""

    dense_loc: np.ndarray  # log-scale location of each raw dense value
    dense_mean: np.ndarray  # mean and std of log1p(raw), to standardize it
    dense_std: np.ndarray
    length_cdf: np.ndarray  # P(length <= k) for k in [0, max_length), only the entries < 1
    id_mass: np.ndarray  # [F] float64: 1 - (n_f + 1)^(1 - alpha), see _features
    id_max: np.ndarray  # [F] int64: n_f - 1
    weight: np.ndarray  # [num_dense] float64
    salts: np.ndarray  # [num_sparse] uint64, one hash salt per feature
    bias_std: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticCriteo(BatchSource):
    """Criteo-like rows with labels drawn from a planted logistic teacher; see the module doc."""

    num_dense: int = 13
    num_sparse: int = 26
    num_embeddings: int | tuple[int, ...] = 10_000  # id range per sparse feature (or one each)
    zipf_alpha: float = 1.1  # power-law exponent of id popularity; id 0 is the most popular
    mean_length: float = 2.0  # mean length of the non-empty lists (before clipping)
    max_length: int = 8
    empty_fraction: float = 0.1  # probability that a (row, feature) list is empty
    seed: int = 0
    feature_prefix: str = "cat_"

    def __post_init__(self) -> None:
        check = functools.partial(require, self)
        check("num_dense", self.num_dense >= 1, ">= 1")
        check("num_sparse", self.num_sparse >= 1, ">= 1")
        n = self.num_embeddings
        if isinstance(n, tuple):
            check("num_embeddings", len(n) == self.num_sparse, f"of length {self.num_sparse}")
        sizes = n if isinstance(n, tuple) else (n,)
        check("num_embeddings", all(int(v) >= 1 for v in sizes), "positive")
        check("zipf_alpha", self.zipf_alpha > 1.0, "> 1")
        check("mean_length", self.mean_length >= 1.0, ">= 1")
        check("max_length", self.max_length >= 1, ">= 1")
        check("empty_fraction", 0.0 <= self.empty_fraction < 1.0, "in [0, 1)")
        check("seed", self.seed >= 0, ">= 0")

    @property
    def dense_features(self) -> int:
        return self.num_dense

    @property
    def sparse_features(self) -> tuple[str, ...]:
        return tuple(f"{self.feature_prefix}{i}" for i in range(self.num_sparse))

    @property
    def embedding_sizes(self) -> tuple[int, ...]:
        """The id range ``n_f`` of each sparse feature, in key order."""
        n = self.num_embeddings
        return tuple(int(v) for v in n) if isinstance(n, tuple) else (int(n),) * self.num_sparse

    def shard(self, index: int) -> SyntheticShard:
        """The stream of shard ``index`` alone (a rank that joins later gets a fresh index)."""
        return SyntheticShard(source=self, index=index, num_shards=index + 1)

    def split(self, num_shards: int) -> list[BatchShard]:
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards!r}")
        return [
            SyntheticShard(source=self, index=r, num_shards=num_shards) for r in range(num_shards)
        ]

    def teacher_logits(self, batch: Batch) -> torch.Tensor:
        """The planted model's logit (float32, ``[B]``) for each row of a batch from this source."""
        kjt = batch.sparse_features
        if list(kjt.keys()) != list(self.sparse_features):
            raise ValueError(f"batch has sparse keys {kjt.keys()}, expected {self.sparse_features}")
        dense = batch.dense_features.detach().cpu().numpy()
        values = kjt.values().detach().cpu().numpy().astype(np.int64, copy=False)
        lengths = kjt.lengths().detach().cpu().numpy().astype(np.int64, copy=False)
        logits = self._logits(dense, lengths.reshape(self.num_sparse, -1), values) + self._intercept
        return torch.from_numpy(logits.astype(np.float32))

    def make_batch(self, shard: int, step: int, batch_size: int) -> Batch:
        """Batch ``step`` of shard ``shard``: a pure function of ``(seed, shard, step)``."""
        rng = np.random.default_rng([self.seed, shard, step])
        dense, lengths, values = self._features(rng, batch_size)
        p = _sigmoid(self._logits(dense, lengths, values) + self._intercept)
        labels = (rng.random(batch_size) < p).astype(np.float32)
        kjt = KeyedJaggedTensor(
            keys=list(self.sparse_features),
            values=torch.from_numpy(values),
            lengths=torch.from_numpy(lengths.reshape(-1).astype(np.int32)),
            stride=batch_size,
        )
        return Batch(
            dense_features=torch.from_numpy(dense),
            sparse_features=kjt,
            labels=torch.from_numpy(labels),
        )

    def _features(
        self, rng: np.random.Generator, rows: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Dense ``[rows, D]`` float32, lengths ``[F, rows]`` int64, key-major int64 ids."""
        t = self._params
        # Raw values are log-normal (heavy-tailed counts); log1p(exp(x)) == logaddexp(0, x).
        raw_log = t.dense_loc + _DENSE_LOG_STD * rng.standard_normal((rows, self.num_dense))
        dense = ((np.logaddexp(0.0, raw_log) - t.dense_mean) / t.dense_std).astype(np.float32)

        # Lengths by inverse CDF from one uniform each: several times faster than rng.poisson plus
        # an empty mask, and than np.searchsorted for these few thresholds.
        u = rng.random((self.num_sparse, rows))
        lengths = np.zeros(u.shape, dtype=np.int64)
        for c in t.length_cdf:
            lengths += u >= c

        # Inverse CDF of a power law x^-alpha on [1, n+1), floored: id k has mass ~ (k+1)^-alpha.
        # x >= 1 always; only float round-off as u -> 1 can reach n + 1, hence the upper clip.
        per_feature = lengths.sum(axis=1)
        u = rng.random(int(per_feature.sum()))
        x = (1.0 - u * np.repeat(t.id_mass, per_feature)) ** (1.0 / (1.0 - self.zipf_alpha))
        values = np.minimum(x.astype(np.int64) - 1, np.repeat(t.id_max, per_feature))
        return dense, lengths, values

    def _logits(self, dense: np.ndarray, lengths: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Teacher logits less intercept (float64 ``[B]``) from dense, ``[F, B]`` lengths, ids."""
        t = self._params
        num_lists = lengths.size
        feature = np.repeat(np.arange(self.num_sparse), lengths.sum(axis=1))
        bias = _hash_normal(_splitmix64(values.astype(_U64) ^ t.salts[feature])) * t.bias_std
        # Each list contributes the mean bias of its ids (0 when empty).
        segment = np.repeat(np.arange(num_lists), lengths.reshape(-1))
        sums = np.bincount(segment, weights=bias, minlength=num_lists).reshape(lengths.shape)
        sparse = (sums / np.maximum(lengths, 1)).sum(axis=0)
        return dense.astype(np.float64) @ t.weight + sparse

    @functools.cached_property
    def _params(self) -> _Params:
        # Lengths: 0 w.p. empty_fraction, else 1 + Poisson(mean_length - 1) clipped to max_length.
        lam, e = self.mean_length - 1.0, self.empty_fraction
        steps = np.r_[1.0, lam / np.arange(1, self.max_length)]
        pmf = np.exp(-lam) * np.cumprod(steps)[: self.max_length - 1]  # Poisson(lam) at 0..max-2
        length_cdf = np.r_[e, e + (1.0 - e) * np.cumsum(pmf)]
        length_cdf = length_cdf[length_cdf < 1.0]  # u < 1 never reaches these; bounds the loop
        sizes = np.asarray(self.embedding_sizes, dtype=np.float64)
        id_mass = 1.0 - (sizes + 1.0) ** (1.0 - self.zipf_alpha)

        # The teacher is fixed by seed alone. The 4th seed word is nonzero so its random draws never
        # coincide with a shard's [seed, r, s] (SeedSequence treats trailing zeros as absent).
        rng = np.random.default_rng([self.seed, 0, 0, 1])
        loc = np.linspace(-1.0, 4.0, self.num_dense)
        # Exact mean/std of log1p(lognormal) by Gauss-Hermite quadrature.
        nodes, weights = np.polynomial.hermite_e.hermegauss(64)
        f = np.logaddexp(0.0, loc[:, None] + _DENSE_LOG_STD * nodes[None, :])
        weights = weights / weights.sum()
        mean = f @ weights
        std = np.sqrt(((f - mean[:, None]) ** 2) @ weights)
        weight = rng.standard_normal(self.num_dense) * (
            _DENSE_LOGIT_STD / math.sqrt(self.num_dense)
        )
        salts = _splitmix64(rng.integers(0, 2**63, self.num_sparse, dtype=np.int64).astype(_U64))
        bias_std = _SPARSE_LOGIT_STD / math.sqrt(self.num_sparse)
        id_max = sizes.astype(np.int64) - 1
        return _Params(loc, mean, std, length_cdf, id_mass, id_max, weight, salts, bias_std)

    @functools.cached_property
    def _intercept(self) -> float:
        # Chosen so the expected click rate hits the target: Newton's method on a fixed sample.
        rng = np.random.default_rng([self.seed, 0, 0, 2])
        return click_rate_intercept(self._logits(*self._features(rng, _CALIBRATION_ROWS)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticShard(BatchShard):
    """Shard ``index`` of ``num_shards`` of a :class:`SyntheticCriteo` stream (picklable)."""

    source: SyntheticCriteo
    index: int
    num_shards: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.num_shards:
            raise ValueError(f"index must be in [0, {self.num_shards}), got {self.index!r}")

    def batches(self, batch_size: int, *, start_step: int = 0) -> Iterator[Batch]:
        # Validate eagerly (a generator body would only run on the first next()).
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step!r}")
        return (
            self.source.make_batch(self.index, s, batch_size) for s in itertools.count(start_step)
        )

    replayable = True

    def identified_batches(
        self, batch_size: int, *, start_step: int = 0
    ) -> Iterator[tuple[int | None, Batch]]:
        for s, batch in enumerate(self.batches(batch_size, start_step=start_step), start_step):
            yield batch_id(self.index, s), batch

    def replay(self, batch_id: int, batch_size: int) -> Batch:
        shard, step = split_batch_id(batch_id)
        return self.source.make_batch(shard, step, batch_size)


#: Batch ids of the synthetic stream: ``shard << 32 | step`` (steps below 2**32 per shard).
_STEP_BITS = 32


def batch_id(shard: int, step: int) -> int:
    if not 0 <= step < 1 << _STEP_BITS or shard < 0:
        raise ValueError(f"batch_id: shard {shard} / step {step} out of range")
    return shard << _STEP_BITS | step


def split_batch_id(value: int) -> tuple[int, int]:
    """``(shard, step)`` of a :func:`batch_id`."""
    return value >> _STEP_BITS, value & ((1 << _STEP_BITS) - 1)
