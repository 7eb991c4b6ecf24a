"""The same-host path: payload bytes through shared-memory rings instead of the socket.

When both ends of a connection run on one host, the client creates two rings (one per direction) as
memfd files and tells the server where they are (/proc/<pid>/fd/<fd>) in an authenticated frame; the
server maps them only if a random token the client wrote into each ring matches the frame's, so a
same-numbered fd of some other process (or host) is never used. Frames still go over the socket; only
their payload moves to the ring, saving the two kernel copies and the syscalls of loopback TCP.

A ring is a 64-byte header (the reader's tail, u64, then the token) and `capacity` data bytes. The
writer copies a frame's payload at its head and sends the frame with `at` = that absolute position; the
reader copies it out and advances the tail. A payload that does not fit just goes over the socket, so a
writer never waits on a reader.
When the reader has released everything, the writer starts its next payload at the ring's start again,
so a request/response conversation keeps reusing the same few pages (mapped, and warm in cache).
"""

from __future__ import annotations

import mmap
import os
import struct

from paratrain.transport.frame import FrameError

HEADER_BYTES = 64
TAIL = struct.Struct("=Q")
TOKEN_BYTES = 32
ALIGN = 64


class Ring:
    def __init__(self, fd: int, capacity: int, owner: bool) -> None:
        self.fd = fd
        self.capacity = capacity
        self._map = mmap.mmap(fd, HEADER_BYTES + capacity)
        self.view = memoryview(self._map)
        self.data = self.view[HEADER_BYTES:]
        self.head = 0  # writer side: absolute position of the next byte
        self.owner = owner

    @classmethod
    def create(cls, capacity: int) -> tuple[Ring, bytes]:
        fd = os.memfd_create("paratrain-ring", os.MFD_CLOEXEC)
        os.ftruncate(fd, HEADER_BYTES + capacity)
        ring = cls(fd, capacity, owner=True)
        token = os.urandom(TOKEN_BYTES)
        ring.view[TAIL.size : TAIL.size + TOKEN_BYTES] = token
        return ring, token

    @classmethod
    def open(cls, pid: int, fd: int, capacity: int, token: bytes) -> Ring:
        """Map a peer's ring; raises OSError or ValueError if it is not the ring we were told of."""
        local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(local).st_size != HEADER_BYTES + capacity:
                raise ValueError("ring size differs")
            ring = cls(local, capacity, owner=False)
        except BaseException:
            os.close(local)
            raise
        if bytes(ring.view[TAIL.size : TAIL.size + TOKEN_BYTES]) != token:
            ring.close()
            raise ValueError("ring token differs: not the peer's ring")
        return ring

    # -- writer -----------------------------------------------------------------------------------
    def reserve(self, size: int) -> int | None:
        """Absolute position of `size` contiguous free bytes, or None if they are not free now."""
        tail = TAIL.unpack_from(self.view, 0)[0]
        if tail == self.head and self.head % self.capacity:
            # The reader holds nothing: start again at the ring's start, whose pages are mapped and
            # likely in cache, rather than go on into pages not touched for a whole lap (or never:
            # each first touch is a page fault on both sides). The reader releases nothing until it
            # gets our next frame, so moving its tail here cannot race with it.
            self.head = -(-self.head // self.capacity) * self.capacity
            TAIL.pack_into(self.view, 0, self.head)
            tail = self.head
        at = -(-self.head // ALIGN) * ALIGN  # cache-line aligned, so tensors viewing it are too
        offset = at % self.capacity
        if offset + size > self.capacity:  # skip the end of the ring, wrap to its start
            at += self.capacity - offset
        if size == 0 or at + size - tail > self.capacity:
            return None
        self.head = at + size
        return at

    def region(self, at: int, size: int) -> memoryview:
        offset = at % self.capacity
        return self.data[offset : offset + size]

    # -- reader -----------------------------------------------------------------------------------
    def check(self, at: int, size: int) -> memoryview:
        """The region a frame says its payload is in, if that is a region the writer could use."""
        tail = TAIL.unpack_from(self.view, 0)[0]
        offset = at % self.capacity
        if not (isinstance(at, int) and at >= tail and offset + size <= self.capacity):
            raise FrameError(f"shared-memory payload at {at} (+{size}) is outside the ring")
        if at + size - tail > self.capacity:
            raise FrameError(f"shared-memory payload at {at} (+{size}) overruns the ring")
        return self.data[offset : offset + size]

    def release(self, upto: int) -> None:
        TAIL.pack_into(self.view, 0, upto)

    def close(self) -> None:
        try:
            self.data.release()
            self.view.release()
            self._map.close()
        except BufferError:
            pass  # a reader still holds a view; the map goes when that view does
        os.close(self.fd)
