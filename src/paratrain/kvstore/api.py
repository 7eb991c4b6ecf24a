"""The kvstore's interface, its configuration and the MXNet kind names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    wait_warning_s: float = 60.0
    """A call that has waited this long for the servers (a pull for a round that some worker has
    not pushed) logs what it waits for and on whom, on this worker and on the server, and again
    every wait_warning_s after that; the wait itself ends at the transport's request_timeout_s."""
    refuse_non_finite: bool = False
    """Refuse a push holding NaN or infinite values (ValueError naming the key and the worker)
    before anything is sent, instead of letting it poison every worker's copy. Costs one pass
    over each pushed tensor."""
    frame_bytes: int = 1 << 20
    """A push or pull sends each server its slices in frames of about this many bytes (whole
    slices), interleaved across servers, so that a server applies and sends back the first slices
    while the rest still arrive (benchmarks/hosts.py)."""

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
        if not isinstance(self.wait_warning_s, (int, float)) or not self.wait_warning_s > 0:
            raise ValueError(f"KVStoreConfig.wait_warning_s={self.wait_warning_s!r} must be a number > 0")
        if not isinstance(self.refuse_non_finite, bool):
            raise ValueError(f"KVStoreConfig.refuse_non_finite={self.refuse_non_finite!r} must be a bool")
        if not isinstance(self.frame_bytes, int) or self.frame_bytes < 1:
            raise ValueError(f"KVStoreConfig.frame_bytes={self.frame_bytes!r} must be an int >= 1")


MAX_KEY_BYTES = 1024
"""The longest key name (UTF-8 bytes): every frame's header lists its keys, and headers are capped
(TransportConfig.max_header_bytes) by the receiver, which closes a connection that sends more."""
KEY_INTS = (-(1 << 63), (1 << 63) - 1)
"""Integer keys are int64s (the wire's integers)."""


def check_key(key: Any, what: str = "key") -> None:
    """Raise TypeError / ValueError for a key the wire cannot carry, before any state changes."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(f"{what} {key!r} is not an int or a str")
    if isinstance(key, int) and not KEY_INTS[0] <= key <= KEY_INTS[1]:
        raise ValueError(f"{what} {key} is outside the int64 range [-2**63, 2**63 - 1]")
    if isinstance(key, str):
        try:
            size = len(key.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise ValueError(f"{what} {key[:40]!r} is not valid Unicode text: {exc.reason}") from None
        if size > MAX_KEY_BYTES:
            raise ValueError(
                f"{what} {key[:40]!r}... is {size} bytes long; the limit is {MAX_KEY_BYTES} bytes (UTF-8)"
            )


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


# -- sparse tables (kvstore/sparse.py on the servers, kvstore/embedding.py on the workers) -----------
INITIALIZERS = ("zeros", "uniform", "normal")


@dataclass(frozen=True)
class TableConfig:
    """How a sparse table creates, keeps and drops rows. Limits are per server."""

    initializer: str = "uniform"
    """zeros, uniform (in [-init_scale, init_scale)) or normal (std init_scale). Drawn from a hash of
    the row's id and init_seed: a new row's value depends on nothing else (not on server or time)."""
    init_scale: float = 0.01
    """The initializer's scale (see initializer)."""
    init_seed: int = 0
    """Seeds the initializer's hash."""
    admit_after: int = 1
    """A row is created at the n-th training pull of its id; until then it reads as zeros and its
    gradients are dropped."""
    admit_probability: float = 1.0
    """From then on, each training pull creates it with this probability (a hash of id and step, so
    a replay decides the same)."""
    ttl_steps: int = 0
    """Rows not pulled or pushed for training in this many steps are evicted (0: never)."""
    max_rows: int = 0
    """Per server: past this many rows the least recently seen are evicted (0: no cap)."""
    max_bytes: int = 0
    """Per server: the same cap in bytes of rows held: value, optimizer state, bookkeeping (0: none)."""
    sweep_every: int = 1
    """How often, in steps, rows are checked against ttl_steps."""
    reserve_rows: int = 1024
    """Rows preallocated on each server; storage doubles when full."""

    def __post_init__(self) -> None:
        if self.initializer not in INITIALIZERS:
            raise ValueError(f"TableConfig.initializer={self.initializer!r} is not one of {INITIALIZERS}")
        if not isinstance(self.init_scale, (int, float)) or not self.init_scale >= 0:
            raise ValueError(f"TableConfig.init_scale={self.init_scale!r} must be a number >= 0")
        if not (isinstance(self.admit_probability, (int, float)) and 0 < self.admit_probability <= 1):
            raise ValueError(f"TableConfig.admit_probability={self.admit_probability!r} must be in (0, 1]")
        minimums = {"init_seed": 0, "admit_after": 1, "ttl_steps": 0, "max_rows": 0, "max_bytes": 0}
        minimums |= {"sweep_every": 1, "reserve_rows": 1}
        for name, least in minimums.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"TableConfig.{name}={value!r} must be an int >= {least}")


class TableError(ValueError):
    """A sparse-table request a server refuses; the worker gets the message."""


class SparseAPI:
    """The sparse-table half of a kvstore's API. The store's `tables` object (embedding.TableClient
    with servers, embedding.LocalTables without) does the work."""

    tables: Any

    def init_table(self, key: Any, dim: int, config: TableConfig | None = None) -> None:
        """Declare table `key` of float32 rows of `dim` values, addressed by int64 ids and sharded
        by a hash of the id. Every worker declares the same tables with the same config."""
        self.tables.init_table(key, dim, config or TableConfig())

    def row_sparse_pull(self, key: Any, out: Any, row_ids: Any, *, train: bool = True) -> int | None:
        """out[i] = the row of row_ids[i] (out: float32 [len(row_ids), dim]); each unique id moves
        once. `train`: absent rows are created (after admission) and rows count as seen; otherwise
        absent rows read as zeros and nothing changes. Returns the table's version pulled."""
        return self.tables.row_sparse_pull(key, out, row_ids, train=train)

    def push_sparse(self, key: Any, row_ids: Any, grads: Any) -> Any:
        """Push gradients for rows (grads[i] for row_ids[i]; repeated ids are summed first) and
        return a handle at once. Consistency as for dense keys."""
        return self.tables.push_sparse(key, row_ids, grads)

    def set_table_optimizer(self, key: Any, optimizer: Any, **hyperparameters: Any) -> None:
        """The table's own lazy optimizer: torch.optim.SGD, Adagrad or Adam (SparseAdam), by class
        or path. Without one a table follows set_optimizer, where that optimizer has a sparse form."""
        self.tables.set_table_optimizer(key, optimizer, hyperparameters)

    def table_stats(self, key: Any) -> list[dict[str, Any]]:
        """Per server: rows and bytes held, reserved bytes, admission, eviction and traffic counts."""
        return self.tables.table_stats(key)

    def export_table(self, key: Any, path: Any) -> None:
        """Write the table's ids and rows (no optimizer state) for serving; every worker calls it,
        worker 0 writes. Load with embedding.ServingEmbedding.from_export(path)."""
        self.tables.export_table(key, path)
