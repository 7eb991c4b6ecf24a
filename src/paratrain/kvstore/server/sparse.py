"""Sparse tables on a server: embedding rows addressed by 64-bit ids, created on first use. This
module is the wire side; one table's shard (its rows, rounds, updates and eviction) is a
`SparseTable` (sparse_table.py), stored in rowstore.py, updated by sparse_optim.py.

Protocol (the messages' types: kvstore/protocol.py; `SparseTables.handlers` is KVServer's table for
them):

    sparse_init       {key, dim, config}                      every worker; the first one creates
    sparse_pull       {key, clock, min_version, train, rank}  ids -> rows (zeros for absent ids)
    sparse_push       {key, clock, rank}                      unique ids, their gradients
    sparse_optimizer  {key, path, hyper}                      the table's own optimizer
    sparse_stats      {key}
    sparse_get_state  {key | None, full}                      tables by id: rows (+ ages and state)
    sparse_set_state  {key, names, step}                      replace a table's rows
    sparse_waiting    {key, min_version, rank}                from a worker whose pull waits long:
                                                              the round and who has not pushed it
    sparse_replicate  {key, primary, version, ...}            a delta of a primary's rows, to its
                                                              backups (sparse_replica.py)
    sparse_install    {key, primary, dim, config, chain, ...}  every row of a table, to a restarted
                                                              server that rejoins (rejoin.py)

With replication (sparse_replica.py) a worker's requests also carry `primary`, the server whose rows
they address (this server's own, or a copy of another's), and `sparse_init` the chains this server is
on; a push is acknowledged once its update is on the backups.

Consistency is the dense keys' (server.py): in rounds mode a worker's n-th push joins round n, applied
once every member pushed (pushes summed per id in rank order, then one update); a pull waits until the
table's version reaches its min_version. In async mode a push applies on arrival.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from paratrain.kvstore import protocol as p
from paratrain.kvstore.api import TableConfig, TableError
from paratrain.kvstore.server.sparse_optim import SparseOptimizer, build_optimizer
from paratrain.kvstore.server.sparse_replica import TableReplicas, adopt, install
from paratrain.kvstore.server.sparse_table import PendingRows, SparseTable
from paratrain.transport.message import Routes

logger = logging.getLogger(__name__)

__all__ = ["SparseTables"]


class SparseTables:
    """The sparse ops of one KVServer; reads its rules (consistency policy, members) and default
    optimizer."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.tables: dict[Any, SparseTable] = {}
        self.copies: dict[tuple[Any, int], SparseTable] = {}
        """Replicated servers: other servers' rows of each table, by (key, primary) (sparse_replica.py)."""
        self._lock = threading.Lock()
        self._default: tuple[str, dict] | None = None
        self._replicas: TableReplicas | None = None
        self._routes = Routes(self.handlers())

    @property
    def replicas(self) -> TableReplicas | None:
        """Copying rows to the backups (sparse_replica.py); None without replication."""
        replicator = getattr(self.server, "replicator", None)
        if replicator is None or not replicator.enabled:
            return None
        with self._lock:
            if self._replicas is None:
                self._replicas = TableReplicas(replicator, self.serve_ready)
            return self._replicas

    def all_tables(self, key: Any = None) -> list[SparseTable]:
        """This server's tables (or those of `key`): its own rows and its copies."""
        with self._lock:
            tables = [*self.tables.values(), *self.copies.values()]
        return [t for t in tables if key is None or t.key == key]

    def handle(self, request: Any) -> None:
        """A sparse request on its own (KVServer routes them with its other ops: `handlers`)."""
        self._routes.serve(request)

    def handlers(self) -> dict:
        """The sparse ops' part of the server's table: message type -> handler(request, message)."""
        return {
            p.SparsePull: self._pull,
            p.SparsePush: self.push,
            p.SparseInit: self._on_init,
            p.SparseOptimizer: self._set_optimizer,
            p.SparseReplicate: self._replicate,
            p.SparseInstall: lambda request, _: self._install(request),
            p.SparseStats: self._stats,
            p.SparseGetState: self._get_state,
            p.SparseWaiting: lambda request, query: request.reply({"waits": self._waiting(query)}),
            p.SparseSetState: self._set_state,
        }

    def _on_init(self, request: Any, msg: p.SparseInit) -> None:
        self._init(msg.key, msg.dim, TableConfig(**msg.config), msg.chains)
        request.reply({})

    def _set_optimizer(self, request: Any, msg: p.SparseOptimizer) -> None:
        self._table(msg.key)
        for table in self.all_tables(msg.key):  # with replication, the copies too
            built = build_optimizer(msg.path, msg.hyper)
            with table.lock:
                table.set_optimizer(built)
                table.own_optimizer = True
        request.reply({})

    def _replicate(self, request: Any, msg: p.SparseReplicate) -> None:
        replicas = self.replicas
        if replicas is None:
            raise TableError(f"server {self.server.rank} keeps no copies: replication is off")
        table = self._copy_of(msg)
        if table is None:  # while catching up after a restart: that table's transfer follows
            request.reply({})
            return
        replicas.restore(table, request)

    def _stats(self, request: Any, msg: p.SparseStats) -> None:
        table = self._table(msg.key, msg.primary)
        with table.lock:
            stats = table.stats()
        request.reply(stats)

    def _set_state(self, request: Any, msg: p.SparseSetState) -> None:
        table = self._table(msg.key, msg.primary)
        with table.lock:
            table.load(list(msg.names), request.tensors)
        request.reply({})

    def _waiting(self, query: p.SparseWaiting) -> list[dict]:
        """What holds a waiting worker's pull back: the table's next round and the members that
        have not pushed it (logged here too, so that the wait is not silent on this side)."""
        table, need = self._table(query.key, query.primary), query.min_version
        members = frozenset(self.server.members)
        with table.lock:
            if table.version >= need:
                return []
            round_, missing = table.version, sorted(members - set(table.rounds.get(table.version, {})))
        logger.warning(
            "server %d: worker %s waits for round %d of table %r, which worker(s) %s have not pushed",
            self.server.rank,
            query.rank,
            round_,
            table.key,
            ", ".join(map(str, missing)) or "none (being applied)",
        )
        return [{"kind": "table", "key": table.key, "round": round_, "missing": missing}]

    def _table(self, key: Any, primary: int | None = None) -> SparseTable:
        """The table's rows of server `primary` (None: this server's own)."""
        if primary is not None and primary != self.server.rank:
            table = self.copies.get((key, primary))
            if table is None:
                raise TableError(
                    f"server {self.server.rank} keeps no copy of server {primary}'s rows of table {key!r}"
                )
            return table
        table = self.tables.get(key)
        if table is None:
            raise TableError(f"table {key!r} is not on server {self.server.rank}: call init_table first")
        return table

    def _copy_of(self, msg: p.SparseReplicate) -> SparseTable | None:
        """The table a delta is for; None where this server is a restarted one catching up and has
        no transfer of it yet (rejoin.py: the transfer, taken after the delta, is newer)."""
        try:
            return self._table(msg.key, msg.primary)
        except TableError:
            if not self.server.replicator.catching_up:
                raise
            return None

    def _install(self, request: Any) -> None:
        """Op sparse_install: a table's rows, sent to this restarted server by the server that
        serves them (sparse_replica.send_tables); made here afresh, then the deltas follow."""
        meta, replicas = request.meta, self.replicas
        if replicas is None:
            raise TableError(f"server {self.server.rank} keeps no copies: replication is off")
        chain, key = [int(s) for s in meta["chain"]], meta["key"]
        optimizer = build_optimizer(*meta["optimizer"]) if meta["optimizer"] else None
        table = SparseTable(key, int(meta["dim"]), TableConfig(**meta["config"]), optimizer)
        table.own_optimizer = bool(meta["own_optimizer"])
        replicas.attach(table, chain)
        with table.lock:
            install(table, meta, request.tensors)
            assert table.replica is not None  # attached above
            table.replica.source = request.conn  # drained before this copy serves (TableReplicas.serve)
        with self._lock:
            if chain[0] == self.server.rank:
                self.tables[key] = table
            else:
                self.copies[(key, chain[0])] = table
        request.reply({})

    def _serving(self, msg: p.SparsePull | p.SparsePush) -> SparseTable:
        """The table a worker's pull or push is for; with replication, a copy whose primary died
        first takes every delta that primary sent (sparse_replica.py)."""
        table = self._table(msg.key, msg.primary)
        replicas = self.replicas
        if replicas is not None:
            replicas.serve(table, msg.dead or [])
        return table

    def _init(self, key: Any, dim: int, config: TableConfig, chains: list | None = None) -> None:
        """Creates or checks the table; with replication, one per chain this server is on (its
        own rows and its copies of other servers')."""
        if not isinstance(dim, int) or dim < 1:
            raise TableError(f"table {key!r}: dim={dim!r} must be an int >= 1")
        replicas = self.replicas
        chains = [[int(s) for s in chain] for chain in chains or []] if replicas is not None else []
        with self._lock:
            for chain in chains or [[self.server.rank]]:
                own = chain[0] == self.server.rank
                table = self.tables.get(key) if own else self.copies.get((key, chain[0]))
                if table is None:
                    table = SparseTable(key, dim, config, self._default_optimizer(key))
                    if replicas is not None:
                        replicas.attach(table, chain)
                    if own:
                        self.tables[key] = table
                    else:
                        self.copies[(key, chain[0])] = table
                elif (table.dim, table.config) != (dim, config):
                    raise TableError(
                        f"table {key!r} was declared with dim {table.dim} and {table.config}; "
                        f"dim {dim} and {config} is not allowed"
                    )

    def _default_optimizer(self, key: Any) -> SparseOptimizer | None:
        """The sparse form of the store's optimizer; none (until set_table_optimizer) where it has none."""
        if self._default is None:
            return None
        try:
            return build_optimizer(*self._default)
        except TableError as exc:
            logger.warning("table %r starts without an optimizer: %s", key, exc)
            return None

    def set_default_optimizer(self, path: str, hyper: dict) -> None:
        """The store's optimizer (set_optimizer) becomes that of every table without its own."""
        with self._lock:
            tables = [t for t in [*self.tables.values(), *self.copies.values()] if not t.own_optimizer]
            built = [build_optimizer(path, hyper) for _ in tables]  # refuse before changing anything
            self._default = (path, hyper)
        for table, optimizer in zip(tables, built, strict=True):
            with table.lock:
                table.set_optimizer(optimizer)

    def members_changed(self) -> None:
        """A worker left: rounds stop waiting for it."""
        for table in self.all_tables():
            with table.lock:
                table.apply_complete_rounds(frozenset(self.server.members))
                ready = self._take_ready(table)
            self._send(ready)

    # -- pull and push ----------------------------------------------------------------------------
    def _pull(self, request: Any, msg: p.SparsePull) -> None:
        table = self._serving(msg)
        ids = self._ids(request, table)
        pull = PendingRows(request, ids, msg.clock, msg.min_version, msg.train)
        pull.rank = msg.rank
        with table.lock:
            ready = self._catch_up(table)
            if table.broken is not None:
                self._send(ready)
                raise TableError(table.broken)
            if table.visible < pull.min_version:
                if request.header.at is not None:  # a view of the shared-memory ring: keep a copy
                    pull.ids = ids.copy()
                pull.hint = table.find(ids)  # while the round's pushes come in (SparseTable.find)
                table.pending.append(pull)
                rows = None
            else:
                rows, version = table.read(ids, pull.clock, pull.train, pull.rank), table.version
        self._send(ready)
        if rows is not None:
            request.reply({"versions": [version]}, [rows])

    def push(self, request: Any, msg: p.SparsePush) -> None:
        table = self._serving(msg)
        ids = self._ids(request, table)
        grads = request.tensors[1]
        if grads.dtype != torch.float32 or tuple(grads.shape) != (len(ids), table.dim):
            raise TableError(
                f"push to table {table.key!r}: gradients must be float32 [{len(ids)}, {table.dim}]"
            )
        rules = self.server.rules
        members, policy = rules.members, rules.policy
        holds = policy.holds_pushes()  # until its round completes; else applied now
        borrowed = request.header.at is not None and holds  # views of the ring until this call returns
        with table.lock:
            rank, clock = msg.rank, msg.clock
            copy = table.replica
            repeat = copy is not None and copy.repeat(table, rank, clock, holds)  # after a fail-over
            if copy is not None and copy.promoted and not repeat:  # rows the dead primary made
                adopt(table, ids, clock)
            if borrowed and not repeat and not table.completes(rank, clock, members):
                ids, grads = ids.copy(), grads.clone()  # kept past this call (the round's last is not)
            if not repeat:
                table.push(rank, clock, ids, grads, policy, members, apply=not holds)
            if copy is not None:  # acknowledged once its update is on the backups (sparse_replica.py)
                need = policy.durable_after(clock, table.version)
                table.pending.append(PendingRows(request, None, clock, need, False))
            ready = [] if holds and not repeat else self._take_ready(table)
        if repeat:
            self._send(ready)
            return
        if copy is None:
            request.reply({})  # in rounds modes a push is done once it joined its round
        if holds:  # the round's update runs while the pusher goes on to its next step
            ready = self._apply_rounds(table, members)
        self._send(ready)

    def _apply_rounds(self, table: SparseTable, members: frozenset) -> list:
        """Apply the table's complete rounds; the pulls that may go on. A round that fails to apply
        fails the waiting pulls and every later one: workers get the error, never a hang."""
        with table.lock:
            return self._applied(table, members)

    def _applied(self, table: SparseTable, members: frozenset) -> list:
        """_apply_rounds, holding table.lock."""
        try:
            table.apply_complete_rounds(members)
        except Exception as exc:
            logger.exception("table %r: a round failed to apply", table.key)
            table.broken = f"server {self.server.rank}: table {table.key!r} could not apply a round: {exc!r}"
        if table.broken is not None:
            failed, table.pending = table.pending, []
            return [(pull.request, None, table.broken) for pull in failed]
        return self._take_ready(table)

    def _catch_up(self, table: SparseTable) -> list:
        """Before a read (holds table.lock): apply a round whose pushes were all acknowledged but
        that its last pusher's thread has not applied yet (it replies first, _push). So a request
        sent after a round's pushes were acknowledged sees that round, as with dense keys (whose
        rounds apply before the reply): e.g. a bounded pull after kv.barrier() sees every round.
        Returns the pulls that may go now."""
        members = self.server.rules.members
        waiting = table.rounds.get(table.version)
        if waiting is None or not members.issubset(waiting):
            return []
        return self._applied(table, members)

    @staticmethod
    def _ids(request: Any, table: SparseTable) -> np.ndarray:
        ids = request.tensors[0] if request.tensors else None
        if ids is None or ids.dtype != torch.int64 or ids.dim() != 1:
            raise TableError(f"request for table {table.key!r} must carry a 1-D int64 tensor of ids")
        return ids.numpy()

    @staticmethod
    def _take_ready(table: SparseTable) -> list[tuple[Any, torch.Tensor | None, int | str]]:
        """Serve the pulls the table's version now allows (holds table.lock)."""
        ready: list[tuple[Any, torch.Tensor | None, int | str]] = []
        waiting = []
        for pull in table.pending:
            if table.visible < pull.min_version:
                waiting.append(pull)
                continue
            if pull.ids is None:  # a replicated push's acknowledgement: no rows
                ready.append((pull.request, None, table.version))
                continue
            try:
                rows = table.read(pull.ids, pull.clock, pull.train, pull.rank, pull.hint)
                ready.append((pull.request, rows, table.version))
            except Exception as exc:  # that pull fails, not this push
                ready.append((pull.request, None, f"server: {exc!r}"))
        table.pending = waiting
        return ready

    @staticmethod
    def _send(ready: list[tuple[Any, torch.Tensor | None, int | str]]) -> None:
        for request, rows, version in ready:
            if isinstance(version, str):
                request.fail(version)
            elif rows is None:
                request.reply({})
            else:
                request.reply({"versions": [version]}, [rows])

    def close(self) -> None:
        """The server ends: the thread confirming the backups' copies ends first (replies.py)."""
        if self._replicas is not None:
            self._replicas.close()

    def serve_ready(self, table: SparseTable) -> None:
        """Serve the table's pulls and acknowledgements that may go now (its durable version moved)."""
        with table.lock:
            ready = self._take_ready(table)
        self._send(ready)

    # -- state ------------------------------------------------------------------------------------
    def _get_state(self, request: Any, msg: p.SparseGetState) -> None:
        key, full = msg.key, msg.full
        primary = msg.primary  # with replication: that server's rows, from a copy
        with self._lock:
            if primary is not None and primary != self.server.rank:
                tables = [t for (k, at), t in self.copies.items() if at == primary and key in (None, k)]
            else:
                tables = [self._table(key)] if key is not None else list(self.tables.values())
        entries, tensors = [], []
        for table in tables:
            with table.lock:
                ready = self._catch_up(table)
                meta, parts = table.state(full)
            self._send(ready)
            entries.append(meta | {"tensors": len(parts)})
            tensors += parts
        request.reply({"tables": entries}, tensors)
