"""``python -m benchmarks.pipeline`` on a CPU rank (the GPU run's own code, small).

The comparison builds each side's model anew every repeat. A side left alive into the next
repeat costs memory and, with ``--dcn``, does not fit: two DCNv2 models with 40M-row tables
need more than one GPU holds. So each side must be freed (nothing refers to its engine or its
``DistributedModelParallel``) before the next one is built.
"""

from __future__ import annotations

import gc

import pytest
from torchrec.distributed.model_parallel import DistributedModelParallel

from benchmarks import pipeline
from raytrec.engine.rank_engine import RankEngine


@pytest.fixture
def models_alive_after_free(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many rank engines and sharded models are still alive after each ``_free()``."""
    alive: list[int] = []
    free = pipeline._free

    def counted() -> None:
        free()
        kinds = (RankEngine, DistributedModelParallel)
        alive.append(sum(isinstance(o, kinds) for o in gc.get_objects()))

    monkeypatch.setattr(pipeline, "_free", counted)
    return alive


STEPS = ["--steps", "4", "--warmup-steps", "2", "--log-every", "2", "--repeats", "2"]


def test_both_sides_train_in_turns_and_are_freed_each_repeat(
    models_alive_after_free: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--batch-sizes", "32", "--model", "26x200x16", *STEPS]
    assert pipeline.main(argv) == 0
    assert models_alive_after_free == [0, 0]
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| DLRM, 32 |"))
    assert len(row.split("|")[-2].split(",")) == 2  # a ratio per repeat


def test_dcn_sides_are_built_one_at_a_time(
    models_alive_after_free: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    # Every table in HBM (none over --uvm-rows): CPU ranks refuse the UVM kernels.
    argv = ["--dcn", "--dcn-cap", "100", "--uvm-rows", "1000", "--dcn-batch", "16"]
    assert pipeline.main([*argv, *STEPS]) == 0
    assert models_alive_after_free == [0, 0, 0, 0]  # after each side of each repeat
    assert "| DCNv2, 16 |" in capsys.readouterr().out
