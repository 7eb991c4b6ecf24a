"""The frame codec: a fixed prefix, a header, and raw tensor bytes.

    prefix   header_len u32 | payload_len u64 | mac 16 bytes        (28 bytes, network order)
    header   lean or msgpack (below), header_len bytes
    payload  the tensors' bytes, one after another, exactly payload_len bytes

A frame on the socket with at most 255 tensors has a lean header, packed with struct (network order):

    lean     0xC1 | op_len u8 | id u64 | tensor count u8 | op (UTF-8) | specs | meta
    spec     dtype code u8 | ndim u8 | dims u64 * ndim       (code: tensors.BY_CODE)
    meta     a msgpack map; nothing at all for an empty one

Any other frame (a payload in the shared-memory ring, or more tensors) has a msgpack header:
    {"op": str, "id": int, "meta": map, "tensors": [[dtype, [dims]], ...], "at": ring position}.
0xC1 is the one byte msgpack never uses, so the first byte tells the two apart. A small request
or reply costs about a third of the Python with the lean header (no msgpack at all when its meta is
empty). Both are validated alike: every field, dtype, dim and length is checked, and a frame that
fails any check is refused.

mac = BLAKE2b-128 keyed with the direction key (RFC 7693's MAC mode, a third of HMAC-SHA256's cost
per frame) over seq u64 | header_len u32 | payload_len u64 | header, where seq
counts the frames sent on this connection in this direction. The MAC is checked before the header is
parsed, so an unauthenticated peer never reaches the parsers. Payload bytes are not hashed: hashing
runs at about half the speed of loopback TCP; use TLS where the network itself is untrusted. The
handshake's greeting names the wire version (handshake.MAGIC), so peers of different versions refuse
each other before any frame.

Everything here is pure (no sockets), so it is tested directly.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from paratrain.errors import TransportError
from paratrain.transport.tensors import BY_CODE, CODES, DTYPES, ITEMSIZE, MAX_DIMS, dtype_name, nbytes

PREFIX = struct.Struct("!IQ16s")
MAC_INPUT = struct.Struct("!QIQ")
MAC_BYTES = 16
MAX_TENSORS = 4096
LEAN = 0xC1
LEAN_HEAD = struct.Struct("!BBQB")  # marker, op length, id, tensor count
LEAN_SPECS = tuple(struct.Struct(f"!BB{n}Q") for n in range(MAX_DIMS + 1))  # by ndim
_SPEC_HEAD = struct.Struct("!BB")
_DIMS = tuple(struct.Struct(f"!{n}Q") for n in range(MAX_DIMS + 1))
LEAN_MAX_TENSORS = 255
MAX_DIM = 1 << 40


class FrameError(TransportError):
    """A frame that is malformed, oversized or fails its MAC; its connection is closed."""


@dataclass(frozen=True)
class Limits:
    """Caps a receiver enforces on every frame before it allocates or parses anything."""

    max_header_bytes: int = 64 * 1024
    max_payload_bytes: int = 1 << 34


@dataclass
class Header:
    """A parsed frame header. `specs` lists (dtype, shape) of the tensors in the payload."""

    op: str
    id: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    specs: list[tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=list)
    at: int | None = None
    """Where the payload starts in the shared-memory ring, if it is there and not on the socket."""
    size: int = 0
    """The payload's length in bytes."""


class MacKey:
    """One direction's key with BLAKE2b's keyed state computed once: copying that state costs
    less than keying a new hash for every frame."""

    __slots__ = ("_state",)

    def __init__(self, key: bytes) -> None:
        self._state = hashlib.blake2b(key=key, digest_size=MAC_BYTES)

    def tag(self, seq: int, header: bytes | memoryview, payload_len: int) -> bytes:
        h = self._state.copy()
        h.update(MAC_INPUT.pack(seq, len(header), payload_len) + header)  # one update: less Python
        return h.digest()


