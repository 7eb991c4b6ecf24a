"""A small, obviously correct single-process store: what the servers compute, without wires, shards,
shared memory, slicing, pooling or replication. Tests replay a real job's pushes through it and
compare (tests/test_reference.py); it is never used to train.

    dense keys    init, push, pull; a server optimizer (torch.optim, by path: kvstore/optim.py) or
                  none (a round's sum, or mean, becomes the value; an async push adds up)
    sparse rows   tables of rows by id, created (zeros) by a training pull; the same optimizers
                  applied row by row, each row its own torch parameter and optimizer: that is what
                  the servers' lazy sparse optimizers compute (server/sparse_optim.py)
    consistency   the policy's: in round models a worker's n-th push of a key joins round n, applied
                  once every worker pushed it, rounds in order; otherwise a push applies on arrival.
                  A pull the policy would hold back (its min_version is ahead) raises WouldWait.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from paratrain.kvstore import optim
from paratrain.kvstore.consistency import Policy, parse


class WouldWait(Exception):
    """A pull that the store would hold back until other workers push."""


@dataclass
class _Key:
    value: torch.Tensor
    version: int = 0
    rounds: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    """Round -> {rank: its push}."""
    optimizer: torch.optim.Optimizer | None = None
    param: torch.nn.Parameter | None = None


@dataclass
class _Table:
    dim: int
    rows: dict[int, torch.nn.Parameter] = field(default_factory=dict)
    optimizers: dict[int, torch.optim.Optimizer] = field(default_factory=dict)
    optimizer: tuple[str, dict] | None = None
    version: int = 0
    rounds: dict[int, dict[int, tuple[list[int], torch.Tensor]]] = field(default_factory=dict)


class ReferenceStore:
    def __init__(self, consistency: Policy | str = "sync", workers: int = 1, average: bool = False) -> None:
        self.policy = parse(consistency)
        self.workers = workers
        self.average = average
        self.keys: dict[Any, _Key] = {}
        self.tables: dict[Any, _Table] = {}
        self.clocks: dict[tuple[int, Any], int] = {}
        self._optimizer: tuple[str, dict] | None = None

    # -- dense keys --------------------------------------------------------------------------------
    def init(self, key: Any, value: torch.Tensor) -> None:
        self.keys[key] = _Key(value.detach().clone().float())
        if self._optimizer is not None:
            self._attach(self.keys[key], *self._optimizer)

    def set_optimizer(self, path: str, **hyper: Any) -> None:
        """The servers' optimizer for every dense key, and the default of every table."""
        self._optimizer = (path, hyper)
        for entry in self.keys.values():
            self._attach(entry, path, hyper)

    def _attach(self, entry: _Key, path: str, hyper: dict) -> None:
        entry.param = torch.nn.Parameter(entry.value, requires_grad=False)
        entry.optimizer = optim.build(path, hyper, entry.param)

    def push(self, rank: int, key: Any, grad: torch.Tensor) -> None:
        entry, clock = self.keys[key], self._tick(rank, key)
        grad = grad.detach().clone().float()
        if not self.policy.holds_pushes():
            self._update(entry, grad)
            return
        entry.rounds.setdefault(clock, {})[rank] = grad
        while len(entry.rounds.get(entry.version, {})) == self.workers:
            pushed = entry.rounds.pop(entry.version)
            total = torch.stack([pushed[r] for r in sorted(pushed)]).sum(0)
            self._update(entry, total / self.workers if self.average else total)

    def _update(self, entry: _Key, update: torch.Tensor) -> None:
        if entry.optimizer is not None:
            assert entry.param is not None
            entry.param.grad = update
            entry.optimizer.step()
            entry.param.grad = None
        else:
            self.policy.local_update(entry.value, update)
        entry.version += 1

    def pull(self, rank: int, key: Any) -> torch.Tensor:
        entry = self.keys[key]
        need = self.policy.min_version(self.clocks.get((rank, key), 0))
        if entry.version < need:
            raise WouldWait(f"worker {rank}'s pull of {key!r} needs version {need}, at {entry.version}")
        return entry.value.clone()

    def version(self, key: Any) -> int:
        return self.keys[key].version

    # -- sparse rows ---------------------------------------------------------------------------------
    def init_table(self, key: Any, dim: int) -> None:
        self.tables[key] = _Table(dim, optimizer=self._optimizer)

    def set_table_optimizer(self, key: Any, path: str, **hyper: Any) -> None:
        table = self.tables[key]
        table.optimizer = (path, hyper)
        table.optimizers = {i: optim.build(path, hyper, row) for i, row in table.rows.items()}

    def pull_rows(self, rank: int, key: Any, ids: Sequence[int], train: bool = True) -> torch.Tensor:
        """The rows of `ids` (zeros for absent ones); a training pull creates them."""
        table = self.tables[key]
        need = self.policy.min_version(self.clocks.get((rank, key), 0))
        if table.version < need:
            raise WouldWait(f"worker {rank}'s pull of table {key!r} needs version {need}, at {table.version}")
        if train:
            for i in ids:
                if i not in table.rows:
                    table.rows[i] = torch.nn.Parameter(torch.zeros(table.dim), requires_grad=False)
                    if table.optimizer is not None:
                        table.optimizers[i] = optim.build(*table.optimizer, table.rows[i])
        zero = torch.zeros(table.dim)
        return torch.stack([table.rows[i].detach().clone() if i in table.rows else zero for i in ids])

    def push_rows(self, rank: int, key: Any, ids: Sequence[int], grads: torch.Tensor) -> None:
        """Gradients of unique `ids`; rows not created (never pulled for training) drop theirs."""
        table, clock = self.tables[key], self._tick(rank, key)
        pushed = (list(ids), grads.detach().clone().float())
        if not self.policy.holds_pushes():
            self._update_rows(table, [pushed])
            return
        table.rounds.setdefault(clock, {})[rank] = pushed
        while len(table.rounds.get(table.version, {})) == self.workers:
            done = table.rounds.pop(table.version)
            self._update_rows(table, [done[r] for r in sorted(done)])

    def _update_rows(self, table: _Table, pushes: list[tuple[list[int], torch.Tensor]]) -> None:
        """One update of the rows the pushes touch: each row's gradients summed, then one step."""
        sums: dict[int, torch.Tensor] = {}
        for ids, grads in pushes:
            for i, grad in zip(ids, grads, strict=True):
                if i in table.rows:
                    sums[i] = sums[i] + grad if i in sums else grad.clone()
        for i, grad in sums.items():
            row = table.rows[i]
            if table.optimizer is not None:
                row.grad = grad
                table.optimizers[i].step()
                row.grad = None
            else:
                self.policy.local_update(row.data, grad)
        table.version += 1

    def _tick(self, rank: int, key: Any) -> int:
        clock = self.clocks.get((rank, key), 0)
        self.clocks[rank, key] = clock + 1
        return clock
