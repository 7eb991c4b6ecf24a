"""Where each key lives: a pure function of the keys' sizes (in init order) and the server count.

Small keys live whole on one server, each on the server holding the fewest bytes so far (ties: the
lowest rank). A key of more than `slice_elements` elements is cut into one near-equal contiguous slice
per server, so every server and link carries part of it. With `max_slice_bytes`, a key bigger than
that is cut into more near-equal slices, none bigger, each placed on the server holding the fewest
bytes so far: pushes and pulls then move in frames of nearly one size (benchmarks/hosts.py); for a
compressed key the cap is on its compressed bytes, since those are what its frames carry. Every
worker computes the same placement because every worker inits the same keys in the same order (the
servers check that they agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_SLICE_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class Slice:
    """Elements [start, stop) of a key's flattened value, held by one server."""

    server: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def split(numel: int, parts: int) -> list[tuple[int, int]]:
    """Near-equal contiguous ranges covering 0..numel: the first numel % parts get one more."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass
class Placement:
    num_servers: int
    slice_elements: int = DEFAULT_SLICE_ELEMENTS
    max_slice_bytes: int | None = None
    """No slice bigger than this (None: no limit)."""
    load: list[int] = field(default_factory=list)
    """Bytes placed on each server so far."""

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError(f"num_servers={self.num_servers!r} must be >= 1 for a parameter server")
        if self.slice_elements < 1:
            raise ValueError(f"slice_elements={self.slice_elements!r} must be >= 1")
        if self.max_slice_bytes is not None and self.max_slice_bytes < 1:
            raise ValueError(f"max_slice_bytes={self.max_slice_bytes!r} must be >= 1 or None")
        self.load = self.load or [0] * self.num_servers

    def place(self, numel: int, itemsize: int, wire_bytes: int | None = None) -> list[Slice]:
        """`wire_bytes`: what a push of the whole key takes on the wire, where compression makes it
        smaller than numel * itemsize; max_slice_bytes caps that (a slice's frames are what it
        evens out), so a compressed key is cut into fewer slices."""
        if self.num_servers == 1:
            return self._add([Slice(0, 0, numel)], itemsize)
        size = numel * itemsize if wire_bytes is None else wire_bytes
        capped = 1 if self.max_slice_bytes is None else -(-size // self.max_slice_bytes)
        if numel > self.slice_elements and capped <= self.num_servers:
            return self._add(
                [Slice(s, a, b) for s, (a, b) in enumerate(split(numel, self.num_servers))], itemsize
            )
        parts = max(capped, self.num_servers if numel > self.slice_elements else 1)
        slices = []
        for a, b in split(numel, parts):  # each on the server holding the fewest bytes so far
            server = min(range(self.num_servers), key=lambda s: (self.load[s], s))
            slices += self._add([Slice(server, a, b)], itemsize)
        return slices

    def _add(self, slices: list[Slice], itemsize: int) -> list[Slice]:
        for piece in slices:
            self.load[piece.server] += piece.numel * itemsize
        return slices


def replicas(primary: int, num_servers: int, replication: int) -> list[int]:
    """The servers that hold a slice placed on `primary`: the primary, then its backups, the next
    servers in rank order (wrapping), as in the parameter server of Li et al. (OSDI 2014). When
    the primary dies the first live backup takes over, so the list is also the fail-over order."""
    if not isinstance(replication, int) or replication < 1:
        raise ValueError(f"replication={replication!r} must be an int >= 1")
    if replication > num_servers:
        raise ValueError(
            f"replication={replication} needs at least as many servers, but the job has {num_servers}"
        )
    if not 0 <= primary < num_servers:
        raise ValueError(f"primary={primary!r} is not a server rank below {num_servers}")
    return [(primary + i) % num_servers for i in range(replication)]
