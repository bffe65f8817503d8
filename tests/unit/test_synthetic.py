from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
import torch

from raytrec.data.source import Batch
from raytrec.data.synthetic import SyntheticCriteo, SyntheticShard

SOURCE = SyntheticCriteo()


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Rank-based (Mann-Whitney) AUC with average ranks for ties."""
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based average rank of each value
    ranks = avg_rank[inverse]
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def assert_batches_equal(a: Batch, b: Batch) -> None:
    assert torch.equal(a.dense_features, b.dense_features)
    assert torch.equal(a.labels, b.labels)
    assert a.sparse_features.keys() == b.sparse_features.keys()
    assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())


def test_auc_helper() -> None:
    assert auc(np.array([0.1, 0.2, 0.3, 0.4]), np.array([0, 0, 1, 1])) == 1.0
    assert auc(np.array([0.4, 0.3, 0.2, 0.1]), np.array([0, 0, 1, 1])) == 0.0
    assert auc(np.array([0.5, 0.5, 0.5, 0.5]), np.array([0, 1, 0, 1])) == 0.5


def test_shapes_dtypes_and_keys() -> None:
    b = 4096
    batch = SOURCE.make_batch(0, 0, b)
    assert batch.dense_features.shape == (b, 13)
    assert batch.dense_features.dtype == torch.float32
    assert torch.isfinite(batch.dense_features).all()
    # Standardized: roughly zero mean and unit scale per feature.
    assert batch.dense_features.mean(0).abs().max() < 0.2
    assert ((batch.dense_features.std(0) - 1.0).abs() < 0.2).all()
    assert batch.labels.shape == (b,) and batch.labels.dtype == torch.float32
    assert set(batch.labels.unique().tolist()) == {0.0, 1.0}

    kjt = batch.sparse_features
    assert kjt.keys() == [f"cat_{i}" for i in range(26)]
    assert list(SOURCE.sparse_features) == kjt.keys() and SOURCE.dense_features == 13
    assert kjt.values().dtype == torch.int64
    lengths = kjt.lengths()
    assert lengths.shape == (26 * b,)
    assert int(lengths.sum()) == kjt.values().numel()
    assert int(lengths.max()) <= SOURCE.max_length and int(lengths.min()) == 0
    empty = (lengths == 0).double().mean().item()
    assert abs(empty - SOURCE.empty_fraction) < 0.01
    # Non-empty lists: 1 + Poisson(1) clipped at 8, mean ~2.
    assert abs(lengths[lengths > 0].double().mean().item() - 2.0) < 0.05
    for jt in kjt.to_dict().values():
        assert len(jt.lengths()) == b
        assert int(jt.values().min()) >= 0 and int(jt.values().max()) < 10_000


def test_determinism_and_start_step() -> None:
    shard = SOURCE.split(3)[1]
    assert isinstance(shard, SyntheticShard) and (shard.index, shard.num_shards) == (1, 3)
    assert_batches_equal(next(shard.batches(256)), next(shard.batches(256)))
    # A fresh, equal source (no cached state) produces the same bytes.
    assert_batches_equal(SyntheticCriteo().make_batch(1, 0, 256), next(shard.batches(256)))
    sixth = next(itertools.islice(shard.batches(256), 5, None))
    assert_batches_equal(next(shard.batches(256, start_step=5)), sixth)
    restored = pickle.loads(pickle.dumps(shard))
    assert_batches_equal(next(restored.batches(256, start_step=5)), sixth)

    first, second = itertools.islice(shard.batches(256), 2)
    assert not torch.equal(first.dense_features, second.dense_features)
    other = next(SOURCE.split(3)[0].batches(256))
    assert not torch.equal(other.dense_features, first.dense_features)
    assert not torch.equal(
        other.sparse_features.values()[:100], first.sparse_features.values()[:100]
    )
    reseeded = next(SyntheticCriteo(seed=1).split(3)[1].batches(256))
    assert not torch.equal(reseeded.dense_features, first.dense_features)


def test_ids_follow_a_power_law() -> None:
    ids = SOURCE.make_batch(0, 0, 8192).sparse_features["cat_0"].values().numpy()
    counts = np.sort(np.bincount(ids, minlength=10_000))[::-1]
    top_share = counts[:100].sum() / counts.sum()  # the most frequent 1% of the ids
    assert top_share > 0.4
    assert counts[0] > counts[10] > counts[1000]  # a long, decreasing tail is populated too
    assert (counts > 0).sum() > 1000


def test_teacher_is_consistent_and_learnable() -> None:
    batches = list(itertools.islice(SOURCE.split(2)[1].batches(1024), 50))
    labels = torch.cat([b.labels for b in batches]).numpy()
    logits = torch.cat([SOURCE.teacher_logits(b) for b in batches]).numpy()
    assert logits.dtype == np.float32 and logits.shape == labels.shape
    click_rate = labels.mean()
    assert 0.15 <= click_rate <= 0.45
    # Labels were drawn from sigmoid(teacher): calibrated on average and within bins of p.
    p = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    assert abs(click_rate - p.mean()) < 0.01
    bins = np.digitize(p, [0.1, 0.3, 0.6])
    for k in range(4):
        assert abs(labels[bins == k].mean() - p[bins == k].mean()) < 0.03
    assert auc(logits, labels) > 0.7
    # The teacher depends on the seed only, not on the shard.
    assert (
        SyntheticCriteo(seed=0).teacher_logits(batches[0]).equal(SOURCE.teacher_logits(batches[0]))
    )
    assert (
        not SyntheticCriteo(seed=1)
        .teacher_logits(batches[0])
        .equal(torch.from_numpy(logits[:1024]))
    )


def test_per_feature_num_embeddings() -> None:
    sizes = tuple(range(1, 27))
    source = SyntheticCriteo(num_embeddings=sizes, empty_fraction=0.0)
    assert source.embedding_sizes == sizes
    for i, jt in enumerate(source.make_batch(0, 0, 2048).sparse_features.to_dict().values()):
        seen = set(jt.values().tolist())
        assert seen == set(range(sizes[i]))  # within [0, n_f) and, at this batch size, all of it


def test_small_shapes() -> None:
    source = SyntheticCriteo(num_dense=1, num_sparse=2, max_length=1, mean_length=1.0)
    batch = source.make_batch(0, 0, 64)
    assert batch.dense_features.shape == (64, 1) and batch.sparse_features.keys() == [
        "cat_0",
        "cat_1",
    ]
    assert set(batch.sparse_features.lengths().tolist()) == {0, 1}
    assert source.teacher_logits(batch).shape == (64,)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_dense": 0}, "num_dense"),
        ({"num_sparse": -1}, "num_sparse"),
        ({"num_embeddings": 0}, "num_embeddings"),
        ({"num_embeddings": (10, 10)}, r"num_embeddings must be of length 26"),
        ({"num_embeddings": (10,) * 25 + (0,)}, "num_embeddings"),
        ({"zipf_alpha": 1.0}, r"zipf_alpha must be > 1, got 1.0"),
        ({"mean_length": 0.5}, "mean_length"),
        ({"max_length": 0}, "max_length"),
        ({"empty_fraction": 1.0}, r"empty_fraction must be in \[0, 1\), got 1.0"),
        ({"empty_fraction": -0.1}, "empty_fraction"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_configs_raise(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SyntheticCriteo(**kwargs)  # type: ignore[arg-type]


def test_bad_split_and_batch_arguments() -> None:
    with pytest.raises(ValueError, match="num_shards"):
        SOURCE.split(0)
    with pytest.raises(ValueError, match="index"):
        SyntheticShard(source=SOURCE, index=2, num_shards=2)
    shard = SOURCE.split(1)[0]
    with pytest.raises(ValueError, match="batch_size"):
        shard.batches(0)
    with pytest.raises(ValueError, match="start_step"):
        shard.batches(8, start_step=-1)
    wrong_keys = SyntheticCriteo(feature_prefix="c").make_batch(0, 0, 4)
    with pytest.raises(ValueError, match="sparse keys"):
        SOURCE.teacher_logits(wrong_keys)
