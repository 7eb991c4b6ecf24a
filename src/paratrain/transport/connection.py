"""One authenticated connection: frames out through scatter-gather sends, frames in through a small
read-ahead buffer, with each payload received straight into the tensor that will hold it.

Sends may come from many threads (a lock keeps frames whole); reads come from one thread per connection.
A frame that fails any check raises FrameError: the caller closes this connection and goes on serving.
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from paratrain.errors import TransportError
from paratrain.transport import frame
from paratrain.transport.frame import Header, Limits
from paratrain.transport.shm import Ring
from paratrain.transport.tensors import ViewCache, byte_view, copy_bytes

if TYPE_CHECKING:
    from paratrain.transport.config import TransportConfig

logger = logging.getLogger(__name__)

READ_AHEAD_BYTES = 256 * 1024
_PREFIX_BYTES = frame.PREFIX.size
_TIMEVAL = struct.Struct("@ll")  # struct timeval (seconds, microseconds)
IOV_MAX = 512

# Called with a parsed header; returns the tensors to receive the payload into (None: allocate).
Destinations = Callable[[Header], Sequence[torch.Tensor | None] | None]


@dataclass
class _RingCursor:
    region: memoryview
    offset: int
    views: bool


class ConnectionClosed(TransportError):
    """The peer closed the connection between frames (an orderly end, not an error)."""


def tune(
    sock: socket.socket, congestion_control: str | None = None, recv_buffer_bytes: int | None = None
) -> None:
    """No Nagle delay; a fixed receive buffer where one is given (a server's accepted connections:
    TransportConfig.server_recv_buffer_bytes); the congestion control named
    (TransportConfig.congestion_control), where the kernel has it and allows it (else the system's
    default stays, logged once)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if recv_buffer_bytes is not None and recv_buffer_allowed(recv_buffer_bytes):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, recv_buffer_bytes)
    if congestion_control is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion_control.encode())
    except OSError as exc:
        if congestion_control not in _REFUSED:
            _REFUSED.add(congestion_control)
            logger.info(
                "TCP congestion control %r is not available (%s): the system's default stays",
                congestion_control,
                exc,
            )


_REFUSED: set[str] = set()
_RMEM_MAX = Path("/proc/sys/net/core/rmem_max")
_CUT: set[int] = set()  # the rmem_max values already logged by recv_buffer_allowed


def recv_buffer_allowed(recv_buffer_bytes: int) -> bool:
    """Whether the kernel lets a socket have this receive buffer. It silently cuts SO_RCVBUF to
    net.core.rmem_max (208 KiB on many systems), and a buffer set by hand no longer grows: a cut one
    would cap every connection's rate far below what autotuning gives, so then none is set (logged
    once). TCP_WINDOW_CLAMP, which that limit does not bound, does not hold: autotuning raises it."""
    try:
        rmem_max = int(_RMEM_MAX.read_text())
    except (OSError, ValueError):
        return True
    if rmem_max >= recv_buffer_bytes:
        return True
    if rmem_max not in _CUT:
        _CUT.add(rmem_max)
        logger.info(
            "a receive buffer of %d bytes is above net.core.rmem_max (%d): the kernel's autotuning stays",
            recv_buffer_bytes,
            rmem_max,
        )
    return False


def limits(config: TransportConfig) -> Limits:
    """The frame limits a connection reads with."""
    return Limits(config.max_header_bytes, config.max_payload_bytes)


