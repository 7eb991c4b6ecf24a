"""Embedding tables read from a running job's servers: a read-only client that is not a node.

    paratrain serve --join --model examples/ctr.py:serving_model --input dense:float32:13 \
                    --input ids:int64:26 ckpt/        # PARATRAIN_SCHEDULER, PARATRAIN_SECRET set

`join_tables()` asks the job's scheduler where the servers are (op "roster": no registration, no
rank, no heartbeat; the scheduler's membership, barriers and rounds never count it, and its leaving
ends nothing) and connects to every server with the job's secret. The store it returns is what a
factory's `DistributedEmbedding(kv=...)` tables take: `init_table` only records the table, a pull
never trains (rows are not created, nothing is marked seen, no clock moves, so no round waits for
it), and pushes or optimizer changes are refused or ignored. Rows that no training pull created
yet come back as zeros, as for an evaluating worker. Only the rows a batch needs are pulled, those
not in a small cache: at most `cache_rows` rows per table, each served for `cache_ttl_s` seconds
after it was pulled, the least recently used dropped first. The dense part of the model comes from
the newest checkpoint (model.py reloads it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from paratrain.cluster.protocol import Roster, RosterQuery
from paratrain.cluster.spec import client_credentials
from paratrain.errors import KVStoreError, RemoteError, TransportError
from paratrain.kvstore.api import Handle, KVStoreConfig, SparseAPI, TableConfig, check_key
from paratrain.kvstore.worker.embedding import Route as IdRoute
from paratrain.kvstore.worker.embedding import TableClient, TableInfo
from paratrain.serve.api import BadRequest, ServeError
from paratrain.transport.client import RpcClient

logger = logging.getLogger(__name__)


class RowCache:
    """Rows by id, at most `max_rows`, each valid for `ttl_s` after it was stored (LRU order)."""

    def __init__(self, max_rows: int, ttl_s: float) -> None:
        self.max_rows, self.ttl_s = max_rows, ttl_s
        self._rows: OrderedDict[int, tuple[float, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, ids: np.ndarray, now: float) -> tuple[dict[int, torch.Tensor], np.ndarray]:
        """(fresh cached rows by position in ids, positions to pull)."""
        found, missing = {}, []
        with self._lock:
            for i, row_id in enumerate(ids.tolist()):
                entry = self._rows.get(row_id)
                if entry is not None and now - entry[0] < self.ttl_s:
                    self._rows.move_to_end(row_id)
                    found[i] = entry[1]
                else:
                    missing.append(i)
        return found, np.asarray(missing, dtype=np.int64)

    def put(self, ids: np.ndarray, rows: torch.Tensor, now: float) -> None:
        if self.max_rows == 0:
            return
        with self._lock:
            for row_id, row in zip(ids.tolist(), rows, strict=True):
                self._rows[row_id] = (now, row.clone())
                self._rows.move_to_end(row_id)
            while len(self._rows) > self.max_rows:
                self._rows.popitem(last=False)


class ReadOnlyTables(TableClient):
    """TableClient over the job's servers that reads, through a RowCache per table, and never writes."""

    def __init__(
        self, clients: list[RpcClient], cache_rows: int, cache_ttl_s: float, timeout_s: float
    ) -> None:
        # No worker rank: a serving process is no worker, and the servers count its reads nowhere.
        super().__init__(clients, None, KVStoreConfig(), lambda name: None, timeout_s)  # type: ignore[arg-type]
        self.cache_rows, self.cache_ttl_s = cache_rows, cache_ttl_s
        self.caches: dict[Any, RowCache] = {}
        self.counts = {"rows_asked": 0, "rows_pulled": 0}

    def init_table(self, key: Any, dim: int, config: TableConfig) -> None:
        check_key(key, "table key")
        self.tables.setdefault(key, TableInfo(dim, config))  # the job declared it; nothing is sent
        self.caches.setdefault(key, RowCache(self.cache_rows, self.cache_ttl_s))

    def set_table_optimizer(self, key: Any, optimizer: Any, hyper: dict[str, Any]) -> None:
        logger.debug("read-only: table %r keeps the optimizer the training job gave it", key)

    def push(self, key: Any, route: IdRoute, grads: torch.Tensor) -> Any:
        raise KVStoreError(f"table {key!r}: a serving process reads the job's tables and never pushes")

    def pull(self, key: Any, route: IdRoute, train: bool) -> tuple[Handle, torch.Tensor]:
        """The rows of route.ids (in route order): fresh ones from the cache, the rest from the servers."""
        if train:
            raise KVStoreError(f"table {key!r}: a serving process cannot train (run the model in eval mode)")
        info, cache = self._info(key), self.caches[key]
        ids = route.ids.numpy()
        rows = torch.empty(len(ids), info.dim)
        found, missing = cache.get(ids, time.monotonic())
        if found:
            at = torch.as_tensor(list(found), dtype=torch.int64)
            rows[at] = torch.stack(list(found.values()))
        if len(missing):
            pulled = self._pull_from_servers(key, route.ids[torch.from_numpy(missing)])
            rows[torch.from_numpy(missing)] = pulled
            cache.put(ids[missing], pulled, time.monotonic())
        self.counts["rows_asked"] += len(ids)
        self.counts["rows_pulled"] += len(missing)
        return Handle(futures=[], what=f"read of table {key!r}"), rows  # complete: nothing to wait for

    def _pull_from_servers(self, key: Any, ids: torch.Tensor) -> torch.Tensor:
        sub = self.route(ids)  # regrouped by server (a no-op order for one server)
        handle, rows = super().pull(key, sub, train=False)
        handle.wait()
        return rows if sub.index is None else rows[sub.index]

    def lookup(self, key: Any, ids: torch.Tensor) -> torch.Tensor:
        """Rows of `ids` (1-D int64) as the model sees them."""
        route, where = self.dedup(ids)
        handle, rows = self.pull(key, route, train=False)
        handle.wait()
        return rows[where]

    def close(self) -> None:
        for client in self._clients:
            client.close()


