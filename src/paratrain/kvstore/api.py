"""The kvstore's contract: the `KVStore` protocol every store implements (`create()` returns one),
its `Handle`, key types, configuration, the MXNet kind names, and the kvstore's errors (all under
errors.KVStoreError, below the package's root ParatrainError).

Implementations: worker/client.py (DistKVStore: the job's servers), worker/device.py (HostKVStore:
a host's workers reduce first), worker/local.py and worker/embedding.py (LocalKVStore and
LocalSparseKVStore: one process). The server side is server/.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from paratrain.cluster import stacks
from paratrain.errors import KVStoreError, RemoteError, TransportError
from paratrain.kvstore.consistency import Async, Policy, Sync, parse
from paratrain.kvstore.placement import DEFAULT_SLICE_ELEMENTS

if TYPE_CHECKING:
    import torch

    from paratrain.kvstore.shared import Region
    from paratrain.transport.client import Future

logger = logging.getLogger(__name__)


class KVStoreTimeoutError(KVStoreError, TimeoutError):
    """A kvstore call got no reply in time; the message says what it waited for and on whom."""


class KVError(KVStoreError):
    """A request a server refuses (unknown key, shape mismatch, a round pushed twice); the worker
    gets the message."""


class TableError(KVStoreError, ValueError):
    """A sparse-table request a server refuses; the worker gets the message."""


Key = int | str
"""A key: an int64 or a str of at most MAX_KEY_BYTES UTF-8 bytes."""
Keys = Any | Sequence[Any]
"""One key, or a list of keys (with matching lists of values and outs)."""


AGGREGATION = ("process", "host")


@dataclass(frozen=True)
class KVStoreConfig:
    consistency: Policy = Sync()
    """The consistency policy (consistency.py): Sync(), every round waits for all workers; Async(),
    pushes apply on arrival; Bounded(s), a worker may run at most s rounds ahead of the slowest. A
    name is accepted too ("sync", "async", "bounded" with `staleness`) and made the policy."""
    staleness: InitVar[int] = 0
    """With consistency="bounded" (a name): its bound s. Not kept: it is the policy's field."""
    aggregation: str = "process"
    """process: every worker talks to the servers; host: workers of one host reduce first and one of
    them talks to the servers (MXNet's *_device modes)."""
    slice_elements: int = DEFAULT_SLICE_ELEMENTS
    """Keys with more elements than this are sliced across all servers."""
    max_slice_bytes: int | None = 1 << 19
    """In sync consistency with servers on several hosts, keys bigger than this are cut into slices
    no bigger, each on the server holding the fewest bytes so far, and frames are no bigger either
    (None: no limit). (In async and bounded modes the slices of a key may be at different versions,
    so a key of up to slice_elements stays whole there, and a pull gives it at one version; with
    every server on one host, more frames would only cost CPU.) It makes every frame of a push or
    pull about one size, so that the servers complete rounds, and send them back, at an even pace: on 1 Gbit/s
    links (benchmarks/hosts.py) 0.61-0.63 s per 64 MB push+pull against 0.77-0.78 s with slices up
    to 3.6 MB, where frames held whole slices of 0.5-3.6 MB."""
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
    average: bool = False
    """A round's update is the mean of its pushes, over the workers they stand for (the servers
    count them, so a round that fewer workers joined still gives their mean), not their sum (MXNet's
    semantics, the default). Async pushes are applied one by one either way."""
    frame_bytes: int = 1 << 20
    """A push or pull sends each server its slices in frames of at most this many bytes (whole
    slices: a bigger slice is a frame of its own), interleaved across servers, so that a server
    applies and sends back the first slices while the rest still arrive (benchmarks/hosts.py)."""

    def __post_init__(self, staleness: int) -> None:
        object.__setattr__(self, "consistency", parse(self.consistency, staleness, "KVStoreConfig"))
        if self.aggregation not in AGGREGATION:
            raise ValueError(f"KVStoreConfig.aggregation={self.aggregation!r} is not one of {AGGREGATION}")
        if not isinstance(self.slice_elements, int) or self.slice_elements < 1:
            raise ValueError(f"KVStoreConfig.slice_elements={self.slice_elements!r} must be an int >= 1")
        if not isinstance(self.wait_warning_s, (int, float)) or not self.wait_warning_s > 0:
            raise ValueError(f"KVStoreConfig.wait_warning_s={self.wait_warning_s!r} must be a number > 0")
        if not isinstance(self.refuse_non_finite, bool):
            raise ValueError(f"KVStoreConfig.refuse_non_finite={self.refuse_non_finite!r} must be a bool")
        if self.max_slice_bytes is not None and (
            not isinstance(self.max_slice_bytes, int) or self.max_slice_bytes < 1
        ):
            raise ValueError(
                f"KVStoreConfig.max_slice_bytes={self.max_slice_bytes!r} must be an int >= 1 or None"
            )
        if not isinstance(self.frame_bytes, int) or self.frame_bytes < 1:
            raise ValueError(f"KVStoreConfig.frame_bytes={self.frame_bytes!r} must be an int >= 1")
        if not isinstance(self.average, bool):
            raise ValueError(f"KVStoreConfig.average={self.average!r} must be a bool")

    @property
    def policy(self) -> Policy:
        """The consistency policy (the same as `consistency`)."""
        return self.consistency


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
    "dist_async": KVStoreConfig(consistency=Async()),
    "dist_sync_device": KVStoreConfig(aggregation="host"),
    "dist_async_device": KVStoreConfig(consistency=Async(), aggregation="host"),
}


