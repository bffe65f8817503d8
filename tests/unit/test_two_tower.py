"""The two-tower retrieval model: its config, its scores and losses against plain PyTorch
written out here, recall@k against a brute-force count, and its export and load."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pytest
import torch
import torch.distributed.checkpoint as dcp

from raytrec._quiet import quiet_known_warnings
from raytrec.config import ConfigError, DataConfig, ModelConfig, TableConfig, TrainConfig
from raytrec.models import build_model, build_train_model
from raytrec.models.two_tower import TwoTower, TwoTowerTrain, in_batch_softmax
from raytrec.serving.evaluate import recall_at_k
from raytrec.serving.export import export, load_exported, load_program, make_batch, score
from raytrec.serving.model_spec import ModelSpec, write_model_spec

CPU = torch.device("cpu")
TABLES = (
    TableConfig(name="t_user", num_embeddings=30, embedding_dim=4, features=("user",)),
    TableConfig(name="t_item", num_embeddings=40, embedding_dim=6, features=("item", "tag")),
)
TOWERS = ModelConfig(arch="two_tower", tables=TABLES, user_features=("user",), tower_layers=(8, 5))


def test_the_towers_are_checked() -> None:
    with pytest.raises(ConfigError, match="user_features must name some of"):
        ModelConfig(arch="two_tower", tables=TABLES)
    with pytest.raises(ConfigError, match=r"tables \['t_item'\] serve features of both towers"):
        ModelConfig(arch="two_tower", tables=TABLES, user_features=("user", "tag"))
    with pytest.raises(ConfigError, match="the item tower needs at least one"):
        ModelConfig(arch="two_tower", tables=TABLES, user_features=("user", "item", "tag"))
    with pytest.raises(ConfigError, match=r"applies to model\.arch='two_tower' only"):
        ModelConfig(tables=TABLES[:1], user_features=("user",), dense_arch_layers=(4,))
    with pytest.raises(ConfigError, match=r"model\.dropout"):
        ModelConfig(arch="two_tower", tables=TABLES, user_features=("user",), dropout=0.1)


def rows(n: int = 8, *, seed: int = 0) -> pa.Table:
    g = torch.Generator().manual_seed(seed)
    return pa.table(
        {
            "dense_0": torch.randn(n, generator=g).tolist(),
            "dense_1": torch.randn(n, generator=g).tolist(),
            "user": [[int(i)] for i in torch.randint(0, 30, (n,), generator=g)],
            "item": [[int(i)] for i in torch.randint(0, 40, (n,), generator=g)],
            "tag": [[int(i), int(i) + 1] for i in torch.randint(0, 39, (n,), generator=g)],
            "label": [float(i % 3 == 0) for i in range(n)],
            "row_id": list(range(n)),
        }
    )


CONFIG = TrainConfig(model=TOWERS, data=DataConfig(num_dense=2))


def trained(seed: int = 1) -> TwoTowerTrain:
    module = build_train_model(TOWERS, 2, CPU, 0)
    assert isinstance(module, TwoTowerTrain)
    module.model.embedding_bag_collection = build_model(
        TOWERS, 2, CPU, 0, embedding_device=CPU
    ).embedding_bag_collection  # type: ignore[assignment]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


def reference_towers(module: TwoTowerTrain, table: pa.Table) -> tuple[torch.Tensor, torch.Tensor]:
    """The towers written out: sum-pooled rows of each table, concatenated, through the MLPs."""
    m = module.model
    bags = m.embedding_bag_collection.embedding_bags
    user_w, item_w = bags["t_user"].weight, bags["t_item"].weight
    dense = torch.tensor([table["dense_0"].to_pylist(), table["dense_1"].to_pylist()]).T
    users, items = [], []
    for r in range(table.num_rows):
        u = user_w[table["user"][r].as_py()].sum(0)
        i = item_w[table["item"][r].as_py()].sum(0)
        t = item_w[table["tag"][r].as_py()].sum(0)
        users.append(torch.cat([dense[r], u]))
        items.append(torch.cat([i, t]))
    return m.user_tower(torch.stack(users)), m.item_tower(torch.stack(items))


def test_scores_and_losses_match_plain_pytorch() -> None:
    module = trained()
    table = rows()
    batch, _ = make_batch(table, ModelSpec.for_config(CONFIG, 2))
    with torch.no_grad():
        user, item = reference_towers(module, table)
        loss, (_, logits, labels) = module(batch)
        torch.testing.assert_close(logits, (user * item).sum(1), rtol=0, atol=1e-5)
        # In-batch softmax, written out: -log softmax(u_i . v_j / T over j)[i], positive rows.
        expected = []
        for i in range(table.num_rows):
            if labels[i] > 0.5:
                s = torch.tensor([float(user[i] @ item[j]) / TOWERS.temperature for j in range(8)])
                expected.append(-(s[i] - torch.logsumexp(s, 0)))
        torch.testing.assert_close(loss, torch.stack(expected).mean(), rtol=1e-5, atol=1e-5)
        module.loss = "logistic"
        loss, _ = module(batch)
        bce = [
            math.log1p(math.exp(-z)) if y else math.log1p(math.exp(z))
            for z, y in zip(logits.tolist(), labels.tolist(), strict=True)
        ]
        assert float(loss) == pytest.approx(sum(bce) / len(bce), rel=1e-5)
    # A batch without positives still reaches every parameter.
    zero = in_batch_softmax(*reference_towers(module, table), torch.zeros(8), temperature=0.1)
    assert float(zero) == 0.0 and zero.requires_grad


def test_recall_at_k_counts_the_items_ranked_above_the_own_one() -> None:
    g = torch.Generator().manual_seed(4)
    users, items = torch.randn(50, 3, generator=g), torch.randn(10, 3, generator=g)
    which = torch.randint(0, 10, (50,), generator=g)
    labels = (torch.rand(50, generator=g) > 0.4).float()
    got = recall_at_k(users, items[which], labels, ks=(1, 3, 10))
    ranks = []
    for q in range(50):
        if labels[q] > 0.5:
            own = float(users[q] @ items[which[q]])
            ranks.append(sum(float(users[q] @ items[c]) > own for c in range(10)))
    for k in (1, 3, 10):
        assert got[k] == pytest.approx(sum(r < k for r in ranks) / len(ranks))
    assert got[10] == 1.0


def test_two_tower_exports_loads_and_scores_like_the_trained_module(tmp_path: Path) -> None:
    quiet_known_warnings()
    module = trained()
    final = tmp_path / "final_model"
    dcp.save(module.state_dict(), checkpoint_id=str(final), no_dist=True)
    write_model_spec(str(final), ModelSpec.for_config(CONFIG, 2))
    info = export(str(final), tmp_path / "export")
    assert info.spec.kind == "TwoTower"
    model, loaded = load_exported(tmp_path / "export")
    assert isinstance(model, TwoTower)
    batch, _ = make_batch(rows(seed=5), loaded.spec)
    with torch.no_grad():
        want = torch.sigmoid(module.model(batch.dense_features, batch.sparse_features).double())
    torch.testing.assert_close(score(model, batch), want.reshape(-1), rtol=0, atol=1e-6)
    assert info.program is not None, info.program_error
    with torch.no_grad():
        logits = load_program(tmp_path / "export")(batch.dense_features, batch.sparse_features)
    torch.testing.assert_close(
        torch.sigmoid(logits.double()).reshape(-1), want.reshape(-1), rtol=0, atol=1e-6
    )
