"""JobConfig: what every process of one job must agree on. It is written in the script, so every
process (the scheduler too) builds the same one; the scheduler compares each registering node's copy
with its own and refuses a node whose copy differs, saying which fields differ."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from paratrain.cluster.stragglers import StragglerConfig
from paratrain.transport.config import TransportConfig


@dataclass(frozen=True)
class ElasticConfig:
    """Elastic workers (off unless JobConfig.elastic is set): a worker that dies is dropped from the
    membership instead of stopping the job, and a new worker process may join a running job."""

    min_workers: int = 1
    """The job stops (with the usual report naming the dead worker) when fewer workers are left."""
    max_workers: int | None = None
    """The most workers at once, and the ranks a joiner may take (0..max_workers-1); None: the
    number the job was launched with."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.min_workers, bool)
            or not isinstance(self.min_workers, int)
            or self.min_workers < 1
        ):
            raise ValueError(f"ElasticConfig.min_workers={self.min_workers!r} must be an int >= 1")
        top = self.max_workers
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < self.min_workers):
            raise ValueError(
                f"ElasticConfig.max_workers={top!r} must be None or an int >= min_workers={self.min_workers}"
            )


@dataclass(frozen=True)
class JobConfig:
    heartbeat_interval_s: float = 1.0
    """How often every node tells the scheduler it is alive."""
    heartbeat_timeout_s: float = 5.0
    """A node not heard from for this long is declared dead and the job is aborted."""
    start_timeout_s: float = 120.0
    """How long the scheduler waits for every node to register."""
    barrier_timeout_s: float = 600.0
    """How long a barrier waits for the other nodes."""
    finish_timeout_s: float = 60.0
    """How long the scheduler waits for servers to exit once every worker finished."""
    replication: int = 1
    """Copies of every dense key's slices on the parameter servers (kvstore/server/replica.py): with
    2 or more, each slice has a primary and replication - 1 backups, a round's result reaches the
    backups before any worker sees it, and up to replication - 1 servers may die without ending the
    job (workers fail over to a backup). 1: no copies, a server's death ends the job."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    elastic: ElasticConfig | None = None
    """Elastic workers (cluster/membership.py); None: any death stops the job."""
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    """When the scheduler names a worker a straggler (cluster/stragglers.py)."""

    def __post_init__(self) -> None:
        if not isinstance(self.replication, int) or self.replication < 1:
            raise ValueError(f"JobConfig.replication={self.replication!r} must be an int >= 1")
        if self.elastic is not None and not isinstance(self.elastic, ElasticConfig):
            raise TypeError(f"JobConfig.elastic={self.elastic!r} must be an ElasticConfig or None")
        if not isinstance(self.stragglers, StragglerConfig):
            raise TypeError(f"JobConfig.stragglers={self.stragglers!r} must be a StragglerConfig")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s") and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"JobConfig.{f.name}={value!r} must be a number > 0")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"JobConfig.heartbeat_timeout_s={self.heartbeat_timeout_s!r} must be larger than "
                f"heartbeat_interval_s={self.heartbeat_interval_s!r}"
            )

    def as_dict(self) -> dict[str, Any]:
        return flatten(dataclasses.asdict(self))

    def digest(self) -> str:
        return config_digest(self.as_dict())


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: one entry per leaf, so a difference names its field."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_digest(flat: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()


def config_differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Human-readable differences, one per field: 'heartbeat_timeout_s: 3.0 here, 5.0 there'."""
    keys = sorted(set(mine) | set(theirs))
    return [
        f"{k}: {theirs.get(k, '<unset>')!r} on that node, {mine.get(k, '<unset>')!r} here"
        for k in keys
        if mine.get(k) != theirs.get(k)
    ]