def resolve_kind(kind: str | KVStoreConfig) -> KVStoreConfig:
    if isinstance(kind, KVStoreConfig):
        return kind
    if kind not in KINDS:
        raise ValueError(f"kvstore kind {kind!r} is not one of {', '.join(KINDS)} or a KVStoreConfig")
    return KINDS[kind]


@dataclass(frozen=True)
class WaitDiagnosis:
    """Why a call waits: what to say, and the workers it waits for (those that have not pushed
    the rounds it needs; empty where none is known)."""

    text: str
    awaited: tuple[int, ...] = ()

    def __str__(self) -> str:
        return self.text


@dataclass
class Handle:
    """Completion of one push / pull / pushpull. `wait()` raises the servers' errors, and a
    KVStoreError naming what it still waits for and on whom when `timeout_s` runs out; pulled
    slices that a same-host server keeps in shared memory are copied into `out` there."""

    futures: list[Future]
    after: list[Callable[[], None]] = field(default_factory=list)
    timeout_s: float | None = None
    reads: list[tuple[Region, torch.Tensor]] = field(default_factory=list)
    """Slices to copy out of a server's shared memory once its reply came."""
    version: int | None = None
    """After wait(): the oldest version among the pulled slices (rounds applied, in sync and
    bounded modes; pushes applied, in async mode)."""
    what: str = "request"
    """What the caller waits for ("pushpull of key 'w'"), for the messages of a long wait."""
    diagnose: Callable[[list[int]], WaitDiagnosis | str] | None = None
    """Given the indices of the futures not yet answered: what they wait for and on whom (text, or a
    WaitDiagnosis that also names the workers awaited)."""
    warn_after_s: float | None = None
    """Log what the wait is for after this long, and again every warn_after_s (None: never)."""
    replies: list[dict] = field(default_factory=list)
    """After wait(): each server's reply (its meta), in the order of `futures`."""

    def wait(self, timeout_s: float | None = None) -> None:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            replies = self._replies(timeout)
        except (RemoteError, TransportError) as exc:
            raise KVStoreError(str(exc)) from None
        except KVStoreTimeoutError:
            raise
        except TimeoutError as exc:  # never the builtin: every kvstore wait fails as a KVStoreError
            raise KVStoreTimeoutError(f"{self.what}: {exc}") from None
        self.replies = [r.meta for r in replies]
        versions = [v for r in replies for v in r.meta.get("versions", ())]
        versions += [region.read(dest) for region, dest in self.reads]
        self.version = min(versions) if versions else self.version
        self.reads = []
        for fn in self.after:
            fn()
        self.after = []

    def done(self) -> bool:
        """Whether every server replied (wait() then only copies shared-memory slices)."""
        return all(f.done() for f in self.futures)

    def _replies(self, timeout_s: float | None) -> list:
        """Every future's reply; a wait is never silent: past warn_after_s it logs what it waits
        for, and past timeout_s it raises a KVStoreError that says the same."""
        start = time.monotonic()
        deadline = None if timeout_s is None else start + timeout_s
        warn_at = None if self.warn_after_s is None else start + self.warn_after_s
        replies = []
        for future in self.futures:
            while True:
                ends = [t for t in (deadline, warn_at) if t is not None]
                try:
                    replies.append(future.wait(max(0.0, min(ends) - time.monotonic()) if ends else None))
                    break
                except TimeoutError:
                    pass
                waited = time.monotonic() - start
                pending = [i for i, f in enumerate(self.futures) if not f.done()]
                if deadline is not None and time.monotonic() >= deadline:
                    raise KVStoreTimeoutError(
                        f"{self.what} got no reply within {timeout_s:g} s: {self._why(pending)}"
                    ) from None
                why = self._why(pending)
                logger.warning("%s has waited %.0f s: %s", self.what, waited, why)
                stacks.ask(f"{self.what} has waited {waited:.0f} s: {why}", why.awaited)
                assert warn_at is not None and self.warn_after_s is not None
                warn_at += self.warn_after_s
        return replies

    def _why(self, pending: list[int]) -> WaitDiagnosis:
        if not pending:
            return WaitDiagnosis("every reply has just arrived")
        unanswered = "no reply from " + ", ".join(self.futures[i].what.split(" from ")[-1] for i in pending)
        if self.diagnose is None:
            return WaitDiagnosis(unanswered)
        try:
            found = self.diagnose(pending)
            return found if isinstance(found, WaitDiagnosis) else WaitDiagnosis(str(found))
        except Exception as exc:  # the diagnosis is a courtesy: the wait's own error must still come
            logger.debug("diagnosing a long wait failed", exc_info=True)
            return WaitDiagnosis(f"{unanswered} (asking why failed: {exc!r})")