class ReadOnlyStore(SparseAPI):
    """The kvstore a serving factory gives its DistributedEmbeddings (see the module docstring)."""

    def __init__(self, tables: ReadOnlyTables, servers: list[tuple[str, int]]) -> None:
        self.tables, self.servers = tables, servers

    def close(self) -> None:
        self.tables.close()


def join_tables(
    *,
    cache_rows: int = 100_000,
    cache_ttl_s: float = 1.0,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> ReadOnlyStore:
    """A ReadOnlyStore on the servers of the job named by PARATRAIN_SCHEDULER / PARATRAIN_SECRET(_FILE)
    in `env` (default: this process's environment); waits up to `timeout_s` for the job to start."""
    try:
        host, port, secret = client_credentials(env)
    except ValueError as exc:
        raise ServeError(f"--join: {exc}") from None
    servers = _servers(host, port, secret, timeout_s)
    if not servers:
        raise ServeError(f"the job of the scheduler at {host}:{port} has no servers to read tables from")
    clients = [
        RpcClient(h, p, secret, name=f"server {rank} ({h}:{p})", origin="a serving process")
        for rank, (h, p) in enumerate(servers)
    ]
    logger.info("joined the job at %s:%d read-only: %d server(s)", host, port, len(servers))
    return ReadOnlyStore(ReadOnlyTables(clients, cache_rows, cache_ttl_s, timeout_s), servers)


def _servers(host: str, port: int, secret: bytes, timeout_s: float) -> list[tuple[str, int]]:
    deadline = time.monotonic() + timeout_s
    scheduler = RpcClient(
        host, port, secret, name=f"the scheduler ({host}:{port})", origin="a serving process"
    )
    try:
        while True:
            try:
                reply = scheduler.call(*RosterQuery().wire(), timeout_s=timeout_s)
                return [(str(h), int(p)) for h, p in Roster.from_meta(reply.meta).servers]
            except RemoteError as exc:  # not started yet: every node must register first
                if time.monotonic() > deadline:
                    raise ServeError(
                        f"the job at {host}:{port} did not start within {timeout_s} s: {exc}"
                    ) from None
                time.sleep(0.2)
            except (TransportError, TimeoutError) as exc:
                raise ServeError(f"the scheduler at {host}:{port} did not answer: {exc}") from None
    finally:
        scheduler.close()


def embeddings_route(store: ReadOnlyStore) -> Route:
    """POST /embeddings {"table": key, "ids": [...]} -> {"rows": [[...], ...]}: the rows the model
    would use for those ids (zeros for rows the job never created)."""

    async def embeddings(request: Request) -> JSONResponse:
        try:
            doc = await request.json()
            key, ids = doc["table"], torch.tensor(doc["ids"], dtype=torch.int64).reshape(-1)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise BadRequest(400, f'send {{"table": name, "ids": [ints]}}: {exc}') from None
        if key not in store.tables.tables:
            raise BadRequest(
                404, f"no table {key!r}; the model reads {sorted(map(str, store.tables.tables))}"
            )
        rows = await run_in_threadpool(store.tables.lookup, key, ids)  # a blocking pull: off the loop
        return JSONResponse({"table": key, "ids": ids.tolist(), "rows": rows.tolist()})

    return Route("/embeddings", _answer_bad_requests(embeddings), methods=["POST"])


def _answer_bad_requests(handler):  # noqa: ANN001, ANN202
    async def wrapped(request: Request) -> JSONResponse:
        try:
            return await handler(request)
        except BadRequest as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        except KVStoreError as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)

    return wrapped
