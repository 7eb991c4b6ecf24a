"""The kvstore's interface, its configuration and the MXNet kind names."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.kvstore.placement import DEFAULT_SLICE_ELEMENTS

CONSISTENCY = ("sync", "async", "bounded")
AGGREGATION = ("process", "host")


@dataclass(frozen=True)
class KVStoreConfig:
    consistency: str = "sync"
    """sync: every round waits for all workers; async: pushes apply on arrival; bounded: a worker may
    run at most `staleness` rounds ahead of the slowest."""
    staleness: int = 0
    """The bound s of bounded consistency (0 is sync)."""
    aggregation: str = "process"
    """process: every worker talks to the servers; host: workers of one host reduce first and one of
    them talks to the servers (MXNet's *_device modes)."""
    slice_elements: int = DEFAULT_SLICE_ELEMENTS
    """Keys with more elements than this are sliced across all servers."""
    local: bool = False
    """Keep everything in this process (MXNet's `local` / `device`): no servers."""

    def __post_init__(self) -> None:
        if self.consistency not in CONSISTENCY:
            raise ValueError(f"KVStoreConfig.consistency={self.consistency!r} is not one of {CONSISTENCY}")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"KVStoreConfig.staleness={self.staleness!r} must be an int >= 0")
        if self.staleness and self.consistency != "bounded":
            raise ValueError(
                f"KVStoreConfig.staleness={self.staleness!r} needs consistency='bounded', "
                f"not {self.consistency!r}"
            )
        if self.aggregation not in AGGREGATION:
            raise ValueError(f"KVStoreConfig.aggregation={self.aggregation!r} is not one of {AGGREGATION}")
        if not isinstance(self.slice_elements, int) or self.slice_elements < 1:
            raise ValueError(f"KVStoreConfig.slice_elements={self.slice_elements!r} must be an int >= 1")


KINDS = {
    "local": KVStoreConfig(local=True),
    "device": KVStoreConfig(local=True),
    "dist_sync": KVStoreConfig(),
    "dist_async": KVStoreConfig(consistency="async"),
    "dist_sync_device": KVStoreConfig(aggregation="host"),
    "dist_async_device": KVStoreConfig(consistency="async", aggregation="host"),
}


def resolve_kind(kind: str | KVStoreConfig) -> KVStoreConfig:
    if isinstance(kind, KVStoreConfig):
        return kind
    if kind not in KINDS:
        raise ValueError(f"kvstore kind {kind!r} is not one of {', '.join(KINDS)} or a KVStoreConfig")
    return KINDS[kind]
