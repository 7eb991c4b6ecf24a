"""MXNet's `local` / `device` kvstore: the same API in one process, no servers.

With one worker, a sync round is one push: without an optimizer the value becomes the pushed sum
(values pushed as a list, one per local device, are summed first); with one, it takes one step. In
async mode, pushes without an optimizer add to the value, as on the servers.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from paratrain.errors import KVStoreError
from paratrain.kvstore import optim
from paratrain.kvstore.api import Handle, Keys, KVStoreConfig
from paratrain.kvstore.compressed import compression_config
from paratrain.kvstore.worker.checks import (
    as_lists,
    check_call,
    check_init_value,
)
from paratrain.kvstore.worker.state import by_values, read_hyper, read_state, write_state


class LocalKVStore:
    rank = 0
    num_workers = 1

    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        self._values: dict[Any, torch.Tensor] = {}
        self._params: dict[Any, torch.nn.Parameter] = {}
        self._optimizers: dict[Any, torch.optim.Optimizer] = {}
        self._optimizer_spec: tuple[str, dict] | None = None
        self._key_hyper: dict[Any, dict] = {}  # set_hyperparameters' values per key

    def _value(self, key: Any) -> torch.Tensor:
        if key not in self._values:
            raise KVStoreError(f"key {key!r} was never initialized (call kv.init first)")
        return self._values[key]

    def _spec(self, key: Any) -> tuple[list[int], torch.dtype]:
        value = self._value(key)
        return list(value.shape), value.dtype

    def _check(self, keys: list, values: list | None, outs: list | None) -> None:
        """Every argument is checked before any value changes (as DistKVStore does)."""
        check_call(keys, values, outs, self._spec, self.config.refuse_non_finite, self.rank)

    def init(self, keys: Keys, values: Any) -> None:
        keys, values = as_lists(keys, values)
        for key, value in zip(keys, values, strict=True):
            check_init_value(key, value)
        for key, value in zip(keys, values, strict=True):
            known = self._values.get(key)
            if known is None:
                self._values[key] = value.detach().to("cpu", copy=True)
                if self._optimizer_spec:
                    self._attach(key, *self._optimizer_spec)
            elif (known.shape, known.dtype) != (value.shape, value.dtype):
                raise ValueError(
                    f"key {key!r} was initialized as {known.dtype}{list(known.shape)}; "
                    f"init as {value.dtype}{list(value.shape)} is not allowed"
                )

    def push(self, keys: Keys, values: Any) -> Handle:
        keys, values = as_lists(keys, values)
        self._check(keys, values, None)
        for key, value in zip(keys, values, strict=True):
            current, grad = self._value(key), value.detach().to("cpu")
            if key in self._optimizers:
                self._params[key].grad = grad.to(current.dtype)
                self._optimizers[key].step()
                self._params[key].grad = None
            else:
                self.config.policy.local_update(current, grad)
        return Handle([])

    def pull_async(self, keys: Keys, out: Any) -> Handle:
        keys, outs = as_lists(keys, out)
        self._check(keys, None, outs)
        for key, dest in zip(keys, outs, strict=True):
            dest.copy_(self._value(key))
        return Handle([])

    def pull(self, keys: Keys, out: Any) -> None:
        self.pull_async(keys, out)

    def pushpull_async(self, keys: Keys, values: Any, out: Any) -> Handle:
        self._check(*as_lists(keys, values), as_lists(keys, out)[1])  # the outs too, before the push
        self.push(keys, values)
        return self.pull_async(keys, out)

    def pushpull(self, keys: Keys, values: Any, out: Any) -> None:
        self.pushpull_async(keys, values, out)

    def set_optimizer(self, optimizer: str | type, **hyperparameters: Any) -> None:
        path = optim.class_path(optimizer)
        optim.resolve(path)
        self._optimizer_spec = (path, optim.check_hyperparameters(hyperparameters))
        for key in self._values:
            self._attach(key, *self._optimizer_spec)

    def set_hyperparameters(self, keys: Keys, **hyperparameters: Any) -> Handle:
        hyper = optim.check_hyperparameters(hyperparameters)
        for key in keys if isinstance(keys, (list, tuple)) else [keys]:
            if key not in self._optimizers:
                raise KVStoreError(f"key {key!r} has no optimizer (call init and set_optimizer first)")
            optim.set_hyperparameters(self._optimizers[key], hyper)
            self._key_hyper[key] = self._key_hyper.get(key, {}) | hyper
        return Handle([])

    def _attach(self, key: Any, path: str, hyper: dict) -> None:
        self._params[key] = torch.nn.Parameter(self._values[key], requires_grad=True)
        self._values[key] = self._params[key].data
        self._optimizers[key] = optim.build(path, hyper, self._params[key])

    def set_gradient_compression(self, compression: Any) -> None:
        """Checked, with no effect: nothing travels in one process."""
        self.compression = compression_config(compression)

    def barrier(self) -> None:
        pass

    def stats(self) -> dict:
        """No servers, nothing counted."""
        return {}

    def save_state(self, path: str | os.PathLike[str]) -> None:
        entries = [
            (
                key,
                value.clone(),
                optim.state_tensors(self._optimizers[key], self._params[key])
                if key in self._optimizers
                else {},
            )
            for key, value in self._values.items()
        ]
        write_state(path, entries, list(self._optimizer_spec or ()), hyper=self._key_hyper)

    def load_state(self, path: str | os.PathLike[str]) -> None:
        for key, value, state in read_state(path):
            self._value(key).copy_(value)
            if state:
                if key not in self._optimizers:
                    raise KVStoreError("the state has optimizer state: call set_optimizer before load_state")
                optim.load_state_tensors(self._optimizers[key], self._params[key], state)
        for keys, values in by_values(read_hyper(path)):  # each key's own, over the optimizer's
            self.set_hyperparameters(keys, **values)

    def close(self) -> None:
        pass
