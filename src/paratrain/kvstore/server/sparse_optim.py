"""Lazy optimizers for sparse tables: an update changes only the pushed rows' values and state, in
place (the loops are in kernels.py), with torch.optim's sparse formulas (SGD, Adagrad; Adam with each
row's own step count for its bias correction, which equals torch's SparseAdam for rows touched every
step)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from paratrain.kvstore import kernels, optim
from paratrain.kvstore.api import TableError
from paratrain.kvstore.server.rowstore import Columns


class SparseOptimizer:
    """Updates only the given rows: `step(columns, slots, grads)` with unique slots."""

    kind = ""
    defaults: dict[str, Any] = {}

    def __init__(self, path: str, hyper: dict[str, Any]) -> None:
        self.spec = [path, dict(hyper)]
        self.hyper = dict(self.defaults)
        for name, value in hyper.items():
            if name in self.hyper:
                self.hyper[name] = tuple(value) if isinstance(value, list) else value
            elif value not in (None, False, 0, 0.0):  # torch's switches at their defaults are fine
                raise TableError(f"{path} hyperparameter {name}={value!r} has no sparse form for tables")

    def columns(self, dim: int) -> Columns:
        return {}

    def init_rows(self, columns: dict[str, torch.Tensor], slots: torch.Tensor) -> None:
        for name in self.columns(0):
            columns[name].index_fill_(0, slots, 0)

    def step(self, columns: dict[str, torch.Tensor], slots: np.ndarray, grads: torch.Tensor) -> None:
        """Update the rows at unique `slots` with one gradient row each (float32, contiguous)."""
        raise NotImplementedError


def add_rows(table: torch.Tensor, slots: np.ndarray, delta: torch.Tensor, alpha: float = 1.0) -> None:
    """table[slots] += alpha * delta for unique slots."""
    kernels.add_rows(table.numpy(), slots, delta.numpy(), np.float32(alpha))


class SparseSGD(SparseOptimizer):
    kind = "SGD"
    defaults = {"lr": 1e-3}

    def step(self, columns: dict[str, torch.Tensor], slots: np.ndarray, grads: torch.Tensor) -> None:
        add_rows(columns["value"], slots, grads, -self.hyper["lr"])


class SparseAdagrad(SparseOptimizer):
    kind = "Adagrad"
    defaults = {"lr": 1e-2, "eps": 1e-10, "initial_accumulator_value": 0.0}

    def columns(self, dim: int) -> Columns:
        return {"sum": ((dim,), torch.float32)}

    def init_rows(self, columns: dict[str, torch.Tensor], slots: torch.Tensor) -> None:
        columns["sum"].index_fill_(0, slots, self.hyper["initial_accumulator_value"])

    def step(self, columns: dict[str, torch.Tensor], slots: np.ndarray, grads: torch.Tensor) -> None:
        lr, eps = np.float32(self.hyper["lr"]), np.float32(self.hyper["eps"])
        kernels.adagrad_rows(columns["value"].numpy(), columns["sum"].numpy(), slots, grads.numpy(), lr, eps)


class SparseAdam(SparseOptimizer):
    kind = "Adam"
    defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}

    def columns(self, dim: int) -> Columns:
        return {
            "exp_avg": ((dim,), torch.float32),
            "exp_avg_sq": ((dim,), torch.float32),
            "step": ((), torch.int64),
        }

    def step(self, columns: dict[str, torch.Tensor], slots: np.ndarray, grads: torch.Tensor) -> None:
        beta1, beta2 = self.hyper["betas"]
        kernels.adam_rows(
            columns["value"].numpy(),
            columns["exp_avg"].numpy(),
            columns["exp_avg_sq"].numpy(),
            columns["step"].numpy(),
            slots,
            grads.numpy(),
            float(self.hyper["lr"]),
            float(beta1),
            float(beta2),
            np.float32(self.hyper["eps"]),
        )


SPARSE_FORMS = {"SGD": SparseSGD, "Adagrad": SparseAdagrad, "Adam": SparseAdam, "SparseAdam": SparseAdam}


def build_optimizer(path: str, hyper: dict[str, Any]) -> SparseOptimizer:
    """The lazy form of a torch.optim optimizer (allow-listed by kvstore.optim)."""
    name = optim.resolve(path).__name__
    if name not in SPARSE_FORMS:
        raise TableError(f"optimizer {path!r} has no sparse form for tables: use SGD, Adagrad or Adam")
    return SPARSE_FORMS[name](path, optim.check_hyperparameters(hyper))
