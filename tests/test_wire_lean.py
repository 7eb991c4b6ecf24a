"""The lean frame header (transport/frame.py): what goes out lean, round trips, and refusals.

Unit tests without processes; one RPC server in this process for the connection-level refusal.
"""

from __future__ import annotations

import hashlib
import socket
import struct
from typing import Any

import msgpack
import pytest
import torch
from transport_fuzz import Session, lean_header, receive, signed

from paratrain.errors import TransportError
from paratrain.transport import frame, handshake
from paratrain.transport.client import RpcClient
from paratrain.transport.frame import FrameError
from paratrain.transport.rpc import Handler, Request, RpcServer
from paratrain.transport.tensors import BY_CODE, DTYPES, MAX_DIMS

pytestmark = pytest.mark.timeout(60)

KEY = hashlib.sha256(b"lean key").digest()
SECRET = bytes(range(32))


def _header_bytes(head: bytes) -> bytes:
    return head[frame.PREFIX.size :]


def test_dtype_codes_are_the_wire_table() -> None:
    # The codes are on the wire: this order may only grow at its end.
    names = ["float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool"]
    assert [DTYPES[n] for n in names] == list(BY_CODE[: len(names)])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_lean_round_trip_of_every_dtype_and_shape(dtype: torch.dtype) -> None:
    tensors = [torch.zeros(3, 4, dtype=dtype), torch.zeros((), dtype=dtype), torch.zeros(0, 5, dtype=dtype)]
    tensors.append(torch.zeros([1] * MAX_DIMS, dtype=dtype))
    for meta in ({}, {"key": "w", "n": [1, 2.5, None, b"x"]}):
        head, payload_len = frame.encode(KEY, 9, "push", (1 << 63) - 1, meta, tensors)
        assert _header_bytes(head)[0] == frame.LEAN
        header = receive(KEY, 9, head)
        assert (header.op, header.id, header.meta, header.at) == ("push", (1 << 63) - 1, meta, None)
        assert header.specs == [(t.dtype, tuple(t.shape)) for t in tensors]
        assert header.size == payload_len == sum(t.numel() * t.element_size() for t in tensors)


