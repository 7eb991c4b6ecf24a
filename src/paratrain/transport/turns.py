"""Who reads a client's socket: its reader thread, or a caller reading its own reply.

A caller that reads its own reply saves the hand-off from the reader thread (a wake-up of the
caller, then the GIL going back and forth between the two): a 1 KiB round trip then costs the
client one context switch instead of about four, as with a plain socket. Measured interleaved in one
process (turns of 1000 round trips against the same server, load 4-11 on 2 cores): client CPU per
round trip 46.6 against 60.9, 47.7 against 58.1 and 53.4 against 59.7 us; rate paired 1.35, 1.02
and 1.03x (the rate is mostly the machine's scheduling under load; the CPU and the switches are what
it saves). 64 KiB and 1 MiB echoes: paired 1.06 and 1.06x.

The protocol: whoever reads holds `lock`. The reader thread waits in epoll with EPOLLONESHOT, armed
only while no caller reads, so a reply a caller reads never wakes it; a caller disarms it before it
sends and arms it again when it is done, and a frame that came in meanwhile then wakes it at once
(the epoll check is level-triggered). The reader thread never waits for the lock: if a caller holds
it, that caller arms it when done. Whoever reads arms the wait only after releasing the lock, so a
reader thread woken meanwhile that found the lock taken always gets another wake-up (arming first,
then releasing, lost a reply now and then: the wake-up came between the two). One-way messages a
caller reads are handed to the reader thread (`hand`), which runs the callbacks in wire order, as it
does for its own; while any has not run, every frame a caller reads after it is handed over too,
replies included, so no reply overtakes a notice sent before it. A broken connection a caller finds
is handed over too (`fail`), so closing and failing the other requests stay on that thread.
"""

from __future__ import annotations

import collections
import os
import select
import threading
from typing import Any

_ARMED = select.EPOLLIN | select.EPOLLONESHOT if hasattr(select, "epoll") else 0
_DISARMED = select.EPOLLONESHOT if hasattr(select, "epoll") else 0
_MAX_POLL_S = 86400.0 * 24  # poll takes a C int of milliseconds: longer waits have no limit


def supported(tls: bool) -> bool:
    """epoll and eventfd (Linux), and a plain socket: TLS keeps decrypted bytes of its own that epoll
    cannot see, so a TLS connection keeps one reader thread for all its frames."""
    return hasattr(select, "epoll") and hasattr(os, "eventfd") and not tls


class ReadTurns:
    __slots__ = ("lock", "error", "_fd", "_epoll", "_poll", "_wake", "_wake_lock", "_handed", "_closed")

    def __init__(self, fd: int) -> None:
        self.lock = threading.Lock()
        """Held by whoever reads the socket."""
        self.error: BaseException | None = None
        """What broke the connection, met by a caller (the reader thread ends it)."""
        self._fd = fd
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self._wake, select.EPOLLIN)
        self._epoll.register(self._fd, _ARMED)
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)
        self._handed: collections.deque[Any] = collections.deque()
        self._wake_lock = threading.Lock()  # a closed eventfd's number may be reused: never write to it
        self._closed = False

    # -- the reader thread ---------------------------------------------------------------------------
    def wait(self) -> bool:
        """Until the socket is readable (True; it is then disarmed) or the thread is woken (False)."""
        readable = False
        for fd, _ in self._epoll.poll():
            if fd == self._wake:
                try:
                    os.eventfd_read(self._wake)
                except BlockingIOError:
                    pass
            else:
                readable = True
        return readable

    def handed(self) -> list[Any]:
        """What callers handed over since the last call, in the order they read it. Each item
        leaves the queue only once it has run (`done`), so a caller that sees the queue empty knows
        that everything handed before has run."""
        return list(self._handed)

    def done(self, count: int) -> None:
        """The first `count` items of `handed` have run."""
        for _ in range(count):
            self._handed.popleft()

    # -- callers ---------------------------------------------------------------------------------------
    def disarm(self) -> None:
        self._modify(_DISARMED)

    def arm(self) -> None:
        self._modify(_ARMED)

    def readable(self, timeout_s: float | None) -> bool:
        """Whether the socket has bytes to read within timeout_s (None: no limit)."""
        ms = -1 if timeout_s is None or timeout_s > _MAX_POLL_S else max(0, int(timeout_s * 1000) + 1)
        return bool(self._poll.poll(ms))

    def hand(self, item: Any) -> None:
        self._handed.append(item)
        self.wake()

    def holds_handed(self) -> bool:
        """Whether items handed over have not run yet (what a caller reads next must follow them)."""
        return bool(self._handed)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.wake()

    def wake(self) -> None:
        with self._wake_lock:
            if not self._closed:
                os.eventfd_write(self._wake, 1)

    def _modify(self, events: int) -> None:
        try:
            self._epoll.modify(self._fd, events)
        except (OSError, ValueError):  # the socket or the epoll is closed: the reader thread ends it
            pass

    def close(self) -> None:
        """By the reader thread, as it ends."""
        with self._wake_lock:
            self._closed = True
            self._epoll.close()
            os.close(self._wake)
