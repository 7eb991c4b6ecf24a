"""Embedding tables that live on the parameter servers: the worker's side.

    emb = DistributedEmbedding("ads", 16, mode="sum", optimizer=torch.optim.Adagrad,
                               optimizer_args={"lr": 0.05})  # kv=: see default_store
    out = emb(ids, offsets)                                  # pulls the batch's unique rows
    loss.backward()                                          # pushes their gradients (async)
    emb.flush()                                              # where the optimizer steps

A forward dedups its ids and groups the unique ids by server (a hash of the id) in one pass, and pulls
just those rows, one frame per server. The rows become a fresh leaf tensor (never an nn.Parameter, so
torch optimizers and DDP leave it alone) that the output gathers from; its gradient, which autograd
has already summed per unique row, is pushed from a hook during backward, and `flush()` (called by
the trainer where the optimizer steps, and by the next forward once its pull is sent) waits for the
pushes. In sync mode the next pull waits on the servers until every worker's push of the round was
applied, as dense pulls do; so a training forward (module.training, grad enabled) needs its backward
on every worker.

`TableClient` does the wire work of the sparse kvstore API (init_table, row_sparse_pull, push_sparse,
...) for DistKVStore, and for a store without servers (`LocalSparseKVStore`, local_sparse.py) over
the servers' own table code in this process. `ServingEmbedding` serves a table written by `kv.export_table`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paratrain.checkpoint import save_file
from paratrain.cluster.context import Context
from paratrain.errors import KVStoreError, RemoteError, TransportError
from paratrain.kvstore import kernels, optim, protocol
from paratrain.kvstore.api import Handle, KVStoreConfig, SparseAPI, TableConfig, check_key, resolve_kind
from paratrain.kvstore.server.rowstore import SHARD_SALT, shard_of
from paratrain.kvstore.worker.checks import check_finite, explain_wait
from paratrain.kvstore.worker.failover import Servers
from paratrain.kvstore.worker.state import TableEntry
from paratrain.transport.message import Message

logger = logging.getLogger(__name__)

EXPORT_FORMAT = "paratrain.embedding/1"
MODES = (None, "sum", "mean", "max")


@dataclass
class TableInfo:
    dim: int
    config: TableConfig
    clock: int = 0
    """Pushes this worker made to the table: the round its next push joins."""


@dataclass
class Route:
    """Unique ids grouped by server: server s holds ids[bounds[s][0]:bounds[s][1]]."""

    ids: torch.Tensor
    bounds: list[tuple[int, int]]
    index: torch.Tensor | None
    """Where each of the caller's unique ids sits in `ids` (None: in the same place)."""