def mac(key: bytes | MacKey, seq: int, header: bytes | memoryview, payload_len: int) -> bytes:
    if isinstance(key, MacKey):
        return key.tag(seq, header, payload_len)
    data = MAC_INPUT.pack(seq, len(header), payload_len) + header
    return hashlib.blake2b(data, key=key, digest_size=MAC_BYTES).digest()


def encode(
    key: bytes | MacKey,
    seq: int,
    op: str,
    id: int,
    meta: dict[str, Any],
    tensors: Sequence[torch.Tensor],
    at: int | None = None,
    size: int | None = None,
) -> tuple[bytes, int]:
    """Prefix plus header bytes for one frame, and the payload length that must follow on the
    socket. With `at`, the payload is in the shared-memory ring at that position instead.
    `size`: the tensors' bytes, where the caller knows them already."""
    header = _lean_header(op, id, meta, tensors) if at is None and len(tensors) <= LEAN_MAX_TENSORS else None
    if header is None:
        header = _msgpack_header(op, id, meta, tensors, at)
    if at is not None:
        payload_len = 0
    elif size is not None:
        payload_len = size
    else:
        payload_len = sum(t.numel() * t.element_size() for t in tensors)
    return PREFIX.pack(len(header), payload_len, mac(key, seq, header, payload_len)) + header, payload_len


def _lean_header(op: str, id: int, meta: dict[str, Any], tensors: Sequence[torch.Tensor]) -> bytes | None:
    """The lean header, or None where the op does not fit one (the msgpack header carries it)."""
    name = op.encode()
    if not 0 < len(name) < 256:
        return None
    parts = [LEAN_HEAD.pack(LEAN, len(name), id, len(tensors)), name]
    for t in tensors:
        shape = t.shape
        code = CODES.get(t.dtype)
        if code is None:
            dtype_name(t.dtype)  # raises the TypeError that names the dtype
        parts.append(LEAN_SPECS[len(shape)].pack(code, len(shape), *shape))
    if meta:
        parts.append(msgpack.packb(meta))
    return b"".join(parts)


def _msgpack_header(
    op: str, id: int, meta: dict[str, Any], tensors: Sequence[torch.Tensor], at: int | None
) -> bytes:
    specs = [[dtype_name(t.dtype), list(t.shape)] for t in tensors]
    fields = {"op": op, "id": id, "meta": meta, "tensors": specs}
    if at is not None:
        fields["at"] = at
    return msgpack.packb(fields)


def check_prefix(
    prefix: bytes | bytearray | memoryview, limits: Limits, offset: int = 0
) -> tuple[int, int, bytes]:
    """The prefix at `offset` of `prefix`: (header length, payload length, MAC), within limits."""
    header_len, payload_len, tag = PREFIX.unpack_from(prefix, offset)
    if not 0 < header_len <= limits.max_header_bytes:
        raise FrameError(f"header length {header_len} outside 1..{limits.max_header_bytes}")
    if payload_len > limits.max_payload_bytes:
        raise FrameError(f"payload length {payload_len} over the cap {limits.max_payload_bytes}")
    return header_len, payload_len, tag


