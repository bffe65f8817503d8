"""Managed ids (raytrec.engine.managed_ids): decisions checked against a plain-Python model of
LRU/LFU admission with the documented tie-breaks, and identical on every rank given the same
merged observations whatever their order."""

from __future__ import annotations

import random

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from raytrec.config import ConfigError, IdsConfig, ModelConfig, TableConfig
from raytrec.engine.managed_ids import FREE, ManagedIds, ManagedTable, coalesce, gather_ragged


def table(budget: int, eviction: str, name: str = "t") -> TableConfig:
    return TableConfig(
        name=name,
        num_embeddings=budget + 3,
        embedding_dim=4,
        features=(f"f_{name}",),
        ids=IdsConfig(policy="managed", budget=budget, eviction=eviction),  # type: ignore[arg-type]
    )


class Reference:
    """What the map should hold after each decision, in plain Python: ``budget - 1`` slots
    (the last row is the default row). A decision ranks the live ids (by raw id) and then the
    new ids (most frequent first, then smaller id) by score, the higher kept, a tie to the one
    ranked first; LFU's score is the count since admission, LRU's the last step seen."""

    def __init__(self, budget: int, eviction: str) -> None:
        self.slots = budget - 1
        self.lru = eviction == "lru"
        self.score: dict[int, int] = {}  # live raw id -> count (lfu) or last step (lru)

    def apply(self, seen: dict[int, tuple[int, int]]) -> None:
        """``seen``: raw id -> (count, last step) merged over the job."""
        for i, (count, last) in seen.items():
            if i in self.score:
                self.score[i] = last if self.lru else self.score[i] + count
        new = sorted((i for i in seen if i not in self.score), key=lambda i: (-seen[i][0], i))
        ranked = [(self.score[i], i) for i in sorted(self.score)]
        ranked += [(seen[i][1] if self.lru else seen[i][0], i) for i in new]
        order = sorted(range(len(ranked)), key=lambda k: -ranked[k][0])  # stable
        kept = {ranked[k][1]: ranked[k][0] for k in order[: self.slots]}
        self.score = kept


def merged_rows(seen: dict[int, tuple[int, int]], index: int = 0) -> torch.Tensor:
    return torch.tensor(
        [[index, i, c, last] for i, (c, last) in sorted(seen.items())], dtype=torch.int64
    ).reshape(-1, 4)


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("seed", range(6))
def test_decisions_match_the_reference(eviction: str, seed: int) -> None:
    rng = random.Random(seed)
    budget = rng.choice([2, 5, 9, 17])
    managed = ManagedTable(table(budget, eviction), 0)
    ref = Reference(budget, eviction)
    universe = [rng.randrange(-(2**62), 2**62) for _ in range(40)]
    for step in range(1, 30):
        # Drifting ids: a window of the universe, with ties in counts on purpose.
        window = universe[step % 25 : step % 25 + rng.randint(1, 15)]
        seen = {i: (rng.randint(1, 3), max(1, step - rng.randint(0, 2))) for i in window}
        before = managed.row_ids()
        renewed = managed.apply(merged_rows(seen), step)
        ref.apply(seen)
        after = managed.row_ids()
        live = {int(i) for i in after if int(i) != FREE}
        assert live == set(ref.score), (step, sorted(live ^ set(ref.score)))
        # Live ids keep their rows; new ids take rows that were renewed; nothing on the default
        # row; no two ids on one row (row_ids is one id per row by construction).
        assert int(after[budget - 1]) == FREE
        for row in range(budget):
            old, new = int(before[row]), int(after[row])
            if new != FREE and new != old:
                assert row in renewed.tolist()
            if old != FREE and old in live:
                assert new == old, "a live id moved"
        # Every id reads its row, every other id the default row.
        ids = torch.tensor([*sorted(live), universe[-1] + 1], dtype=torch.int64)
        rows = managed.lookup(ids).tolist()
        assert rows[-1] == budget - 1
        assert [int(after[r]) for r in rows[:-1]] == sorted(live)


def test_same_merged_input_same_decision_in_any_order() -> None:
    """Two ranks' observations, gathered in either order, give one map."""
    rng = random.Random(7)
    a, b = ManagedTable(table(6, "lru"), 0), ManagedTable(table(6, "lru"), 0)
    for step in range(1, 12):
        obs = [torch.tensor([[0, rng.randrange(50), rng.randint(1, 4), step]]) for _ in range(20)]
        shuffled = list(obs)
        rng.shuffle(shuffled)
        ra = a.apply(coalesce(torch.cat(obs)), step)
        rb = b.apply(coalesce(torch.cat(shuffled)), step)
        assert torch.equal(ra, rb)
        for x, y in zip(a.state(), b.state(), strict=True):
            assert torch.equal(x, y)


def test_coalesce_sums_counts_and_keeps_the_last_step() -> None:
    obs = torch.tensor([[0, 5, 1, 3], [1, 5, 2, 4], [0, 5, 2, 7], [0, 2, 1, 1]])
    assert coalesce(obs).tolist() == [[0, 2, 1, 1], [0, 5, 3, 7], [1, 5, 2, 4]]


def test_gather_ragged_pads_and_concatenates() -> None:
    """Member 0 holds one row, member 1 two: both are padded to two, then cut back."""
    other = torch.tensor([[3, 4], [5, 6]])

    def gather(t: torch.Tensor) -> torch.Tensor:
        if t.shape == (1,):
            return torch.stack([t, torch.tensor([2])])
        return torch.stack([t, other])

    got = gather_ragged(torch.tensor([[1, 2]]), gather, torch.device("cpu"))
    assert got.tolist() == [[1, 2], [3, 4], [5, 6]]


