"""Optimizers that run on the servers, named by class path plus hyperparameters: never a pickled
object. The allow-list is torch.optim's own optimizer classes."""

from __future__ import annotations

import numbers
from typing import Any

import torch

ALLOWED_PREFIX = "torch.optim."


def class_path(optimizer: str | type) -> str:
    if isinstance(optimizer, str):
        return optimizer
    return f"{optimizer.__module__}.{optimizer.__qualname__}"


def resolve(path: str) -> type[torch.optim.Optimizer]:
    """torch.optim.NAME -> the class; anything else is refused."""
    name = path.removeprefix(ALLOWED_PREFIX)
    if path.startswith("torch.optim.") and "." in name:  # torch.optim.sgd.SGD -> SGD
        name = name.rsplit(".", 1)[1]
    cls = getattr(torch.optim, name, None) if path.startswith(ALLOWED_PREFIX) else None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
        raise ValueError(f"optimizer {path!r} is not one of torch.optim's optimizers")
    return cls


def check_hyperparameters(hyper: dict[str, Any]) -> dict[str, Any]:
    """Only plain numbers, booleans and short lists of numbers cross the wire."""
    for name, value in hyper.items():
        ok = isinstance(value, (numbers.Real, bool, str)) or (
            isinstance(value, (list, tuple)) and all(isinstance(v, numbers.Real) for v in value)
        )
        if not ok:
            raise TypeError(f"optimizer hyperparameter {name}={value!r} is not a number or a list of numbers")
    return {k: list(v) if isinstance(v, tuple) else v for k, v in hyper.items()}


def build(path: str, hyper: dict[str, Any], param: torch.nn.Parameter) -> torch.optim.Optimizer:
    cls = resolve(path)
    args: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in check_hyperparameters(hyper).items()
    }
    return cls([param], **args)


def set_hyperparameters(optimizer: torch.optim.Optimizer, hyper: dict[str, Any]) -> None:
    """Change hyperparameters the optimizer was built with (an LR schedule's lr, a group's betas);
    ValueError naming one it does not have."""
    group = optimizer.param_groups[0]
    for name, value in check_hyperparameters(hyper).items():
        if name not in group:
            raise ValueError(
                f"hyperparameter {name}={value!r}: {type(optimizer).__name__} has no such setting "
                f"(its settings: {', '.join(k for k in group if k != 'params')})"
            )
        group[name] = tuple(value) if isinstance(value, list) else value


def state_tensors(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    state = optimizer.state.get(param, {})
    return {k: v if isinstance(v, torch.Tensor) else torch.tensor(v) for k, v in state.items()}


def load_state_tensors(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, state: dict[str, torch.Tensor]
) -> None:
    optimizer.state[param] = {k: v.clone() for k, v in state.items()}