def tls_context(config: TransportConfig, server: bool) -> ssl.SSLContext | None:
    """TLS for one side of a connection where TransportConfig.tls asks for it (else None)."""
    if config.tls is None:
        return None
    purpose = ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH
    ctx = ssl.create_default_context(purpose, cafile=config.tls.cafile)
    ctx.load_cert_chain(config.tls.certfile, config.tls.keyfile)
    ctx.check_hostname = False  # peers are named by the cluster spec, authenticated by the CA
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class Connection:
    def __init__(
        self,
        sock: socket.socket,
        recv_key: bytes,
        send_key: bytes,
        peer: str,
        limits: Limits | None = None,
    ) -> None:
        self.peer = peer
        self._sock = sock
        self._recv_key, self._send_key = frame.MacKey(recv_key), frame.MacKey(send_key)
        self._limits = limits or Limits()
        self._send_lock = threading.Lock()
        self._send_seq = 0
        self._recv_seq = 0
        self._buf = bytearray(READ_AHEAD_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._waitall = 0 if self._tls else socket.MSG_WAITALL
        self.closed = False
        # The same-host path (see shm.py): set once both ends mapped the rings.
        self.send_ring: Ring | None = None
        self.recv_ring: Ring | None = None
        self.shm_min_bytes = 64 * 1024
        self._held: int | None = None  # ring position up to which the last frame's views reach
        self._views = ViewCache()

    # -- sending ---------------------------------------------------------------------------------
    def send(
        self,
        op: str,
        id: int = 0,
        meta: dict[str, Any] | None = None,
        tensors: Sequence[torch.Tensor] = (),
    ) -> None:
        views = [self._views.byte_view(t) for t in tensors]  # before taking a sequence number: may raise
        size = sum(map(len, views))
        with self._send_lock:
            if self.closed:
                raise TransportError(f"connection to {self.peer} is closed")
            at = None if self.send_ring is None else self._to_ring(views, size)
            head, _ = frame.encode(self._send_key, self._send_seq, op, id, meta or {}, tensors, at, size)
            self._send_seq += 1
            bufs = [head] if at is not None or not size else [head, *views]
            try:
                self._send_vectors(bufs, len(head) + (0 if at is not None else size))
            except OSError as exc:
                raise TransportError(f"sending {op!r} to {self.peer} failed: {exc}") from exc

    def _to_ring(self, views: list[memoryview], size: int) -> int | None:
        """Copy the payload into the shared-memory ring if there is one with room; else None."""
        ring = self.send_ring
        if ring is None or size < self.shm_min_bytes:
            return None
        at = ring.reserve(size)
        if at is None:
            return None
        region, offset = ring.region(at, size), 0
        for view in views:
            copy_bytes(region[offset : offset + len(view)], view)
            offset += len(view)
        return at

    def _send_vectors(self, bufs: list[Any], total: int) -> None:
        if self._tls:  # SSL sockets have no sendmsg
            for b in bufs:
                self._sock.sendall(b)
            return
        sent = 0
        if len(bufs) <= IOV_MAX:
            sent = self._sock.sendmsg(bufs)
            if sent == total:  # the common case: the whole frame in one call
                return
        bufs = [memoryview(b) for b in bufs if len(b)]
        i = 0
        while True:
            while sent:  # skip what went out
                n = len(bufs[i])
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    bufs[i] = bufs[i][sent:]
                    sent = 0
            if i >= len(bufs):
                return
            sent = self._sock.sendmsg(bufs[i : i + IOV_MAX])

    # -- receiving -------------------------------------------------------------------------------
    def read(
        self, destinations: Destinations | None = None, ring_views: bool = False
    ) -> tuple[Header, list[torch.Tensor]]:
        """Read one frame. The payload lands in the tensors `destinations` names where they match
        the header's dtype and size; anything else is received into new tensors, or, with
        `ring_views` and a payload in the shared-memory ring, comes back as views of the ring (no
        copy) that stay valid until `release_frame()`."""
        try:
            if self._end - self._start < _PREFIX_BYTES:  # a small frame is often all read ahead
                self._fill(_PREFIX_BYTES, between_frames=True)
            header_len, payload_len, tag = frame.check_prefix(self._buf, self._limits, self._start)
            self._start += _PREFIX_BYTES
            if self._end - self._start < header_len:
                self._fill(header_len)
            start = self._start
            self._start = start + header_len
            raw_header = self._view[start : self._start]
            header = frame.decode_header(self._recv_key, self._recv_seq, tag, raw_header, payload_len)
            self._recv_seq += 1
            dests = destinations(header) if destinations else None
            if header.at is None:
                tensors = [self._receive_socket(header, i, dests) for i in range(len(header.specs))]
            else:
                source = self._ring_region(header, ring_views)
                tensors = [self._receive_ring(header, i, dests, source) for i in range(len(header.specs))]
                self._held = header.at + header.size
                if not ring_views:
                    self.release_frame()
        except OSError as exc:
            raise TransportError(f"reading from {self.peer} failed: {exc}") from exc
        return header, tensors

    def _receive_socket(
        self, header: Header, i: int, dests: Sequence[torch.Tensor | None] | None
    ) -> torch.Tensor:
        """Tensor i of a frame whose payload follows on the socket: into its destination if that
        fits, else into a new tensor."""
        dtype, shape = header.specs[i]
        dest = dests[i] if dests is not None and i < len(dests) else None
        view = None if dest is None else self._views.fitting_view(dest, dtype, frame.nbytes(dtype, shape))
        if view is None:
            dest = torch.empty(shape, dtype=dtype)
            view = byte_view(dest)
        self._receive_into(view)
        assert dest is not None
        return dest

    def _ring_region(self, header: Header, views: bool) -> _RingCursor:
        """Where a payload that is in the shared-memory ring lies."""
        assert header.at is not None
        if self.recv_ring is None:
            raise frame.FrameError("frame names a shared-memory payload but this connection has no ring")
        return _RingCursor(self.recv_ring.check(header.at, header.size), 0, views)

    def _receive_ring(
        self, header: Header, i: int, dests: Sequence[torch.Tensor | None] | None, source: _RingCursor
    ) -> torch.Tensor:
        """Tensor i of a frame whose payload is in the shared-memory ring: copied into its
        destination if that fits, else a view of the ring (`views`) or a new tensor."""
        dtype, shape = header.specs[i]
        dest = dests[i] if dests is not None and i < len(dests) else None
        size = frame.nbytes(dtype, shape)
        view = None if dest is None else self._views.fitting_view(dest, dtype, size)
        region = source.region[source.offset : source.offset + size]
        source.offset += size
        if view is None and source.views and size:  # a view of the ring, valid until release_frame()
            return torch.frombuffer(region, dtype=dtype).view(shape)
        if view is None:
            dest = torch.empty(shape, dtype=dtype)
            view = byte_view(dest)
        copy_bytes(view, region)  # one copy, no syscall
        assert dest is not None
        return dest

    def release_frame(self) -> None:
        """Hand the ring space of the last frame back to the writer."""
        if self._held is not None and self.recv_ring is not None:
            self.recv_ring.release(self._held)
        self._held = None

    def _receive_into(self, view: memoryview) -> None:
        n = len(view)
        buffered = min(n, self._end - self._start)
        if buffered:
            view[:buffered] = self._view[self._start : self._start + buffered]
            self._start += buffered
        got = buffered
        while got < n:
            try:
                k = self._sock.recv_into(view[got:], n - got, self._waitall)
            except BlockingIOError:  # a read tick passed (set_read_tick): wait on
                continue
            if k == 0:
                raise TransportError(f"{self.peer} closed the connection inside a payload")
            got += k

    @property
    def tls(self) -> bool:
        return self._tls

    def fileno(self) -> int:
        return self._sock.fileno()

    def buffered(self) -> int:
        """Bytes read ahead and not yet part of a frame read."""
        return self._end - self._start

    def read_ready(self, wait: bool = False) -> bool:
        """Whether a frame has begun to arrive: bytes read ahead, or bytes one recv finds, at once
        or, with `wait`, within the read tick (raises ConnectionClosed where the peer closed the
        connection between frames). Waiting in the recv itself saves a poll: a system call costs
        about 2 us here, a tenth of a small round trip's client CPU."""
        if self._end > self._start:
            return True
        self._start = self._end = 0
        try:
            k = self._sock.recv_into(self._view, 0, 0 if wait else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise TransportError(f"reading from {self.peer} failed: {exc}") from exc
        if k == 0:
            raise ConnectionClosed(f"{self.peer} closed the connection")
        self._end = k
        return True

    def set_read_tick(self, tick_s: float) -> None:
        """A recv that waits returns after tick_s without bytes (SO_RCVTIMEO): `read_ready(wait=True)`
        then says False, and a wait inside a frame goes on."""
        seconds = int(tick_s)
        self._sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(seconds, int((tick_s - seconds) * 1e6))
        )

    def _fill(self, n: int, between_frames: bool = False) -> None:
        if self._end - self._start >= n:
            return
        if self._start + n > len(self._buf):
            size = self._end - self._start
            self._view[:size] = self._view[self._start : self._end]
            self._start, self._end = 0, size
        while self._end - self._start < n:
            try:
                k = self._sock.recv_into(self._view[self._end :])
            except BlockingIOError:  # a read tick passed (set_read_tick): wait on
                continue
            if k == 0:
                if between_frames and self._end == self._start:
                    raise ConnectionClosed(f"{self.peer} closed the connection")
                raise TransportError(f"{self.peer} closed the connection inside a frame")
            self._end += k

    def close(self) -> None:
        with self._send_lock:
            self.closed = True
            rings, self.send_ring, self.recv_ring = (self.send_ring, self.recv_ring), None, None
        self._views.clear()  # before the rings: a view may be of one
        for ring in rings:
            if ring is not None:
                ring.close()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
