"""A small, obviously correct single-process store: what the servers compute, without wires, shards,
shared memory, slicing, pooling or replication. Tests replay a real job's pushes through it and
compare (tests/test_reference.py); it is never used to train.

    dense keys    init, push, pull; a server optimizer (torch.optim, by path: kvstore/optim.py) or
                  none (a round's sum, or mean, becomes the value; an async push adds up)
    sparse rows   tables of rows by id, created (zeros) by a training pull; the same optimizers
                  applied row by row, each row its own torch parameter and optimizer: that is what
                  the servers' lazy sparse optimizers compute (server/sparse_optim.py)
    consistency   the policy's: in round models a worker's n-th push of a key joins round n (or,
                  with backup workers, the round of the version it last pulled, if later), applied
                  once complete (every worker pushed it; all but b with backup workers), rounds in
                  order, with the mean over the pushes that made it; a push to a round applied
                  already is dropped (`late`) where the policy drops it. Otherwise a push applies
                  on arrival. A pull the policy would hold back (its min_version is ahead) raises
                  WouldWait.
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
        self.reads: dict[tuple[int, Any], int] = {}
        """Per (rank, key): the version its last pull got."""
        self.shifts: dict[tuple[int, Any], int] = {}
        """Per (rank, key): the rounds that worker skipped (its round is its clock plus this)."""
        self.late = 0
        """Pushes dropped: their round was applied without them."""
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
        entry = self.keys[key]
        grad = grad.detach().clone().float()
        if not self.policy.holds_pushes():
            self._tick(rank, key)
            self._update(entry, grad)
            return
        round_ = self._round(rank, key)
        if round_ < entry.version:
            if not self.policy.drops_late():
                raise ValueError(f"worker {rank}'s push of {key!r} to round {round_}, already applied")
            self.late += 1
            return
        entry.rounds.setdefault(round_, {})[rank] = grad
        members = set(range(self.workers))
        while entry.version in entry.rounds and self.policy.round_complete(
            entry.rounds[entry.version].keys(), members
        ):
            pushed = entry.rounds.pop(entry.version)
            total = torch.stack([pushed[r] for r in sorted(pushed)]).sum(0)
            self._update(entry, total / len(pushed) if self.average else total)

    def _round(self, rank: int, key: Any) -> int:
        """The round this push joins (the policy's: its clock, or the version last pulled)."""
        clock = self._tick(rank, key) + self.shifts.get((rank, key), 0)
        round_ = self.policy.joins(clock, self.reads.get((rank, key), 0))
        self.shifts[rank, key] = self.shifts.get((rank, key), 0) + round_ - clock
        return round_

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
        clock = self.clocks.get((rank, key), 0)
        need = self.policy.min_version(clock + self.shifts.get((rank, key), 0) if clock else 0)
        if entry.version < need:
            raise WouldWait(f"worker {rank}'s pull of {key!r} needs version {need}, at {entry.version}")
        self.reads[rank, key] = entry.version
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
