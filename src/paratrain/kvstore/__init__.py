"""paratrain's key-value store: MXNet's kvstore API on paratrain's parameter servers.

kv = paratrain.kvstore.create("dist_sync")      # or dist_async, dist_*_device, local, a KVStoreConfig
kv.init(keys, values); kv.push(keys, grads).wait(); kv.pull(keys, out=outs)
kv.init_table("ads", 16); kv.row_sparse_pull("ads", out=rows, row_ids=ids)   # sparse tables
emb = paratrain.kvstore.DistributedEmbedding("ads", 16, mode="sum")            # ... as a module
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from paratrain.kvstore.api import (
    KINDS,
    Handle,
    KVError,
    KVStore,
    KVStoreConfig,
    KVStoreTimeoutError,
    TableConfig,
    TableError,
    resolve_kind,
)

if TYPE_CHECKING:
    from paratrain.cluster.context import Context

__all__ = [
    "KINDS",
    "KVError",
    "KVStore",
    "KVStoreTimeoutError",
    "TableError",
    "DistKVStore",
    "DistributedEmbedding",
    "Handle",
    "HostKVStore",
    "KVStoreConfig",
    "LocalKVStore",
    "LocalSparseKVStore",
    "ServingEmbedding",
    "TableConfig",
    "create",
]

# Lazy: the stores import torch, the client, the server's table code and torch.nn.
_LAZY = {
    "DistKVStore": "paratrain.kvstore.worker.client",
    "HostKVStore": "paratrain.kvstore.worker.device",
    "LocalKVStore": "paratrain.kvstore.worker.local",
    "LocalSparseKVStore": "paratrain.kvstore.worker.local_sparse",
    "DistributedEmbedding": "paratrain.kvstore.worker.embedding",
    "ServingEmbedding": "paratrain.kvstore.worker.embedding",
    "TableClient": "paratrain.kvstore.worker.embedding",
    "KVServer": "paratrain.kvstore.server.server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paratrain.kvstore' has no attribute {name!r}")


def create(kind: str | KVStoreConfig = "local", ctx: Context | None = None) -> KVStore:
    """A kvstore for this worker. `ctx` defaults to the one `paratrain.init()` returned."""
    config = resolve_kind(kind)
    if config.local:
        from paratrain.kvstore.worker.local_sparse import LocalSparseKVStore

        return LocalSparseKVStore(config)  # LocalKVStore with sparse tables
    from paratrain.cluster.context import current
    from paratrain.kvstore.worker.client import DistKVStore

    ctx = current(ctx)
    if not ctx.distributed:
        from paratrain.kvstore.worker.local_sparse import LocalSparseKVStore

        return LocalSparseKVStore(config)  # a script run alone: same semantics, one worker
    if config.aggregation == "host":
        from paratrain.kvstore.worker.device import HostKVStore

        return HostKVStore(ctx, config)
    return DistKVStore(ctx, config)
