"""A kvstore without servers that has sparse tables: the local store (kinds local and device, or a
script run alone) with a `TableClient` whose one "server" is the servers' own table code
(`SparseTables`) called in this process, so a job run alone trains its tables as a distributed one."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.errors import RemoteError
from paratrain.kvstore import optim
from paratrain.kvstore.api import KVStoreConfig, SparseAPI
from paratrain.kvstore.server.rules import Rules
from paratrain.kvstore.server.sparse import SparseTables
from paratrain.kvstore.worker.embedding import TableClient
from paratrain.kvstore.worker.local import LocalKVStore
from paratrain.kvstore.worker.state import read_tables, write_tables


class _Done:
    """The reply to an in-process request, which is complete when it returns."""

    def __init__(
        self, meta: dict | None, tensors: Sequence[torch.Tensor], error: str | None, out: Any
    ) -> None:
        self.meta, self.tensors, self.error = meta or {}, list(tensors), error
        for dest, tensor in zip(out or (), self.tensors, strict=False):
            dest.copy_(tensor)

    def wait(self, timeout_s: float | None = None) -> _Done:
        if self.error is not None:
            raise RemoteError(self.error)
        return self

    def done(self) -> bool:
        return True


class InProcessServer:
    """The request interface of an RpcClient, served by a SparseTables in this process."""

    @dataclass
    class _Request:
        op: str
        meta: dict
        tensors: list[torch.Tensor]
        header: Any = None
        result: tuple[dict | None, Sequence[torch.Tensor], str | None] | None = None

        def reply(self, meta: dict | None = None, tensors: Sequence[torch.Tensor] = ()) -> None:
            self.result = (meta, tensors, None)

        def fail(self, message: str) -> None:
            self.result = (None, (), message)

    @dataclass
    class _Header:
        at: int | None = None

    def __init__(self, tables: SparseTables) -> None:
        self.tables = tables

    def request(self, op: str, meta: dict | None = None, tensors: Sequence = (), out: Any = None) -> _Done:
        request = self._Request(op, meta or {}, list(tensors), self._Header())
        try:
            self.tables.handle(request)
        except (ValueError, TypeError, KeyError) as exc:
            request.fail(str(exc))
        assert request.result is not None, f"{op} got no reply"  # nothing waits in a one-worker job
        return _Done(*request.result, out)

    submit = request  # nothing here can be down


@dataclass
class _OneProcess:
    """What SparseTables reads from its server: this process is the only worker."""

    rules: Rules
    rank: int = 0

    @property
    def members(self) -> frozenset[int]:
        return self.rules.members


class LocalSparseKVStore(SparseAPI, LocalKVStore):
    """The local store (kinds local, device, or a script run alone) with sparse tables."""

    def __init__(self, config: KVStoreConfig) -> None:
        super().__init__(config)
        self._server = SparseTables(_OneProcess(Rules(config.policy, frozenset({0}))))
        self.tables = TableClient([InProcessServer(self._server)], 0, config, lambda name: None, None)

    def set_optimizer(self, optimizer: str | type, **hyperparameters: Any) -> None:
        super().set_optimizer(optimizer, **hyperparameters)
        path = optim.class_path(optimizer)
        self._server.set_default_optimizer(path, optim.check_hyperparameters(hyperparameters))

    def save_state(self, path: str | os.PathLike[str]) -> None:
        super().save_state(path)
        if self.tables.tables:
            write_tables(path, self.tables.gather())

    def load_state(self, path: str | os.PathLike[str]) -> None:
        super().load_state(path)
        self.tables.load(read_tables(path))
        self.tables.reset_clocks()