def decode_header(
    key: bytes | MacKey, seq: int, tag: bytes, header: bytes | memoryview, payload_len: int
) -> Header:
    """Verify the MAC, then parse and validate the header against the payload length."""
    if not hmac.compare_digest(mac(key, seq, header, payload_len), tag):
        raise FrameError(f"frame {seq} failed its MAC")
    if header[0] == LEAN:
        return _decode_lean(header, payload_len)
    try:
        raw = msgpack.unpackb(header, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many types on garbage; all mean the same here
        raise FrameError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(raw, dict):
        raise FrameError("header is not a map")
    op, id, meta, specs = raw.get("op"), raw.get("id"), raw.get("meta"), raw.get("tensors")
    if not isinstance(op, str) or not op:
        raise FrameError(f"header op {op!r} is not a non-empty string")
    if not isinstance(id, int) or isinstance(id, bool) or not 0 <= id < 1 << 63:
        raise FrameError(f"header id {id!r} is not a non-negative integer")
    if not isinstance(meta, dict):
        raise FrameError("header meta is not a map")
    parsed = _parse_specs(specs)
    total = sum(nbytes(dtype, shape) for dtype, shape in parsed)
    at = raw.get("at")
    if at is not None:
        if not isinstance(at, int) or isinstance(at, bool) or not 0 <= at < 1 << 62 or payload_len:
            raise FrameError(f"shared-memory position {at!r} is not valid here")
    elif total != payload_len:
        raise FrameError(f"tensors need {total} bytes but the payload has {payload_len}")
    return Header(op, id, meta, parsed, at, total)


def _decode_lean(header: bytes | memoryview, payload_len: int) -> Header:
    end = len(header)
    if end < LEAN_HEAD.size:
        raise FrameError(f"lean header of {end} bytes is shorter than its fixed part")
    _, op_len, id, count = LEAN_HEAD.unpack_from(header)
    at = LEAN_HEAD.size + op_len
    if not op_len or at > end:
        raise FrameError(f"lean header op length {op_len} is 0 or past the header's end")
    try:
        op = str(header[LEAN_HEAD.size : at], "utf-8")
    except UnicodeDecodeError:
        raise FrameError("lean header op is not UTF-8") from None
    if id >= 1 << 63:
        raise FrameError(f"header id {id} is over 2**63 - 1")
    specs = []
    total = 0
    for _ in range(count):
        if at + 2 > end:
            raise FrameError("lean header ends inside a tensor spec")
        code, ndim = _SPEC_HEAD.unpack_from(header, at)
        if code >= len(BY_CODE) or ndim > MAX_DIMS or at + 2 + 8 * ndim > end:
            raise FrameError(f"lean tensor spec (dtype code {code}, {ndim} dims) is not valid")
        shape = _DIMS[ndim].unpack_from(header, at + 2)
        at += 2 + 8 * ndim
        dtype = BY_CODE[code]
        specs.append((dtype, shape))
        total += _checked_bytes(dtype, shape)
    meta: Any = {}
    if at < end:
        try:
            meta = msgpack.unpackb(header[at:], raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # as above: any garbage means the same
            raise FrameError(f"lean header meta is not valid msgpack: {exc}") from None
        if not isinstance(meta, dict):
            raise FrameError("lean header meta is not a map")
    if total != payload_len:
        raise FrameError(f"tensors need {total} bytes but the payload has {payload_len}")
    return Header(op, id, meta, specs, None, total)


def _checked_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """The bytes of a tensor of this shape, once its dims are checked (one call per tensor)."""
    if len(shape) == 1:  # the common case: a flat tensor
        if shape[0] >= MAX_DIM:
            raise FrameError(f"tensor shape {list(shape)} has a bad dimension")
        return ITEMSIZE[dtype] * shape[0]
    extent = 1  # the product of the dims counting 0 as 1: bounds strides of empty tensors too
    for d in shape:
        if d >= MAX_DIM:
            raise FrameError(f"tensor shape {list(shape)} has a bad dimension")
        extent *= max(d, 1)
    if extent >= 1 << 62:
        raise FrameError(f"tensor shape {list(shape)} is too large")
    return nbytes(dtype, shape)


def _parse_specs(specs: Any) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
        raise FrameError(f"header tensors is not a list of at most {MAX_TENSORS} specs")
    parsed = []
    for spec in specs:
        if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str) and spec[0] in DTYPES):
            raise FrameError(f"tensor spec {spec!r} is not [dtype, shape]")
        shape = spec[1]
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise FrameError(f"tensor shape {shape!r} is not a list of at most {MAX_DIMS} dims")
        extent = 1  # the product of the dims counting 0 as 1: bounds strides of empty tensors too
        for d in shape:
            if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < MAX_DIM:
                raise FrameError(f"tensor shape {shape!r} has a bad dimension")
            extent *= max(d, 1)
        if extent >= 1 << 62:
            raise FrameError(f"tensor shape {shape!r} is too large")
        parsed.append((DTYPES[spec[0]], tuple(shape)))
    return parsed