@runtime_checkable
class KVStore(Protocol):
    """What every kvstore does (MXNet's kvstore API). `push` and the `*_async` calls return a
    Handle at once; `pull` and `pushpull` return when `out` holds the value, with the oldest
    version pulled (None where a store does not count versions)."""

    rank: int
    num_workers: int
    config: KVStoreConfig

    def init(self, keys: Keys, values: Any) -> None:
        """The first init of a key sets its value; a later one must match its shape and dtype."""

    def push(self, keys: Keys, values: Any) -> Handle:
        """Push gradients; values must not change until handle.wait()."""

    def pull_async(self, keys: Keys, out: Any) -> Handle: ...

    def pull(self, keys: Keys, out: Any) -> int | None: ...

    def pushpull_async(self, keys: Keys, values: Any, out: Any) -> Handle: ...

    def pushpull(self, keys: Keys, values: Any, out: Any) -> int | None: ...

    def set_optimizer(self, optimizer: str | type, **hyperparameters: Any) -> None:
        """Run `optimizer` (a torch.optim class or its path) where the values are kept."""

    def set_gradient_compression(self, compression: Any) -> None:
        """Gradients travel compressed from now on (a CompressionConfig, or MXNet's dict)."""

    def set_hyperparameters(self, keys: Keys, **hyperparameters: Any) -> Handle:
        """Change hyperparameters of the optimizer of `keys` (after set_optimizer), from the next
        update on: an LR schedule's lr, a parameter group's own weight decay."""

    def barrier(self) -> None: ...

    def stats(self) -> dict:
        """What the servers counted per key (empty without servers)."""

    def save_state(self, path: str | os.PathLike[str]) -> None: ...

    def load_state(self, path: str | os.PathLike[str]) -> None: ...

    def close(self) -> None: ...


# -- sparse tables (kvstore/server/sparse.py on the servers, kvstore/worker/embedding.py on the workers)
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