def test_lean_header_matches_the_format_and_skips_msgpack_when_meta_is_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fields = {"op": "\u00e9t\u00e9", "id": 7, "meta": {}, "tensors": [["int16", [2, 3]], ["bool", []]]}
    tensors = [torch.zeros(2, 3, dtype=torch.int16), torch.tensor(True)]
    head, _ = frame.encode(KEY, 0, fields["op"], 7, {}, tensors)
    assert _header_bytes(head) == lean_header(fields)  # the fuzzer's independent builder agrees

    def unpackb(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("msgpack ran for a lean header with empty meta")

    monkeypatch.setattr(frame.msgpack, "unpackb", unpackb)
    monkeypatch.setattr(frame.msgpack, "packb", unpackb)
    assert receive(KEY, 0, frame.encode(KEY, 0, "pull", 3, {}, tensors)[0]).op == "pull"


def test_frames_that_do_not_fit_the_lean_header_use_msgpack() -> None:
    long_op = "x" * 256
    for op, tensors, at in [
        (long_op, [], None),  # an op over 255 bytes
        ("push", [torch.zeros(1)] * 256, None),  # more than 255 tensors
        ("push", [torch.zeros(4)], 4096),  # a payload in the shared-memory ring
    ]:
        head, _ = frame.encode(KEY, 1, op, 5, {"k": 1}, tensors, at=at)
        assert _header_bytes(head)[0] != frame.LEAN
        header = receive(KEY, 1, head)
        assert (header.op, header.id, header.meta, header.at) == (op, 5, {"k": 1}, at)
        assert len(header.specs) == len(tensors)
    assert _header_bytes(frame.encode(KEY, 1, "x" * 255, 5, {}, [])[0])[0] == frame.LEAN


def _lean(
    op: bytes = b"push", id: int = 1, count: int | None = None, specs: bytes = b"", meta: bytes = b""
) -> bytes:
    n = (len(specs) > 0) if count is None else count
    return struct.pack("!BBQB", frame.LEAN, len(op), id, n) + op + specs + meta


def _spec(code: int, *dims: int) -> bytes:
    return struct.pack(f"!BB{len(dims)}Q", code, len(dims), *dims)


U8 = list(DTYPES).index("uint8")
MALFORMED = {
    "marker only": (bytes([frame.LEAN]), 0),
    "fixed part cut short": (_lean()[:8], 0),
    "op length 0": (_lean(op=b""), 0),
    "op past the end": (_lean()[:-1], 0),
    "op not UTF-8": (_lean(op=b"\xff\xfe"), 0),
    "id 2**63": (_lean(id=1 << 63), 0),
    "id max u64": (_lean(id=(1 << 64) - 1), 0),
    "unknown dtype code": (_lean(specs=_spec(len(BY_CODE), 1)), 1),
    "dtype code 255": (_lean(specs=_spec(255, 1)), 1),
    "too many dims": (_lean(specs=_spec(U8, *[1] * (MAX_DIMS + 1))), 1),
    "dims past the end": (_lean(specs=_spec(U8, 2, 3)[:-4]), 6),
    "spec cut short": (_lean(specs=b"\x08"), 0),
    "count over the specs": (_lean(count=2, specs=_spec(U8, 1)), 2),
    "dim 2**40": (_lean(specs=_spec(U8, 1 << 40)), 1 << 40),
    "strides overflow": (_lean(specs=_spec(4, 0, 1 << 39, 1 << 39, 1 << 39)), 0),
    "meta not msgpack": (_lean(meta=b"\xc1"), 0),
    "meta not a map": (_lean(meta=msgpack.packb([1, 2])), 0),
    "meta with trailing bytes": (_lean(meta=msgpack.packb({"a": 1}) + b"\x00"), 0),
    "meta with int keys": (_lean(meta=msgpack.packb({1: 2})), 0),
    "payload too short": (_lean(specs=_spec(0, 2, 3)), 23),
    "payload too long": (_lean(specs=_spec(0, 2, 3)), 25),
    "payload without tensors": (_lean(), 1),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_lean_header_with_valid_mac_is_refused(name: str) -> None:
    header, payload_len = MALFORMED[name]
    with pytest.raises(FrameError):
        receive(KEY, 0, signed(header, payload_len, KEY, 0))


def test_forged_lean_frames_are_refused_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    head, payload_len = frame.encode(KEY, 4, "push", 5, {"k": "v"}, [torch.zeros(2, 3)])
    signed_bits = len(head) * 8  # prefix and header; payload bytes are not hashed
    head += bytes(payload_len)  # as on the socket: a longer header length reads into the payload
    assert receive(KEY, 4, head).op == "push"

    def parse(*args: Any) -> Any:
        raise AssertionError("a forged frame reached the lean parser")

    monkeypatch.setattr(frame, "_decode_lean", parse)
    for key, seq in [(hashlib.sha256(b"other").digest(), 4), (KEY, 5), (KEY, 3)]:
        with pytest.raises(FrameError, match="MAC"):
            receive(key, seq, head)
    for bit in range(signed_bits):
        flipped = bytearray(head)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FrameError):
            receive(KEY, 4, bytes(flipped))


class _Echo(Handler):
    def handle(self, request: Request) -> None:
        request.reply(request.meta, request.tensors)


def test_server_drops_a_malformed_lean_frame_and_serves_on() -> None:
    server = RpcServer(SECRET, _Echo()).start()
    try:
        session = Session(server.host, server.port, SECRET)
        try:
            session.send(signed(*MALFORMED["unknown dtype code"], session.key, 0) + b"\x00")
            session.expect_closed()
        finally:
            session.close()
        client = RpcClient(server.host, server.port, SECRET)
        try:
            sent = torch.arange(256, dtype=torch.uint8)
            reply = client.call("echo", {"a": 1}, [sent], timeout_s=10)
            assert reply.meta == {"a": 1} and torch.equal(reply.tensors[0], sent)
        finally:
            client.close()
    finally:
        server.close()


def test_a_peer_of_another_wire_version_is_named() -> None:
    server_sock, client_sock = socket.socketpair()
    with server_sock, client_sock:
        client_sock.settimeout(10)
        server_sock.sendall(b"PTRAIN01" + bytes(handshake.NONCE_BYTES))
        with pytest.raises(TransportError, match="wire version b'01', this process b'02'"):
            handshake.connect(client_sock, SECRET)
