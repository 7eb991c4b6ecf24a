"""A dense pull's wait and its reply (server.py's pulls, and a replicated push's acknowledgement).

A pull waits here until every slice it asks for reaches the version the worker needs (its
`min_version`, or with replication the round made durable on the backups: replica.py). Whatever
moves a version (a round applied, a copy confirmed, a worker leaving) calls `serve_ready`. A ready
pull's values are pinned at once (ShardState.begin_read: no round changes them until sent) and sent
from the pulling worker's reply sender (replies.py), never from the thread that made them ready.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from paratrain.errors import TransportError
from paratrain.kvstore.api import KVError
from paratrain.kvstore.compressed import ServerCompression
from paratrain.kvstore.server.replies import ReplySenders
from paratrain.kvstore.server.shard import ShardState
from paratrain.transport.connection import Connection
from paratrain.transport.rpc import Request

logger = logging.getLogger(__name__)


@dataclass
class PendingPull:
    request: Request
    shards: list[ShardState]
    min_versions: list[int]
    read: list[bool]
    """Per shard: the worker copies it out of shared memory itself (no tensor in the reply)."""
    ack_only: bool = False
    """A replicated push's acknowledgement: no values, sent once its rounds are on the backups."""

    def ready(self) -> bool:
        return all(s.ready(v) for s, v in zip(self.shards, self.min_versions, strict=True))


class Pulls:
    """One server's waiting pulls and the threads their replies go out from."""

    def __init__(
        self, rank: int, compression: ServerCompression, refuse: Callable[[Request, str], None]
    ) -> None:
        self.rank = rank
        self._compression = compression
        self._refuse = refuse
        self._lock = threading.Lock()
        self._pending: list[PendingPull] = []
        self._senders = ReplySenders(f"server {rank}")

    def wait(self, pull: PendingPull) -> None:
        """Answer `pull` once it is ready (at once if it is)."""
        with self._lock:
            self._pending.append(pull)
        self.serve_ready()

    def serve_ready(self) -> None:
        ready: list[PendingPull] = []
        with self._lock:
            waiting: list[PendingPull] = []
            for pull in self._pending:
                (ready if pull.ready() else waiting).append(pull)
            self._pending = waiting
        for pull in ready:
            self._send_values(pull)

    def waiting(self) -> list[PendingPull]:
        with self._lock:
            return list(self._pending)

    def close(self) -> None:
        """The threads that send replies end (replies.py, ReplySenders.close_all)."""
        self._senders.close_all()

    def disconnected(self, conn: Connection) -> None:
        self._senders.close(conn)

    def _send_values(self, pull: PendingPull) -> None:
        """Pin the values now (no round changes them until sent) and send them from the pulling
        worker's reply sender (replies.py), never from this thread."""
        if pull.ack_only:
            pull.request.reply({})
            return
        sent = [shard for shard, reads in zip(pull.shards, pull.read, strict=True) if not reads]
        values = [shard.begin_read() for shard in sent]
        self._senders.send(pull.request.conn, lambda: self._reply_values(pull, sent, values))

    def _reply_values(self, pull: PendingPull, sent: list[ShardState], values: list[torch.Tensor]) -> None:
        request = pull.request
        try:
            extra, values = self._compression.encode_pull(request.meta, sent, values)
            rank = request.meta.get("rank", -1)
            for shard in pull.shards:
                shard.served(rank)
            request.reply({"versions": [s.version for s in sent], **extra}, values)  # readers see theirs
        except (KVError, ValueError, TypeError, KeyError) as exc:
            self._refuse(request, f"server {self.rank}: {exc}")
        except TransportError as exc:  # the worker is gone: its connection's end reports it
            logger.debug("server %d: a pull reply to %s was not sent: %s", self.rank, request.conn.peer, exc)
        finally:
            for shard in sent:
                shard.end_read()
