"""Fencing on a server: what a process the scheduler dropped may no longer do here.

A network partition looks like a death to the scheduler (no heartbeat for heartbeat_timeout_s), but
the process behind it is alive, and when the link comes back what it had sent, or sends next, still
arrives. So a server refuses:

- pushes over the connection of a worker that the membership dropped (elastic jobs): the rounds went
  on without it, and its late push would count in a round it is not a member of. The fence is the
  connection, not the rank: a replacement worker that gets the same rank connects anew;
- `replicate` frames from a server the job lost (JobConfig.replication): the slices it was primary of
  are served by their backup now, and a demoted primary's late copy would overwrite the new
  primary's newer state.

The refusal names the fenced process and says why, so that the process exits saying so. A
replacement whose first push reached this server before the notice of its predecessor's drop would
be fenced with it: the scheduler announces a drop before it gives the rank again, so that would
need the notice to be overtaken by the replacement's whole start.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable

from paratrain.cluster.fencing import dropped_message
from paratrain.kvstore.api import KVError


class Fence:
    """The worker connections a server refuses pushes from, and the servers whose copies it refuses."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._pushers: dict[int, set[Hashable]] = {}
        """Per worker rank, the connections its pushes came over (the next drop fences them)."""
        self._fenced: dict[Hashable, int] = {}
        """Fenced connection -> the rank that was dropped."""

    def check_push(self, conn: Hashable, rank: int) -> None:
        """Refuse a push over a fenced connection; otherwise remember whose connection it is."""
        dropped = self._fenced.get(conn)
        if dropped is not None:
            raise KVError(
                f"server {self.rank} refuses this push: {dropped_message('worker', dropped)}, "
                "and the rounds went on without it"
            )
        conns = self._pushers.get(rank)
        if conns is None or conn not in conns:
            with self._lock:
                self._pushers.setdefault(rank, set()).add(conn)

    def drop(self, ranks: Iterable[int]) -> None:
        """The membership dropped these workers: their connections so far are fenced."""
        with self._lock:
            for rank in ranks:
                for conn in self._pushers.pop(rank, ()):
                    self._fenced[conn] = rank

    def check_replicate(self, sender: object, dead: set[int]) -> None:
        """Refuse a backup copy from a server the job lost (`dead`: the servers known lost here)."""
        if isinstance(sender, int) and sender in dead:
            raise KVError(
                f"server {self.rank} refuses this copy: {dropped_message('server', sender)}, and "
                "its backups serve its slices now"
            )