class TableClient:
    """The sparse tables of one kvstore, over `clients` (one per server, by rank)."""

    def __init__(
        self,
        clients: Sequence[Any],
        rank: int,
        config: KVStoreConfig,
        barrier: Callable[[str], Any],
        timeout_s: float | None,
        servers: Servers | None = None,
    ) -> None:
        self._clients = list(clients)
        self._servers = servers if servers is not None and servers.replication > 1 else None
        """Replicated servers (failover.py): each server's rows go to the first live copy."""
        self.rank = rank
        self._config = config
        self._barrier = barrier
        self._timeout_s = timeout_s
        self.tables: dict[Any, TableInfo] = {}

    def _info(self, key: Any) -> TableInfo:
        try:
            return self.tables[key]
        except KeyError:
            raise KVStoreError(f"table {key!r} was never declared (call kv.init_table first)") from None

    def _wait(self, futures: list) -> list:
        try:
            return [f.wait(self._timeout_s) for f in futures]
        except (RemoteError, TransportError, TimeoutError) as exc:
            raise KVStoreError(str(exc)) from None

    def _all(self, msg: Message) -> list:
        """`msg` to every (live) server; with replication one lost meanwhile is left out."""
        live = self._servers.live() if self._servers is not None else range(len(self._clients))
        return self._wait([self._submit(s, *msg.wire()) for s in live])

    def _submit(self, server: int, op: str, meta: dict, tensors: Sequence[torch.Tensor] = ()) -> Any:
        """A request to `server` alone; with replication its loss meanwhile is survived (Spared)."""
        if self._servers is None:
            return self._clients[server].submit(op, meta, tensors)
        return self._servers.submit(server, op, meta, tensors)

    def _per_primary(self, msg: Any) -> list:
        """`msg` for each server's rows: at that server, or with replication at its first live copy."""
        if self._servers is None:
            return self._all(msg)
        return self._wait([self._request(s, msg) for s in range(len(self._clients))])

    def _request(self, primary: int, msg: Any, tensors: Sequence[torch.Tensor] = (), out: Any = None) -> Any:
        """A request (a message with a `primary` field) for server `primary`'s rows; with replication
        one that fails over to its copies."""
        if self._servers is None:
            return self._clients[primary].submit(*msg.wire(), tensors, out=out)
        op, meta = replace(msg, primary=primary).wire()
        return self._servers.request(primary, op, meta, tensors, out)

    def _client(self, primary: int) -> Any:
        """The client of the server that serves `primary`'s rows now."""
        return self._clients[primary if self._servers is None else self._servers.serving(primary)]

    def init_table(self, key: Any, dim: int, config: TableConfig) -> None:
        check_key(key, "table key")
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"table {key!r}: dim={dim!r} must be an int >= 1")
        known = self.tables.get(key)
        if known is not None and (known.dim, known.config) != (dim, config):
            raise ValueError(f"table {key!r} was declared with dim {known.dim} and {known.config}")
        init = protocol.SparseInit(key, dim, asdict(config))
        if self._servers is None:
            self._all(init)
        else:  # each server keeps its own rows and copies of the rows of the chains it is on
            chains = [self._servers.chain(p) for p in range(len(self._clients))]
            live = self._servers.live()
            sent = [replace(init, chains=[c for c in chains if s in c]) for s in live]
            self._wait([self._submit(s, *m.wire()) for s, m in zip(live, sent, strict=True)])
        self.tables.setdefault(key, TableInfo(dim, config))

    # -- routing, pull and push -------------------------------------------------------------------
    def route(self, unique: torch.Tensor) -> Route:
        """Group unique int64 ids (CPU) by the server that holds them."""
        if len(self._clients) == 1:
            return Route(unique, [(0, len(unique))], None)
        shards = shard_of(unique, len(self._clients))
        order = torch.argsort(shards, stable=True)
        counts = torch.bincount(shards, minlength=len(self._clients)).tolist()
        index = torch.empty_like(order)
        index[order] = torch.arange(len(order))
        stops = [sum(counts[: s + 1]) for s in range(len(counts))]
        return Route(unique[order], list(zip([0, *stops[:-1]], stops, strict=True)), index)

    def dedup(self, ids: torch.Tensor) -> tuple[Route, torch.Tensor]:
        """The unique ids of `ids` (int64, CPU, 1-D) grouped by server, and where each of `ids` is
        among them: one pass with a hash set (kernels.py), where torch.unique sorts."""
        salt = np.uint64(SHARD_SALT)
        routed, inverse, counts = kernels.dedup_by_server(ids.numpy(), len(self._clients), salt)
        stops = np.cumsum(counts).tolist()
        bounds = list(zip([0, *stops[:-1]], stops, strict=True))
        return Route(torch.from_numpy(routed), bounds, None), torch.from_numpy(inverse)

    def _min_version(self, info: TableInfo) -> int:
        return self._config.policy.min_version(info.clock)

    def pull(self, key: Any, route: Route, train: bool) -> tuple[Handle, torch.Tensor]:
        """Start pulling the rows of route.ids; they land in the returned tensor, in route order."""
        info = self._info(key)
        rows = torch.empty(len(route.ids), info.dim)
        need = self._min_version(info)
        pull = protocol.SparsePull(key, info.clock, need, train, self.rank)
        servers = [s for s, (a, b) in enumerate(route.bounds) if b > a]
        futures = [
            self._request(s, pull, [route.ids[a:b]], out=[rows[a:b]])
            for s, (a, b) in enumerate(route.bounds)
            if b > a
        ]
        handle = self._handle(f"sparse pull of table {key!r}", futures)

        def probe(s: int) -> tuple[Any, str, dict]:
            return (self._client(s), *protocol.SparseWaiting(key, need, self.rank, s).wire())

        handle.diagnose = lambda pending: explain_wait([probe(servers[i]) for i in pending], self._timeout_s)
        return handle, rows

    def push(self, key: Any, route: Route, grads: torch.Tensor) -> Handle:
        """Push one gradient row per route id (in route order). In rounds modes every server gets
        a push, empty or not, so that its round can complete."""
        info = self._info(key)
        if grads.dtype != torch.float32 or tuple(grads.shape) != (len(route.ids), info.dim):
            raise ValueError(f"push to table {key!r}: grads must be float32 [{len(route.ids)}, {info.dim}]")
        grads = grads.detach().to("cpu").contiguous()
        if self._config.refuse_non_finite:  # before the clock moves: a refused push leaves no trace
            check_finite([key], [grads], self.rank, "table")
        push = protocol.SparsePush(key, info.clock, self.rank)
        info.clock += 1
        everyone = self._config.policy.pushes_everywhere()
        futures = [
            self._request(s, push, [route.ids[a:b], grads[a:b]])
            for s, (a, b) in enumerate(route.bounds)
            if b > a or everyone
        ]
        return self._handle(f"sparse push to table {key!r}", futures)

    def _handle(self, what: str, futures: list) -> Handle:
        """A Handle that logs what it still waits for after KVStoreConfig.wait_warning_s."""
        what = f"worker {self.rank}'s {what}"
        return Handle(futures, timeout_s=self._timeout_s, what=what, warn_after_s=self._config.wait_warning_s)

    def row_sparse_pull(self, key: Any, out: torch.Tensor, row_ids: torch.Tensor, train: bool) -> int | None:
        info = self._info(key)
        flat = _ids(row_ids)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (len(flat), info.dim):
            raise ValueError(f"out for table {key!r} must be a tensor of shape [{len(flat)}, {info.dim}]")
        route, where = self.dedup(flat)
        handle, rows = self.pull(key, route, train)
        handle.after.append(lambda: _discard(out.copy_(rows[where])))
        handle.wait()
        return handle.version

    def push_sparse(self, key: Any, row_ids: torch.Tensor, grads: torch.Tensor) -> Handle:
        info = self._info(key)
        flat = _ids(row_ids)
        if not isinstance(grads, torch.Tensor) or not grads.is_floating_point():
            kind = grads.dtype if isinstance(grads, torch.Tensor) else type(grads).__name__
            raise TypeError(f"push to table {key!r}: grads must be a float tensor, not {kind}")
        if grads.numel() != len(flat) * info.dim or (grads.dim() > 1 and grads.shape[-1] != info.dim):
            raise ValueError(
                f"push to table {key!r}: grads are {grads.dtype}{list(grads.shape)}; {len(flat)} ids "
                f"need [{len(flat)}, {info.dim}]"
            )
        grads = grads.detach().to("cpu", torch.float32).reshape(len(flat), info.dim)
        route, where = self.dedup(flat)
        summed = torch.zeros(len(route.ids), info.dim).index_add_(0, where, grads)
        return self.push(key, route, summed)

    # -- the rest of the API ----------------------------------------------------------------------
    def set_table_optimizer(self, key: Any, optimizer: Any, hyper: dict[str, Any]) -> None:
        self._info(key)
        path = optim.class_path(optimizer)
        optim.resolve(path)
        msg = protocol.SparseOptimizer(key, path, optim.check_hyperparameters(hyper))
        if self.rank == 0:
            self._all(msg)
        self._barrier("kvstore-table-optimizer")

    def table_stats(self, key: Any) -> list[dict[str, Any]]:
        self._info(key)
        return [reply.meta for reply in self._per_primary(protocol.SparseStats(key))]

    def export_table(self, key: Any, path: str | os.PathLike[str]) -> None:
        info = self._info(key)
        self._barrier("kvstore-export")
        if self.rank == 0:
            entry = self.gather(key, full=False)[0]
            export = {"format": EXPORT_FORMAT, "key": key, "dim": info.dim}
            _save(path, export | {"ids": entry["ids"], "values": entry["values"]})
        self._barrier("kvstore-export-done")

    def gather(self, key: Any = None, full: bool = True) -> list[TableEntry]:
        """Every table (or `key`) from every server, rows sorted by id: state-file entries."""
        parts: dict[Any, list[_TablePart]] = {}
        for reply in self._per_primary(protocol.SparseGetState(key, full)):
            at = 0
            for meta in reply.meta["tables"]:
                parts.setdefault(meta["key"], []).append(
                    _TablePart(meta, reply.tensors[at : at + meta["tensors"]])
                )
                at += meta["tensors"]
        return [_merge(pieces, full) for pieces in parts.values()]

    def load(self, entries: list[TableEntry]) -> None:
        """Put saved tables onto the servers, re-sharded for this job's number of servers."""
        for entry in entries:
            key = entry["key"]
            info = self.tables.get(key)
            if info is None:
                raise KVStoreError(f"the state file has table {key!r}, which this job never declared")
            if entry["dim"] != info.dim:
                raise KVStoreError(f"table {key!r} has dim {entry['dim']} in the file but {info.dim} here")
            route = self.route(entry["ids"])
            names = list(entry["state"])
            columns = [entry["values"], entry["ages"], *entry["state"].values()]
            if route.index is not None:  # route order
                order = torch.argsort(route.index)
                columns = [c[order] for c in columns]
            futures = [  # with replication, to every live copy of each server's rows
                self._submit(
                    t,
                    *protocol.SparseSetState(key, names, p).wire(),
                    [route.ids[a:b]] + [c[a:b].contiguous() for c in columns],
                )
                for p, (a, b) in enumerate(route.bounds)
                for t in (self._servers.chain(p) if self._servers is not None else [p])
                if self._servers is None or t not in self._servers.dead
            ]
            self._wait(futures)

    def reset_clocks(self) -> None:
        for info in self.tables.values():
            info.clock = 0


