"""paratrain's key-value store: MXNet's kvstore API on paratrain's parameter servers.

kv = paratrain.kvstore.create("dist_sync")      # or dist_async, dist_*_device, local, a KVStoreConfig
kv.init(keys, values); kv.push(keys, grads).wait(); kv.pull(keys, out=outs)
"""

from __future__ import annotations

from typing import Any

from paratrain.kvstore.api import KINDS, KVStoreConfig, resolve_kind

__all__ = ["KINDS", "KVStoreConfig", "create"]


def create(kind: str | KVStoreConfig = "local", ctx: Any = None) -> Any:
    """A kvstore for this worker. `ctx` defaults to the one `paratrain.init()` returned."""
    config = resolve_kind(kind)
    if config.local:
        from paratrain.kvstore.local import LocalKVStore

        return LocalKVStore(config)
    import paratrain
    from paratrain.kvstore.client import DistKVStore

    ctx = ctx or paratrain.init()
    if not ctx.distributed:
        from paratrain.kvstore.local import LocalKVStore

        return LocalKVStore(config)  # a script run alone: same semantics, one worker
    if config.aggregation == "host":
        from paratrain.kvstore.device import HostKVStore

        return HostKVStore(ctx, config)
    return DistKVStore(ctx, config)
