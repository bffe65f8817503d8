"""The dense optimizer, with its state in place from the start.

torch's optimizers differ in when they create their per-parameter state: Adagrad creates its
sums and step counts in its constructor, Adam and AdamW create theirs (step count, first and
second moments, and the running maximum under ``amsgrad``) at their first step, and SGD keeps
none without momentum. raytrec moves that state between ranks (replica sync, heals, checkpoint
save and load, state digests) as flat buffers, so a rank that has never stepped must hold state
of the same keys, shapes and dtypes as one that has: :func:`build_dense_optimizer` creates every
lazily created entry at build time, with the values torch's first step would give it
(:func:`initial_state`), so a rank's first step computes exactly what it would have computed
from torch's lazy start, and a rank that receives a stepped peer's state continues as the peer
would, step counts included.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.optim.optimizer import _get_scalar_dtype
from torchrec.optim.keyed import KeyedOptimizerWrapper

from raytrec.config import OptimizerConfig

__all__ = [
    "DENSE_OPTIMIZERS",
    "build_dense_optimizer",
    "dense_optimizer_kwargs",
    "initial_state",
    "materialize_state",
    "state_tensors",
]

DENSE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


def dense_optimizer_kwargs(cfg: OptimizerConfig) -> dict[str, Any]:
    """The dense optimizer's arguments (torch's, for ``DENSE_OPTIMIZERS[cfg.dense]``)."""
    kwargs: dict[str, Any] = {"lr": cfg.dense_lr}
    if cfg.dense != "sgd":
        kwargs["eps"] = cfg.eps
    if cfg.dense_weight_decay or cfg.dense == "adamw":
        # AdamW's own default decay is 0.01; raytrec's is the config's (0 unless set).
        kwargs["weight_decay"] = cfg.dense_weight_decay
    return kwargs


def initial_state(
    optimizer: torch.optim.Optimizer, group: Mapping[str, Any], param: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The state ``optimizer`` creates for ``param`` (of ``group``) at its first step, as torch
    creates it (keys, dtypes, devices and values); empty for an optimizer that creates none
    lazily (SGD without momentum; Adagrad, which creates its state in its constructor)."""
    if isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam
        # torch.optim.Adam._init_group: the step on the CPU unless capturable or fused.
        on_device = bool(group["capturable"] or group["fused"])
        step = (
            torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=param.device)
            if on_device
            else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
        )
        state = {
            "step": step,
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
        }
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state
    if isinstance(optimizer, torch.optim.SGD):
        if group["momentum"]:
            # SGD's first step sets the buffer to the gradient; a zero buffer gives the same
            # only without dampening (buf * momentum + (1 - dampening) * grad).
            if group["dampening"]:
                raise ValueError(
                    "SGD with momentum and dampening has no state that matches its first step; "
                    "use dampening=0"
                )
            return {"momentum_buffer": torch.zeros_like(param)}
        return {}
    if isinstance(optimizer, torch.optim.Adagrad):
        return {}  # created in the constructor
    raise ValueError(
        f"no known initial state for {type(optimizer).__name__}; raytrec's dense optimizers "
        f"are {sorted(DENSE_OPTIMIZERS)}"
    )


def materialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates the state ``optimizer`` would create lazily, for every parameter that has none."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            fresh = initial_state(optimizer, group, param)
            if fresh and not optimizer.state.get(param):
                optimizer.state[param] = fresh


def build_dense_optimizer(
    params: Mapping[str, torch.Tensor], cfg: OptimizerConfig
) -> KeyedOptimizerWrapper:
    """The dense optimizer over ``params`` (name -> parameter) that ``cfg`` names, keyed by
    parameter name (TorchRec's ``KeyedOptimizer``), with its state created at once."""
    cls = DENSE_OPTIMIZERS[cfg.dense]
    kwargs = dense_optimizer_kwargs(cfg)
    optimizer = KeyedOptimizerWrapper(dict(params), lambda ps: cls(ps, **kwargs))
    materialize_state(optimizer._optimizer)
    return optimizer


def state_tensors(
    optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor]
) -> Iterator[torch.Tensor]:
    """The optimizer's tensor state, in a fixed order: by parameter in ``params`` order, then
    by state key in sorted order (the same on every rank, however the state was created)."""
    for param in params.values():
        state = optimizer.state.get(param, {})
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                yield value