def _ids(row_ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(row_ids, torch.Tensor) or row_ids.dtype not in (torch.int64, torch.int32):
        kind = row_ids.dtype if isinstance(row_ids, torch.Tensor) else type(row_ids).__name__
        raise TypeError(f"row ids must be an int64 or int32 tensor, not {kind}")
    return row_ids.detach().reshape(-1).to("cpu", torch.int64)


class _TablePart(NamedTuple):
    """One server's rows of a table: what it said of them, and their columns (ids, values, then
    with `full` ages and optimizer state)."""

    meta: dict
    columns: list[torch.Tensor]


def _merge(pieces: list[_TablePart], full: bool) -> TableEntry:
    """One table's per-server parts -> one entry, rows sorted by id."""
    meta = pieces[0].meta
    columns = [torch.cat([p.columns[i] for p in pieces]) for i in range(len(pieces[0].columns))]
    order = torch.argsort(columns[0])
    columns = [c[order] for c in columns]
    entry = {k: meta[k] for k in ("key", "dim", "config", "optimizer")}
    entry |= {"step": max(p.meta["step"] for p in pieces), "ids": columns[0], "values": columns[1]}
    if full:
        entry |= {"ages": columns[2], "state": dict(zip(meta["names"], columns[3:], strict=True))}
    return entry


def _save(path: str | os.PathLike[str], payload: dict) -> None:
    save_file(path, payload)  # fsynced and renamed, as checkpoint files are


# -- the module -----------------------------------------------------------------------------------
_default_kv: Any = None


def default_store(config: KVStoreConfig | None = None, ctx: Context | None = None) -> Any:
    """The kvstore that DistributedEmbeddings built without `kv` share, one per process, made on
    first use: with `config` (the Trainer passes its strategy's, train/strategy.py), else
    "dist_sync" (a local store when the script runs alone)."""
    global _default_kv
    if _default_kv is None:
        from paratrain.kvstore import create

        _default_kv = create(config or resolve_kind("dist_sync"), ctx)
    elif config is not None and _default_kv.config != config:
        raise ValueError(
            f"the embedding tables' default kvstore was made with {_default_kv.config}; it cannot "
            f"also be {config}: build the Trainer before the model's first forward"
        )
    return _default_kv


class DistributedEmbedding(nn.Module):
    """nn.Embedding (mode None) or nn.EmbeddingBag (mode "sum", "mean", "max") over a table on the
    servers: ids are any int64 values, rows are created on first use (see TableConfig).

    The module holds no parameters: the table, and its lazy optimizer (`optimizer`: torch.optim.SGD,
    Adagrad or Adam, by class or path, with `optimizer_args`; else the store's set_optimizer), live
    on the servers. A training forward pulls the batch's unique rows into a leaf tensor; backward
    pushes their gradients from a hook on it; `flush()` (also the next forward, after its pull left) waits
    for those pushes. Every worker builds the same modules in the same order."""

    paratrain_sparse = True
    """Tells the trainer: no parameters here; call flush() where the optimizer steps."""

    def __init__(
        self,
        key: str | int,
        dim: int,
        *,
        mode: str | None = None,
        config: TableConfig | None = None,
        optimizer: str | type | None = None,
        optimizer_args: dict[str, Any] | None = None,
        kv: Any = None,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"DistributedEmbedding mode={mode!r} is not one of {MODES}")
        check_key(key, "table key")
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"table {key!r}: dim={dim!r} must be an int >= 1")
        if optimizer is None and optimizer_args:
            raise ValueError(f"DistributedEmbedding {key!r}: optimizer_args without an optimizer")
        self.key, self.dim, self.mode = key, dim, mode
        self._table = (config, optimizer, optimizer_args or {})
        self._kv: Any = None
        self._pushes: list[Handle] = []
        if kv is not None:
            self.bind(kv)

    @property
    def kv(self) -> Any:
        """The store that holds the table: the one given, or the one bound by the Trainer (its
        strategy's consistency), or on first use the process's default store (default_store)."""
        if self._kv is None:
            self.bind(default_store())
        return self._kv

    @property
    def bound(self) -> bool:
        return self._kv is not None

    def bind(self, kv: Any) -> None:
        """Declare the table (and its optimizer) on `kv`; every worker binds the same modules in
        the same order."""
        if self._kv is not None:
            raise ValueError(f"DistributedEmbedding {self.key!r} is already bound to a kvstore")
        if not isinstance(kv, SparseAPI):
            raise TypeError(
                f"{type(kv).__name__} has no sparse tables: use a kvstore with aggregation='process'"
            )
        config, optimizer, optimizer_args = self._table
        kv.init_table(self.key, self.dim, config)
        if optimizer is not None:
            kv.set_table_optimizer(self.key, optimizer, **optimizer_args)
        self._kv = kv

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows of `ids` (shape ids.shape + [dim]), or per bag as nn.EmbeddingBag does: `ids` 2-D
        (one bag per row), or 1-D with `offsets`. In training (module.training and grad enabled)
        absent rows are created and backward pushes the rows' gradients."""
        if self.mode is None and offsets is not None:
            raise ValueError("offsets are for bag modes: DistributedEmbedding(mode='sum' or 'mean')")
        tables = self.kv.tables
        route, where = tables.dedup(_ids(ids))
        train = self.training and torch.is_grad_enabled()
        handle, rows = tables.pull(self.key, route, train)
        # The last pushes are waited for only now: each server reads this pull after them (one
        # connection, in order), so their acknowledgements overlap the pull's trip.
        self.flush()
        handle.wait()
        where = where.view(ids.shape).to(ids.device)
        if train:
            rows.requires_grad_(True)
            rows.register_hook(self._pusher(route))
        weight = rows.to(ids.device)
        if self.mode is None:
            return F.embedding(where, weight)
        return F.embedding_bag(where, weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights)

    def _pusher(self, route: Route) -> Callable[[torch.Tensor], None]:
        def push(grad: torch.Tensor) -> None:
            self._pushes.append(self.kv.tables.push(self.key, route, grad))

        return push

    def flush(self) -> None:
        """Wait until the servers have every gradient this module pushed (raises their errors)."""
        pushes, self._pushes = self._pushes, []
        for handle in pushes:
            handle.wait()

    wait = flush

    def extra_repr(self) -> str:
        return f"key={self.key!r}, dim={self.dim}, mode={self.mode!r}"


