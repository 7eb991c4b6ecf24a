"""paratrain's key-value store: MXNet's kvstore API on paratrain's parameter servers.

kv = paratrain.kvstore.create("dist_sync")      # or dist_async, dist_*_device, local, a KVStoreConfig
kv.init(keys, values); kv.push(keys, grads).wait(); kv.pull(keys, out=outs)
kv.init_table("ads", 16); kv.row_sparse_pull("ads", out=rows, row_ids=ids)   # sparse tables
emb = paratrain.kvstore.DistributedEmbedding("ads", 16, mode="sum")            # ... as a module
"""

from __future__ import annotations

from typing import Any

from paratrain.kvstore.api import KINDS, KVStoreConfig, TableConfig, resolve_kind

__all__ = ["KINDS", "DistributedEmbedding", "KVStoreConfig", "ServingEmbedding", "TableConfig", "create"]


def __getattr__(name: str) -> Any:
    # Lazy: the embedding module imports the client, the server's table code and torch.nn.
    if name in ("DistributedEmbedding", "ServingEmbedding"):
        from paratrain.kvstore import embedding

        return getattr(embedding, name)
    raise AttributeError(f"module 'paratrain.kvstore' has no attribute {name!r}")


def create(kind: str | KVStoreConfig = "local", ctx: Any = None) -> Any:
    """A kvstore for this worker. `ctx` defaults to the one `paratrain.init()` returned."""
    config = resolve_kind(kind)
    if config.local:
        from paratrain.kvstore.embedding import LocalSparseKVStore

        return LocalSparseKVStore(config)  # LocalKVStore with sparse tables
    from paratrain.cluster.context import current
    from paratrain.kvstore.client import DistKVStore

    ctx = current(ctx)
    if not ctx.distributed:
        from paratrain.kvstore.embedding import LocalSparseKVStore

        return LocalSparseKVStore(config)  # a script run alone: same semantics, one worker
    if config.aggregation == "host":
        from paratrain.kvstore.device import HostKVStore

        return HostKVStore(ctx, config)
    return DistKVStore(ctx, config)
