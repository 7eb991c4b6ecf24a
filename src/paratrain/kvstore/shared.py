"""Same-host shards: a server's dense values and round buffers in shared memory its workers map.

Through the socket or the ring (transport/shm.py) a synchronous round moves each byte many times: every
worker copies its push into a ring and the server copies or adds it into the round's sum, then the
server copies the value into every worker's ring and every worker copies it out. For workers on the
server's machine this module cuts that to what the round needs. The server keeps each shard's value
and its open rounds' sums in one memfd (the arena), which its same-host workers map:

- a push in rounds mode (sync, bounded) is added by the worker straight into the buffer the server
  opened for that round (the round's first push is copied), and its frame then says "added";
- a pull, once the server replied that the version it waits for is there, is copied by the worker
  straight out of the value.

The server still decides everything: which buffer a round uses, when a round is complete (it counts
the push frames), the optimizer step, the value's version. A worker that finds no buffer open for its
round (it pushed further ahead than the buffers reach), or any push in async mode, sends its payload
as before, and the server adds it into the round's buffer itself.

Mutual exclusion between processes uses open-file-description byte-range locks (fcntl F_OFD_SETLKW):
the kernel drops them when the last descriptor of their open file closes, so when their holder dies
(a forked child, e.g. a DataLoader worker, closes its inherited copy at once, so it cannot keep a
dead parent's lock alive), and they exclude per open file, so a worker that opened the arena
through /proc conflicts with the server even within one process. No Python library offers locks
on shared memory between unrelated processes, hence these few lines.

A shard's region in the arena (page-aligned):
    control page   int64 words: [value buffer, version, (round, adds) per buffer]; round -1: not open
    buffers        `count` page-aligned buffers of the shard's elements
Lock bytes within the control page: 0 guards the value word and the version (readers take it before
the value buffer's), 1 + b guards buffer b's words and data.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

PAGE = mmap.PAGESIZE
TOKEN_BYTES = 32
CONTROL = 0
VALUE, VERSION = 0, 1
# struct flock on Linux: l_type, l_whence, l_start, l_len, l_pid (native alignment pads it to 32 bytes).
_FLOCK = struct.Struct("hhqqi4x")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class Region:
    """One shard's control page and buffers, mapped by the server (which creates it) or a worker."""

    def __init__(self, fd: int, offset: int, numel: int, dtype: torch.dtype, count: int) -> None:
        self.fd, self.offset, self.count = fd, offset, count
        stride = self._stride(numel, dtype)
        self._map = mmap.mmap(fd, self.bytes(numel, dtype, count), offset=offset)
        self.words = np.frombuffer(self._map, dtype=np.int64, count=2 + 2 * count)
        self.buffers = [
            torch.frombuffer(self._map, dtype=dtype, count=numel, offset=PAGE + b * stride)
            for b in range(count)
        ]

    @staticmethod
    def _stride(numel: int, dtype: torch.dtype) -> int:
        return _round_up(numel * torch.empty((), dtype=dtype).element_size(), PAGE)

    @staticmethod
    def bytes(numel: int, dtype: torch.dtype, count: int) -> int:
        return PAGE + count * Region._stride(numel, dtype)

    # -- locks ------------------------------------------------------------------------------------
    def _lock(self, kind: int, which: int) -> None:
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLKW, _FLOCK.pack(kind, os.SEEK_SET, self.offset + which, 1, 0))

    @contextmanager
    def _locked(self, which: int, exclusive: bool) -> Iterator[None]:
        self._lock(fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK, which)
        try:
            yield
        finally:
            self._lock(fcntl.F_UNLCK, which)

    # -- workers (and the server, for payloads it received) ---------------------------------------
    def add(self, round_: int, grad: torch.Tensor) -> bool:
        """Add a push into the buffer open for its round (the round's first push is copied);
        False if no buffer is open for that round."""
        words = self.words
        for b in range(self.count):
            if words[2 + 2 * b] != round_:  # a peek; checked again under the lock
                continue
            with self._locked(1 + b, exclusive=True):
                if words[2 + 2 * b] != round_:
                    return False
                if words[3 + 2 * b]:
                    self.buffers[b].add_(grad)
                else:
                    self.buffers[b].copy_(grad)
                words[3 + 2 * b] += 1
            return True
        return False

    def read(self, out: torch.Tensor) -> int:
        """Copy the value into `out`; returns its version. Never sees a half-applied update."""
        self._lock(fcntl.F_RDLCK, CONTROL)
        try:
            b, version = int(self.words[VALUE]), int(self.words[VERSION])
            self._lock(fcntl.F_RDLCK, 1 + b)
        finally:
            self._lock(fcntl.F_UNLCK, CONTROL)
        try:
            out.copy_(self.buffers[b])
        finally:
            self._lock(fcntl.F_UNLCK, 1 + b)
        return version

    # -- the server -------------------------------------------------------------------------------
    @contextmanager
    def writing(self, b: int) -> Iterator[None]:
        """Exclusive use of the control words and of buffer b (the value, to update it in place):
        waits for workers reading it. Taken in the readers' order (control first), so no deadlock."""
        with self._locked(CONTROL, exclusive=True), self._locked(1 + b, exclusive=True):
            yield

    def stamp(self, version: int) -> None:
        """Set the value's version; only under writing()."""
        self.words[VERSION] = version

    def publish(self, b: int, version: int) -> None:
        """Buffer b is now the value, at `version`."""
        with self._locked(CONTROL, exclusive=True):
            self.words[VALUE], self.words[VERSION] = b, version

    def open(self, b: int, round_: int) -> None:
        """Buffer b takes the pushes of `round_` (waits for workers still reading it)."""
        with self._locked(1 + b, exclusive=True):
            self.words[2 + 2 * b], self.words[3 + 2 * b] = round_, 0

    def close_round(self, b: int) -> None:
        """No more adds into buffer b: its round is complete."""
        with self._locked(1 + b, exclusive=True):
            self.words[2 + 2 * b] = -1

    def close(self) -> None:
        self.buffers, self.words = [], np.empty(0, dtype=np.int64)
        try:
            self._map.close()
        except BufferError:
            pass  # a view outlives us; the map goes with it