def modules(model: nn.Module) -> list[DistributedEmbedding]:
    """The model's distributed embeddings (e.g. to `flush()` their pushes before a checkpoint)."""
    return [m for m in model.modules() if isinstance(m, DistributedEmbedding)]


# -- serving --------------------------------------------------------------------------------------
def load_export(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A table written by kv.export_table: {"key", "dim", "ids" (sorted), "values"}. Loads tensors
    and plain data only (no code runs)."""
    export = torch.load(path, weights_only=True)
    if not isinstance(export, dict) or export.get("format") != EXPORT_FORMAT:
        raise KVStoreError(f"{path} is not an exported paratrain table")
    return export


class ServingEmbedding(nn.Module):
    """An exported table for inference, in one process: ids are found by binary search in the
    sorted ids; ids the table does not hold read as zeros (as a pull that does not train does)."""

    def __init__(self, ids: torch.Tensor, values: torch.Tensor, mode: str | None = None) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"ServingEmbedding mode={mode!r} is not one of {MODES}")
        order = torch.argsort(ids)
        self.mode = mode
        self.register_buffer("ids", ids[order].contiguous())
        self.register_buffer("values", torch.cat([values[order], values.new_zeros(1, values.shape[1])]))

    @classmethod
    def from_export(cls, path: str | os.PathLike[str], mode: str | None = None) -> ServingEmbedding:
        export = load_export(path)
        return cls(export["ids"], export["values"], mode)

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        known, values = self.ids, self.values
        assert isinstance(known, torch.Tensor) and isinstance(values, torch.Tensor)  # buffers
        held = len(known)
        at = torch.searchsorted(known, ids.to(torch.int64)).clamp_(max=max(held - 1, 0))
        where = torch.where(known[at] == ids, at, held) if held else torch.zeros_like(at)
        if self.mode is None:
            return F.embedding(where, values)
        return F.embedding_bag(where, values, offsets, mode=self.mode, per_sample_weights=per_sample_weights)


def _discard(_: Any) -> None:
    """A handle's `after` step returns nothing (Tensor.copy_ returns its tensor)."""
