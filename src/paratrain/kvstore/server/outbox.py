"""Replicated servers on one host: a primary's lent slices (mirror.py) go to a backup in a few
`replicate` frames per round, not one per push frame.

A worker's push comes in frames of up to `frame_bytes` (about 23 per worker, server and round for
64 MB: benchmarks/failures_servers.py). Sending each frame's completed slices to the backup in a
frame of its own would cost both servers system calls and wake-ups per push frame on one host (a
loopback send runs the receiver's side too). So a worker marks each of its push frames but its last
to a server `more` (worker/client.py), and the slices completed while some worker is part way
through its push (Arrivals) wait here, up to MAX_WAITING: a 64 MB round sends 4-6 frames to each
backup, against about 20 with a frame per push frame, and the two servers spend about a quarter
less CPU per round.

What waits for a slice's copy (pulls, acknowledgements) waits for the worker's last frame anyway;
the buffers a waiting slice lends count as lent from the moment it waits (Mirrors.defer), so no
round writes them meanwhile. Nothing waits longer than HOLD_S: the confirming thread, reaching a
slice not sent, sends what waits once it has waited that long (Part.wait), so a worker that dies
part way through a push holds no round back for long.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from paratrain.kvstore.server.mirror import Part
from paratrain.transport.client import Future

MAX_WAITING = 8  # slices: a round's last frame carries few, so the round's end waits little
HOLD_S = 0.005  # the longest a slice waits for more of its round


class Outbox:
    """One backup's lent slices that wait for more of their round."""

    def __init__(self, send: Callable[[list[dict]], Future]) -> None:
        """`send`: one `replicate` frame {slices} to the backup; its reply (a failed one where the
        backup is gone)."""
        self._send = send
        self._lock = threading.RLock()  # re-entered where a failed send takes the backup for dead
        self._sent = threading.Condition(self._lock)
        self._metas: list[dict] = []
        self._parts: list[Part] = []
        self._since = 0.0  # when the first of those waiting was posted (time.monotonic)

    def post(self, metas: list[dict], parts: list[Part], more: bool) -> None:
        """Slices applied (and counted as lent): sent now, with those waiting, unless `more` of
        their round is coming and fewer than MAX_WAITING wait."""
        with self._lock:
            if not self._metas:
                self._since = time.monotonic()
            self._metas += metas
            for part in parts:
                part.outbox = self
                self._parts.append(part)
            if not more or len(self._metas) >= MAX_WAITING:
                self._flush()

    def drain(self) -> None:
        """Send what waits."""
        with self._lock:
            if self._metas:
                self._flush()

    def wait_sent(self, part: Part) -> None:
        """From the confirming thread: wait for `part` to be sent, then send it once what waits
        has waited HOLD_S."""
        with self._lock:
            while part.whole is None and (left := self._since + HOLD_S - time.monotonic()) > 0:
                self._sent.wait(left)
            if part.whole is None and self._metas:
                self._flush()

    def fail(self, error: BaseException) -> None:
        """The backup is gone or restarted: what waits is never sent (a restarted one gets an
        install instead: rejoin.py); its confirms fail as a failed frame's would."""
        whole = Future("replicate", None)
        whole._set(None, error)
        with self._lock:
            parts, self._metas, self._parts = self._parts, [], []
            for part in parts:
                part.whole = whole
            self._sent.notify_all()

    def _flush(self) -> None:
        metas, parts, self._metas, self._parts = self._metas, self._parts, [], []
        whole = self._send(metas)
        for index, part in enumerate(parts):
            part.index, part.whole = index, whole
        self._sent.notify_all()


class Arrivals:
    """Which workers are part way through a push to this server: a push comes in several frames,
    and all but a worker's last one to this server say `more` (worker/client.py). While one is
    part way, more of the round's slices complete soon (a worker that died part way holds slices
    back for HOLD_S only). One thread per worker's connection writes its rank's entry."""

    def __init__(self) -> None:
        self._partway: set[int] = set()

    def pushed(self, rank: int, more: bool) -> None:
        if more:
            self._partway.add(rank)
        else:
            self._partway.discard(rank)

    def forget(self, ranks: set[int] | frozenset[int]) -> None:
        """Workers that left or died: none of their frames comes any more."""
        self._partway -= set(ranks)

    def more(self) -> bool:
        return bool(self._partway)
