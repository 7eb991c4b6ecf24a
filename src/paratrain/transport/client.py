"""The client side of request/response (the server is rpc.py): `RpcClient` holds one connection;
`request` returns a `Future` at once, filled when the reply with the same id arrives, straight into
the caller's `out` tensors. Frames with id 0 are one-way messages (a heartbeat, a notice from the
scheduler), given to `on_message` on the connection's reader thread.

A caller reads its own reply (turns.py): `call` and `Future.wait` take the connection's read turn
where no other thread holds it, and the reader thread, parked in epoll, reads only while no caller
does (one-way messages, replies nobody waits on yet, the connection's end; a TLS connection keeps
its reader thread for everything). A 1 KiB round trip then costs the client one context switch
instead of about four (the reader's wake-up, then the caller's, then the GIL going back and forth).
The reader thread is disarmed before sending, so a reply never wakes two threads: designs that left
it armed ran at 0.3-0.7x the rate on a loaded machine (turns.py's docstring has the figures).
Measured and slower: the reader waking the caller only just before it next blocks on the socket
(0.96, 1.04, 0.95x).
Cached byte views (tensors.ViewCache) and the lean header (frame.py) cut the Python per frame.
A caller waits for its reply in the recv itself, bounded by the socket's receive timeout (a read tick
of 0.1 s, after which it looks at its deadline): one system call where poll then recv made two, about
2 us each here; paired against poll, 3-6 us less client CPU and 2-4 us less server CPU per 1 KiB
round trip (whichever cores the two processes share).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from paratrain.errors import RemoteError, TransportError
from paratrain.transport import handshake
from paratrain.transport.config import TransportConfig
from paratrain.transport.connection import Connection, ConnectionClosed, limits, tls_context, tune
from paratrain.transport.frame import Header
from paratrain.transport.shm import Ring
from paratrain.transport.turns import ReadTurns, supported

logger = logging.getLogger(__name__)

_READ_TICK_S = 0.1
"""A caller reading its reply wakes at least this often to look at its deadline."""


@dataclass
class Reply:
    meta: dict[str, Any]
    tensors: list[torch.Tensor] = field(default_factory=list)


class Future:
    """The reply to one request. A lock held until the reply arrives is the cheapest wake-up
    CPython has (an Event adds a Condition and a second lock)."""

    __slots__ = ("_done", "_reply", "_error", "out", "_what", "_read")

    def __init__(
        self,
        what: str | tuple[str, int, str],
        out: Sequence[torch.Tensor | None] | None,
        read: Callable[[Future, float | None], Reply] | None = None,
    ) -> None:
        """`what`: the request, for errors; or (op, id, peer), formatted only if an error needs it.
        `read`: waits by reading the connection itself where nobody else does (turns.py)."""
        self._done = threading.Lock()
        self._done.acquire()
        self._reply: Reply | None = None
        self._error: BaseException | None = None
        self.out = out
        self._what = what
        self._read = read

    @property
    def what(self) -> str:
        if isinstance(self._what, tuple):
            op, id, peer = self._what
            return f"{op!r} (id {id}) from {peer}"
        return self._what

    def _set(self, reply: Reply | None, error: BaseException | None) -> None:
        self._reply, self._error = reply, error
        self._done.release()

    def done(self) -> bool:
        return not self._done.locked()

    def wait(self, timeout_s: float | None = None) -> Reply:
        if self._read is not None and self._done.locked():
            return self._read(self, timeout_s)
        return self._wait(timeout_s)

    def _wait(self, timeout_s: float | None, _said_s: float | None = None) -> Reply:
        """`_said_s`: the timeout to name in the error, where part of it was spent already."""
        if not self._done.acquire(timeout=-1 if timeout_s is None else timeout_s):
            said = timeout_s if _said_s is None else _said_s
            raise TimeoutError(f"no reply to {self.what} within {said} s")
        self._done.release()
        return self._result()

    def _result(self) -> Reply:
        """The reply, or its error, once done."""
        if self._error is not None:
            raise self._error
        assert self._reply is not None
        return self._reply


class RpcClient:
    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        *,
        config: TransportConfig | None = None,
        name: str | None = None,
        on_message: Callable[[Header, list[torch.Tensor]], None] | None = None,
        on_close: Callable[[Exception | None], None] | None = None,
        same_host: bool = False,
        origin: str | None = None,
        give_up: Callable[[], str | None] | None = None,
        silence_is_final: bool = False,
    ) -> None:
        """`same_host`: the server runs on this machine; offer it the shared-memory path.
        `origin`: who connects, from where ("worker 2 at 10.0.0.3"), for the error that says a
        peer could not be reached. `give_up`: asked between connection attempts; a reason stops
        them at once (the peer is known to be gone: waiting connect_timeout_s would gain nothing).
        `silence_is_final`: a peer that accepts but sends no greeting within handshake_timeout_s
        is not waited for again (handshake.NoGreeting): no paratrain endpoint listens there."""
        self.config = config or TransportConfig()
        self.name = name or f"{host}:{port}"
        self.origin = origin
        self._on_message = on_message
        self._on_close = on_close
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._error: Exception | None = None
        self._give_up, self._silence_is_final = give_up, silence_is_final
        self._conn = self._connect(host, port, secret)
        self._turns = ReadTurns(self._conn.fileno()) if supported(self._conn.tls) else None
        if self._turns is not None:
            self._conn.set_read_tick(_READ_TICK_S)
        loop = self._read_loop if self._turns is None else self._turn_loop
        self._reader = threading.Thread(target=loop, name=f"rpc-{self.name}", daemon=True)
        self._reader.start()
        self.same_host_path = bool(same_host and self.config.shm_ring_bytes) and self._offer_rings()

    def _offer_rings(self) -> bool:
        """Set up the same-host path (shm.py); where the server declines, the socket carries all."""
        capacity = self.config.shm_ring_bytes
        try:
            send, send_token = Ring.create(capacity)
            recv, recv_token = Ring.create(capacity)
        except OSError as exc:
            logger.info("no same-host path to %s: %s", self.name, exc)
            return False
        self._conn.recv_ring = recv  # before asking: the server may use it as soon as it agrees
        meta = {
            "pid": os.getpid(),
            "capacity": capacity,
            "c2s": [send.fd, send_token],
            "s2c": [recv.fd, recv_token],
        }
        try:
            self.call("_shm", meta, timeout_s=self.config.handshake_timeout_s)
        except (RemoteError, TransportError, TimeoutError) as exc:
            logger.info("no same-host path to %s: %s", self.name, exc)
            self._conn.recv_ring = None
            send.close()
            recv.close()
            return False
        self._conn.shm_min_bytes = self.config.shm_min_bytes
        self._conn.send_ring = send
        return True

    def _connect(self, host: str, port: int, secret: bytes) -> Connection:
        """Connects and authenticates, retrying until connect_timeout_s while the peer is not
        listening yet or drops the handshake (a server under a connection flood drops the oldest
        handshakes); a peer that refuses our secret is final."""
        deadline = time.monotonic() + self.config.connect_timeout_s
        delay = 0.01
        while True:
            sock = None
            try:
                sock = socket.create_connection((host, port), timeout=self.config.handshake_timeout_s)
                return self._authenticate(sock, secret)
            except (OSError, handshake.HandshakeClosed) as exc:
                if sock is not None:
                    sock.close()
                if isinstance(exc, handshake.NoGreeting) and self._silence_is_final:
                    raise handshake.NoGreeting(
                        f"{self.name} at {host}:{port} accepted the connection but sent no paratrain "
                        f"greeting within {self.config.handshake_timeout_s} s"
                    ) from exc
                gone = self._give_up() if self._give_up is not None else None
                if gone:
                    raise TransportError(f"gave up connecting to {self.name}: {gone}") from exc
                if time.monotonic() + delay > deadline:
                    what = "connect to" if sock is None else "authenticate with"
                    who = f"{self.origin} " if self.origin else ""
                    raise TransportError(
                        f"{who}could not {what} {self.name} at {host}:{port} within "
                        f"{self.config.connect_timeout_s} s: {exc}"
                    ) from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _authenticate(self, sock: socket.socket, secret: bytes) -> Connection:
        try:
            tune(sock, self.config.congestion_control)
            tls = tls_context(self.config, server=False)
            if tls is not None:
                sock = tls.wrap_socket(sock)
            recv_key, send_key = handshake.connect(sock, secret)
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return Connection(sock, recv_key, send_key, self.name, limits(self.config))

    def request(
        self,
        op: str,
        meta: dict[str, Any] | None = None,
        tensors: Sequence[torch.Tensor] = (),
        out: Sequence[torch.Tensor | None] | None = None,
    ) -> Future:
        """Send a request; the returned Future gives the reply. Reply tensors land in `out` where
        their dtype and size match it."""
        id = next(self._ids)
        future = Future((op, id, self.name), out, None if self._turns is None else self._read_reply)
        with self._lock:
            if self._error is not None:
                raise TransportError(f"connection to {self.name} is down: {self._error}")
            self._pending[id] = future
        try:
            self._conn.send(op, id, meta, tensors)
        except BaseException:
            with self._lock:
                self._pending.pop(id, None)
            raise
        return future

    def submit(
        self,
        op: str,
        meta: dict[str, Any] | None = None,
        tensors: Sequence[torch.Tensor] = (),
        out: Sequence[torch.Tensor | None] | None = None,
    ) -> Future:
        """As request, but a connection that is down, or a send that fails, fails the returned
        Future rather than the call: for callers that take every error from their waits (the
        kvstore's, whose waits turn it into a KVStoreError)."""
        try:
            return self.request(op, meta, tensors, out)
        except TransportError as exc:
            future = Future((op, 0, self.name), out)
            future._set(None, exc)
            return future

    def call(
        self,
        op: str,
        meta: dict[str, Any] | None = None,
        tensors: Sequence[torch.Tensor] = (),
        out: Sequence[torch.Tensor | None] | None = None,
        timeout_s: float | None = None,
    ) -> Reply:
        timeout_s = self.config.request_timeout_s if timeout_s is None else timeout_s
        turns = self._turns
        if turns is None or not turns.lock.acquire(blocking=False):  # someone else reads
            return self.request(op, meta, tensors, out).wait(timeout_s)
        try:
            turns.disarm()  # before sending: the reply must not wake the reader thread
            future = self.request(op, meta, tensors, out)
        except BaseException:
            turns.lock.release()
            turns.arm()  # after the release: see turns.py
            raise
        return self._read_turn(future, timeout_s)

    def _read_reply(self, future: Future, timeout_s: float | None) -> Reply:
        """Future.wait where this client's reader thread waits in epoll: this thread reads the
        reply itself unless another thread reads already (turns.py)."""
        turns = self._turns
        assert turns is not None
        if not turns.lock.acquire(blocking=False):  # someone else reads: wait
            return future._wait(timeout_s)
        # A reply that came before this wakes the reader thread, which finds the lock taken and
        # leaves the frame to this thread.
        turns.disarm()
        return self._read_turn(future, timeout_s)

    def _read_turn(self, future: Future, timeout_s: float | None) -> Reply:
        """With the read lock taken and the reader thread's wait disarmed: read until the reply."""
        turns = self._turns
        assert turns is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            self._read_until(future, deadline)
        finally:
            turns.lock.release()
            turns.arm()  # after the release: see turns.py
        if future.done():  # the common case: this thread read the reply
            return future._result()
        return future._wait(None if deadline is None else max(0.0, deadline - time.monotonic()), timeout_s)

    def _read_until(self, future: Future, deadline: float | None) -> None:
        """Read frames until `future` has its reply (and no frame is left half read ahead) or the
        deadline passes; one-way messages and a broken connection go to the reader thread (turns.py).

        Once a one-way message was handed over (and not yet run), every frame after it goes the
        same way, replies too, and the turn ends at the next frame boundary: a reply is never
        seen before a notice sent ahead of it has run. The scheduler relies on it: its abort
        notice goes before the failed reply to a waiting call, so the node exits as aborted (a
        consequence) rather than raising (a cause)."""
        conn, turns = self._conn, self._turns
        assert turns is not None
        try:
            while True:
                if not conn.buffered():  # frames read ahead go out before the reader thread's turn
                    if future.done() or conn.closed or turns.holds_handed():
                        return
                    if not self._frame_begun(deadline):
                        if deadline is not None and time.monotonic() >= deadline:
                            return
                        continue
                header, tensors = conn.read(self._destinations)
                if header.id and not turns.holds_handed():
                    self._dispatch(header, tensors)
                else:
                    turns.hand((header, tensors))
        except Exception as exc:
            turns.fail(exc)

    def _frame_begun(self, deadline: float | None) -> bool:
        """Whether a frame begins to arrive, waiting one read tick at most, or until the deadline
        where that is nearer. The tick's wait is the recv itself (one system call where poll then
        recv made two); a nearer deadline waits in poll."""
        left = None if deadline is None else deadline - time.monotonic()
        if left is None or left >= _READ_TICK_S:
            return self._conn.read_ready(wait=True)
        assert self._turns is not None
        return self._turns.readable(left)

    def send(self, op: str, meta: dict[str, Any] | None = None, tensors: Sequence[torch.Tensor] = ()) -> None:
        """A one-way message: no reply."""
        self._conn.send(op, 0, meta, tensors)

    def _destinations(self, header: Header) -> Sequence[torch.Tensor | None] | None:
        if header.op != "reply":
            return None
        future = self._pending.get(header.id)  # one dict operation: atomic, no lock needed
        return future.out if future is not None else None

    def _read_loop(self) -> None:
        self._reading(self._read_frames)

    def _read_frames(self) -> None:
        while True:
            header, tensors = self._conn.read(self._destinations)
            self._dispatch(header, tensors)

    def _turn_loop(self) -> None:
        turns = self._turns
        assert turns is not None
        try:
            self._reading(functools.partial(self._take_turns, turns))
        finally:
            turns.close()

    def _take_turns(self, turns: ReadTurns) -> None:
        """The reader thread's part of the scheme in transport/turns.py: read while no caller does."""
        conn = self._conn
        while True:
            readable = turns.wait()
            self._run_handed(turns)
            if turns.error is not None:
                raise turns.error
            if conn.closed:
                raise ConnectionClosed(f"connection to {self.name} closed")
            if not readable or not turns.lock.acquire(blocking=False):
                continue  # a caller reads: it arms the wait again when it is done
            try:
                self._run_handed(turns)  # handed over before the frames read next
                if conn.read_ready():
                    while True:
                        header, tensors = conn.read(self._destinations)
                        self._dispatch(header, tensors)
                        if not conn.buffered():
                            break
            finally:
                turns.lock.release()
                turns.arm()  # after the release: see turns.py

    def _run_handed(self, turns: ReadTurns) -> None:
        handed = turns.handed()
        for header, tensors in handed:
            self._dispatch(header, tensors)
        turns.done(len(handed))

    def _reading(self, read: Callable[[], None]) -> None:
        error: Exception | None = None
        try:
            read()
        except ConnectionClosed as exc:
            error = exc
        except TransportError as exc:
            error = exc
            if not self._conn.closed:
                logger.warning("connection to %s failed: %s", self.name, exc)
        except Exception as exc:  # a malformed reply: this connection is unusable, say why
            logger.exception("connection to %s: unexpected error", self.name)
            error = TransportError(f"connection to {self.name} broke: {exc!r}")
        finally:
            self._conn.close()
            if self._on_close is not None:  # first: it may tell someone before our callers react
                self._on_close(error)
            self._fail_pending(error or TransportError(f"connection to {self.name} closed"))

    def _dispatch(self, header: Header, tensors: list[torch.Tensor]) -> None:
        if header.id == 0:
            if self._on_message is not None:
                self._on_message(header, tensors)
            return
        # One dict operation is atomic; the lock only orders `_error` with the swap in _fail_pending,
        # which runs on this thread too.
        future = self._pending.pop(header.id, None)
        if future is None:
            logger.warning("%s sent a reply to unknown request %d", self.name, header.id)
        elif header.op == "reply":
            future._set(Reply(header.meta, tensors), None)
        else:
            message = header.meta.get("message", "unknown error")
            future._set(None, RemoteError(f"{self.name}: {message}"))

    def _fail_pending(self, error: Exception) -> None:
        with self._lock:
            self._error = error
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future._set(None, TransportError(f"connection to {self.name} lost: {error}"))

    def close(self) -> None:
        self._conn.close()
        if self._turns is not None:
            self._turns.wake()
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5.0)
