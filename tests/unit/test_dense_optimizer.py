"""The dense optimizer's state exists from build time, exactly as torch's first step makes it.

Reference: the same torch optimizer built the plain way (state created lazily at its first
step), fed the same gradients. Before any step the built optimizer already holds what the
plain one holds after its first (keys, shapes, dtypes, devices); after every step both hold
bit-for-bit the same parameters and state.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytrec.config import OptimizerConfig
from raytrec.engine.dense_optimizer import (
    DENSE_OPTIMIZERS,
    build_dense_optimizer,
    dense_optimizer_kwargs,
    initial_state,
    state_tensors,
)

DENSE = ("sgd", "adagrad", "adam", "adamw")


def _params(seed: int) -> dict[str, nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": nn.Parameter(torch.randn(4, 3, generator=gen)),
        "b": nn.Parameter(torch.randn(3, generator=gen)),
    }


def _grads(step: int, params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}


@pytest.mark.parametrize("dense", DENSE)
def test_built_state_is_torchs_first_step_state_and_steps_alike(dense: str) -> None:
    cfg = OptimizerConfig(dense=dense, dense_lr=0.1, dense_weight_decay=0.01)  # type: ignore[arg-type]
    built_params, plain_params = _params(1), _params(1)
    built = build_dense_optimizer(built_params, cfg)
    plain = DENSE_OPTIMIZERS[dense](list(plain_params.values()), **dense_optimizer_kwargs(cfg))
    # torch creates Adagrad's state in its constructor, Adam's at the first step.
    assert bool(plain.state) == (dense == "adagrad")
    before = {n: {k: v.clone() for k, v in built.state[p].items()} for n, p in built_params.items()}
    if dense == "sgd":
        assert all(not s for s in before.values())  # no momentum: no state at all
    else:
        assert all(before.values())
    for step in range(3):
        for params in (built_params, plain_params):
            for n, g in _grads(step, params).items():
                params[n].grad = g.clone()
        built.step()
        plain.step()
        if step == 0:
            for n, p in plain_params.items():
                first = plain.state[p]
                assert sorted(first) == sorted(before[n]), n
                for k, v in first.items():
                    b = before[n][k]
                    assert (b.shape, b.dtype, b.device) == (v.shape, v.dtype, v.device), (n, k)
        for n in built_params:
            assert torch.equal(built_params[n], plain_params[n]), (step, n)
            ours, theirs = built.state[built_params[n]], plain.state[plain_params[n]]
            assert sorted(ours) == sorted(theirs)
            for k in ours:
                assert torch.equal(ours[k], theirs[k]), (step, n, k)
    # The test can fail: the parameters moved.
    assert not torch.equal(built_params["w"], _params(1)["w"])


def test_state_tensors_follow_parameter_then_key_order() -> None:
    params = _params(2)
    opt = build_dense_optimizer(params, OptimizerConfig(dense="adam"))
    got = list(state_tensors(opt, params))
    want = [opt.state[params[n]][k] for n in ("w", "b") for k in ("exp_avg", "exp_avg_sq", "step")]
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want, strict=True))


def test_adamw_decays_decoupled_and_only_as_configured() -> None:
    assert dense_optimizer_kwargs(OptimizerConfig(dense="adamw"))["weight_decay"] == 0.0
    cfg = OptimizerConfig(dense="adamw", dense_lr=0.1, dense_weight_decay=0.5)
    param = nn.Parameter(torch.full((3,), 2.0))
    opt = build_dense_optimizer({"p": param}, cfg)
    param.grad = torch.zeros(3)  # only the decay moves it: p * (1 - lr * wd)
    opt.step()
    torch.testing.assert_close(param.detach(), torch.full((3,), 2.0 * (1 - 0.1 * 0.5)))


def test_sgd_momentum_state_is_refused_with_dampening() -> None:
    param = nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([param], lr=0.1, momentum=0.9, dampening=0.1)
    with pytest.raises(ValueError, match="dampening"):
        initial_state(sgd, sgd.param_groups[0], param)
    plain = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    state = initial_state(plain, plain.param_groups[0], param)
    assert list(state) == ["momentum_buffer"] and not state["momentum_buffer"].any()
