"""Every command-line shortcut of ``jobs.train`` works on the job's default data or is refused,
naming the fix, before anything starts (no Ray, no data written)."""

from __future__ import annotations

import pytest
import ray
import torch

from jobs.train import build_config
from raytrec.config import ConfigError

WORKS = [
    ["--arch", "dlrm"],
    ["--arch", "dlrm_dcn"],
    ["--arch", "deepfm"],
    ["--arch", "two_tower"],
    ["--sharding-type", "column_wise"],
    ["--embedding-optimizer", "adagrad"],
    ["--layout", "replicas_within_host"],
    ["--embedding-dim", "8"],
    ["--num-workers", "2", "--gang-size", "2"],
    ["--epochs", "2"],
    ["--batch-size", "64", "--sync-every", "2", "--log-every", "5", "--steps", "10"],
]
REFUSED = [
    (["--sharding-type", "row_wise"], "on CPU use one of 'table_wise', 'column_wise'"),
    (["--embedding-optimizer", "adam"], "on CPU use one of 'sgd', 'adagrad', 'rowwise_adagrad'"),
    (["--arch", "resnet"], "model.arch"),
    (["--gang-size", "3"], "allowed gang sizes"),
]


@pytest.mark.parametrize("argv", WORKS, ids=lambda a: " ".join(a))
def test_a_shortcut_gives_a_job_that_runs_on_the_default_data(argv: list[str]) -> None:
    config = build_config(argv)
    assert config.data.source == "generated"  # the job's own data
    if "two_tower" in argv:
        # The user tower needs features, which --arch alone cannot name: half the tables'.
        features = list(config.model.features)
        assert list(config.model.user_features) == features[: len(features) // 2]
        assert config.model.item_features


def test_two_tower_takes_the_user_features_given() -> None:
    config = build_config(["--arch", "two_tower", "--set", "model.user_features=[cat_3]"])
    assert config.model.user_features == ("cat_3",)


@pytest.mark.parametrize(("argv", "fix"), REFUSED, ids=lambda a: str(a))
def test_a_shortcut_that_cannot_run_here_is_refused_naming_the_fix(
    argv: list[str], fix: str
) -> None:
    with pytest.raises(ConfigError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        build_config(argv)


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="this machine has a GPU")
def test_gpu_without_a_gpu_or_a_cluster_is_refused_before_ray_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: str
) -> None:
    import raytrec

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():  # fit would use the cluster this process is connected to
        pytest.skip("this process is connected to a Ray cluster already")
    with pytest.raises(ConfigError, match="drop --gpu, or set RAY_ADDRESS"):
        raytrec.fit(build_config(["--gpu", "--storage-path", str(tmp_path)]))
    assert not ray.is_initialized()