def test_remap_observes_training_and_not_scoring() -> None:
    model = ModelConfig(
        arch="deepfm",
        tables=(
            table(4, "lfu", "a"),
            TableConfig(name="b", num_embeddings=9, embedding_dim=4, features=("f_b",)),
        ),
        dense_arch_layers=(4,),
    )
    ids = ManagedIds.for_model(model)
    assert ids is not None and list(ids.tables) == ["a"]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f_a", "f_b"],
        values=torch.tensor([10**15, 7, 10**15, 3, 8]),
        lengths=torch.tensor([2, 1, 1, 1]),
    )
    out = ids.remap(kjt, step=1)
    assert out.values().tolist() == [3, 3, 3, 3, 8]  # nothing admitted: the default row
    ids.remap(kjt, step=None)  # scoring: not counted
    outcome = ids.merge(1, [])
    assert outcome.renewed["a"].numel() == 2
    out = ids.remap(kjt, step=None).values().tolist()
    assert out[4] == 8 and out[3] == 3  # the fixed table is untouched
    assert out[0] == out[2] != out[1] and 3 not in out[:3]
    assert ids.tables["a"].take_observed().numel() == 0


def test_budget_is_checked() -> None:
    with pytest.raises(ConfigError, match="budget"):
        TableConfig(
            name="t",
            num_embeddings=4,
            embedding_dim=4,
            features=("f",),
            ids={"policy": "managed", "budget": 5},
        )
    assert ModelConfig().tables[0].ids.policy == "fixed"
    assert ManagedIds.for_model(ModelConfig()) is None


def test_serving_maps_read_like_training() -> None:
    """The served model's lookup (raytrec.serving.raw_ids) gives the rows TorchRec's remap
    gives in training, hits and misses alike."""
    from raytrec.serving.raw_ids import IdMaps

    config = table(7, "lru")
    managed = ManagedTable(config, 0)
    rng = random.Random(3)
    for step in range(1, 6):
        seen = {rng.randrange(-(10**12), 10**12): (1, step) for _ in range(4)}
        managed.apply(merged_rows(seen), step)
    maps = IdMaps(ModelConfig(arch="deepfm", tables=(config,), dense_arch_layers=(4,)))
    state = managed.state()
    maps.load_state_dict({"t.sorted_raw_ids": state[0], "t.rows": state[1]})
    live = [int(i) for i in managed.row_ids() if int(i) != FREE]
    probe = torch.tensor(live + [rng.randrange(-(10**12), 10**12) for _ in range(20)])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f_t"], values=probe, lengths=torch.ones(len(probe), dtype=torch.int32)
    )
    assert torch.equal(maps.remap(kjt).values(), managed.lookup(probe))
    assert sorted(maps.remap(kjt).values()[: len(live)].tolist()) == sorted(
        r for r, i in enumerate(managed.row_ids().tolist()) if i != FREE
    )


def test_raw_ids_and_64_bit_hashes_pass_through_the_conversion() -> None:
    import pyarrow as pa

    from raytrec.data.arrow_kjt import category_id, to_batch
    from raytrec.data.spec import CategoricalFeature, FeatureSpec, SparseFeature

    spec = FeatureSpec(
        dense=(),
        sparse=(
            SparseFeature(name="a", num_embeddings=4, id_policy="raw"),
            CategoricalFeature(name="b", num_embeddings=4, encoding="hash64"),
        ),
        labels=("label",),
        row_id=None,
    )
    rows = pa.table(
        {
            "a": pa.array([[-(2**62), 7], [2**40]], pa.list_(pa.int64())),
            "b": pa.array(["x", "y"]),
            "label": pa.array([0.0, 1.0], pa.float32()),
        }
    )
    batch, _ = to_batch(rows, spec)
    hashes = [category_id(v, spec.sparse[1]) for v in ("x", "y")]  # type: ignore[arg-type]
    assert batch.sparse_features.values().tolist() == [-(2**62), 7, 2**40, *hashes]
    assert any(abs(h) >= 4 for h in hashes)  # not folded into the table's rows


def test_publishing_deltas_is_refused_with_managed_ids() -> None:
    from raytrec.config import PublishConfig, TrainConfig

    tables = (table(8, "lru", "a"),)
    model = ModelConfig(arch="deepfm", tables=tables, dense_arch_layers=(4,))
    TrainConfig(model=model)
    with pytest.raises(ConfigError, match="managed ids"):
        TrainConfig(model=model, publish=PublishConfig(every_n_steps=4))


def test_fresh_rows_are_the_same_whoever_draws_them() -> None:
    """A renewed row's weights depend on (seed, table, version, row, column) only: drawn with
    other rows or alone, by any rank, the same; within TorchRec's initial range."""
    from raytrec.engine.managed_rows import fresh_rows

    both = fresh_rows(7, "t", 12, torch.tensor([3, 5]), (100, 8))
    alone = fresh_rows(7, "t", 12, torch.tensor([5]), (100, 8))
    assert torch.equal(both[1], alone[0])
    assert not torch.equal(both[0], both[1])
    assert not torch.equal(alone, fresh_rows(7, "t", 14, torch.tensor([5]), (100, 8)))
    assert not torch.equal(alone, fresh_rows(7, "u", 12, torch.tensor([5]), (100, 8)))
    assert float(both.abs().max()) <= 0.1 and float(both.abs().max()) > 0.01