class Arena:
    """The server's memfd of shared shards; grows by one region per shard."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("paratrain-shards", os.MFD_CLOEXEC)
        self.token = os.urandom(TOKEN_BYTES)
        self.size = PAGE
        os.ftruncate(self.fd, self.size)
        os.pwrite(self.fd, self.token, 0)

    def region(self, numel: int, dtype: torch.dtype, count: int) -> Region:
        offset = self.size
        self.size += Region.bytes(numel, dtype, count)
        os.ftruncate(self.fd, self.size)
        region = Region(self.fd, offset, numel, dtype, count)
        region.words[2::2] = -1
        return region

    def describe(self) -> list:
        """What a worker on this host needs to map it (ArenaMap.open)."""
        return [os.getpid(), self.fd, self.token]


_open_maps: weakref.WeakSet[ArenaMap] = weakref.WeakSet()


def _close_in_child() -> None:
    for arena_map in list(_open_maps):
        os.close(arena_map.fd)
        arena_map.fd = -1
        for region in arena_map.regions:
            region.fd = -1  # its number may name another file in this child


os.register_at_fork(after_in_child=_close_in_child)


class ArenaMap:
    """A worker's view of one server's arena."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.regions: list[Region] = []
        _open_maps.add(self)

    @classmethod
    def open(cls, described: list) -> ArenaMap:
        """Map a server's arena; raises OSError or ValueError if it is not the one described."""
        pid, fd, token = int(described[0]), int(described[1]), bytes(described[2])
        local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        if os.pread(local, TOKEN_BYTES, 0) != token:
            os.close(local)
            raise ValueError("arena token differs: not the server's arena")
        return cls(local)

    def region(self, offset: int, numel: int, dtype: torch.dtype, count: int) -> Region:
        end = offset + Region.bytes(numel, dtype, count)
        if offset < PAGE or offset % PAGE or end > os.fstat(self.fd).st_size:
            raise ValueError(f"region at {offset} (+{end - offset}) is outside the arena")
        region = Region(self.fd, offset, numel, dtype, count)
        self.regions.append(region)
        return region

    def close(self) -> None:
        for region in self.regions:
            region.close()
        self.regions = []
        _open_maps.discard(self)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def same_host(peer: str, mine: str) -> bool:
    """Whether a server shares this process's machine (a worker's, or another server's): the same
    advertised host, or both loopback."""
    loopback = ("127.", "::1", "localhost")
    return peer == mine or (peer.startswith(loopback) and mine.startswith(loopback))
