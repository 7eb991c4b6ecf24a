"""A fuzzer for paratrain servers: random and mutated frames, each checked against what the frame
codec says the server must do with it.

`fuzz_server` mixes (a) garbage in place of the handshake, (b) authenticated connections that send
frames with a wrong prefix or MAC, (c) frames with a valid MAC over wrong, mutated or random headers
(msgpack and lean), so both header parsers are exercised, and (d) valid frames with ops no server
serves (each gets an error reply and the connection stays). A refused frame must close its
connection without an answer; an accepted one must be answered in order. Seeded, so a run is reproducible.

tests/test_transport.py runs it in-process and as a job; the job's script imports this module by path,
so it imports nothing from pytest.
"""

from __future__ import annotations

import hashlib
import hmac
import random
import socket
import struct
from collections import Counter
from typing import Any

import msgpack
import torch

from paratrain.errors import TransportError
from paratrain.transport import frame, handshake
from paratrain.transport.connection import Connection, tune
from paratrain.transport.frame import Header, Limits
from paratrain.transport.rpc import Handler, Request
from paratrain.transport.tensors import DTYPES, MAX_DIMS, byte_view, nbytes


def receive(key: bytes, seq: int, data: bytes, limits: Limits | None = None) -> Header:
    """What a receiver does with the prefix and header at the start of `data`."""
    header_len, payload_len, tag = frame.check_prefix(data[: frame.PREFIX.size], limits or Limits())
    header = data[frame.PREFIX.size : frame.PREFIX.size + header_len]
    return frame.decode_header(key, seq, tag, header, payload_len)


def signed(header: bytes, payload_len: int, key: bytes, seq: int) -> bytes:
    """Prefix plus header with a valid MAC, whatever the header holds."""
    tag = frame.mac(key, seq, header, payload_len)
    return frame.PREFIX.pack(len(header), payload_len, tag) + header


def flip_bits(rng: random.Random, data: bytearray, count: int) -> None:
    """Flips `count` distinct bits of `data`: a bit drawn twice would flip back (seed 7 once
    flipped one bit twice, sent a valid frame and then blamed the server for answering it)."""
    for bit in rng.sample(range(len(data) * 8), count):
        data[bit // 8] ^= 1 << (bit % 8)


def refused(key: bytes, seq: int, data: bytes) -> bool:
    """Whether a receiver at sequence number `seq` must refuse the frame at the start of `data`
    (`data` is all we send before closing our side: a header cut short is refused too)."""
    try:
        header_len = frame.PREFIX.unpack(data[: frame.PREFIX.size])[0]
        if len(data) < frame.PREFIX.size + header_len:
            return True
        receive(key, seq, data)
    except (frame.FrameError, struct.error):
        return True
    return False


IO_TIMEOUT_S = 30.0
# Ops no server serves ("ping" is added where wanted): every server must answer them with an error.
_OPS = ["fuzz", "fuzz.push", "reply", "error", "\u00e9t\u00e9", "op" * 50]


class Session:
    """A raw authenticated connection: frames go out as bytes we build; replies come back
    through a Connection, which checks their MACs and sequence numbers."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self.sock = socket.create_connection((host, port), timeout=IO_TIMEOUT_S)
        try:
            tune(self.sock)  # no Nagle: frames go out at once, as the real client's do
            recv_key, self.key = handshake.connect(self.sock, secret)
        except BaseException:
            self.sock.close()
            raise
        self.conn = Connection(self.sock, recv_key, self.key, f"{host}:{port}")
        self.seq = 0
        self.expected: list[tuple[int, str, bytes, bytes]] = []

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def drain(self) -> int:
        """Reads every reply the server owes us and checks it; returns how many."""
        count = len(self.expected)
        for id, op, meta, payload in self.expected:
            header, tensors = self.conn.read()
            assert (header.id, header.op) == (id, op), (header, id, op)
            if op == "reply":
                assert msgpack.packb(header.meta) == meta
                assert b"".join(bytes(byte_view(t)) for t in tensors) == payload
            else:
                assert isinstance(header.meta.get("message"), str), header.meta
        self.expected.clear()
        return count

    def expect_closed(self) -> None:
        """Stops sending and checks that the server closes without answering anything."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            header, _ = self.conn.read()
        except TransportError:
            return  # closed, or reset because it left our bytes unread
        raise AssertionError(f"server answered a frame it should have refused: {header}")

    def close(self) -> None:
        self.conn.close()


def _random_text(rng: random.Random, n: int) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz_0123456789 \u00e9\u4e2d\U0001f600"
    return "".join(rng.choice(alphabet) for _ in range(n))


def _random_value(rng: random.Random, depth: int = 2, any_keys: bool = False) -> Any:
    kind = rng.randrange(9 if depth > 0 else 7)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, 1, -1, 127, 128, 255, 256, -33, 1 << 31, (1 << 63) - 1, -(1 << 63)])
    if kind == 2:
        return rng.randrange(-(1 << 63), 1 << 64)
    if kind == 3:
        return struct.unpack("!d", rng.randbytes(8))[0]
    if kind == 4:
        return _random_text(rng, rng.randrange(40))
    if kind == 5:
        return rng.randbytes(rng.randrange(40))
    if kind == 6:
        return msgpack.ExtType(rng.randrange(128), rng.randbytes(rng.randrange(9)))
    if kind == 7:
        return [_random_value(rng, depth - 1, any_keys) for _ in range(rng.randrange(5))]
    keys = [_random_text(rng, rng.randrange(1, 8)) for _ in range(rng.randrange(5))]
    if any_keys and rng.random() < 0.3:
        keys.append(rng.choice([1, -1, 2.5, None, b"k"]))
    return {k: _random_value(rng, depth - 1, any_keys) for k in keys}


def _random_meta(rng: random.Random) -> dict[str, Any]:
    return {_random_text(rng, rng.randrange(1, 6)): _random_value(rng, 1) for _ in range(4)}


def _random_specs(rng: random.Random) -> list[list[Any]]:
    names = list(DTYPES)
    return [
        [rng.choice(names), [rng.randrange(4) for _ in range(rng.randrange(4))]]
        for _ in range(rng.randrange(4))
    ]


def _valid_header(rng: random.Random, op: str | None = None) -> tuple[dict[str, Any], int]:
    specs = _random_specs(rng)
    payload_len = sum(nbytes(DTYPES[d], s) for d, s in specs)
    id = 0 if rng.random() < 0.2 else rng.randrange(1, 1 << 63)
    fields = {"op": op or rng.choice(_OPS), "id": id, "meta": _random_meta(rng), "tensors": specs}
    return fields, payload_len


def _wrong_header(rng: random.Random) -> tuple[bytes, int]:
    """A header that is structurally or semantically wrong (a few by chance are still valid)."""
    fields, payload_len = _valid_header(rng, op=rng.choice(["ping", *_OPS]))
    kind = rng.randrange(12)
    if kind == 0:
        del fields[rng.choice(list(fields))]
    elif kind == 1:
        fields["op"] = rng.choice([None, 0, "", b"ping", ["ping"], 1.5, True])
    elif kind == 2:
        fields["id"] = rng.choice([-1, True, False, 1 << 63, (1 << 64) - 1, "1", 1.5, None])
    elif kind == 3:
        fields["meta"] = rng.choice([None, [], "m", 3, b"x", [("a", 1)]])
    elif kind == 4:
        fields["tensors"] = rng.choice([None, {}, "x", 3, [["float32"]], ["float32", [1]]])
    elif kind == 5:
        dtype = rng.choice(["float128", "complex64", "", b"float32", 3, None, True, ["f"], {"a": 1}])
        fields["tensors"] = [[dtype, [1]]]
        payload_len = 4
    elif kind == 6:
        shape = rng.choice([3, "3", None, {}, [-1], [True], [1.0], [1 << 40], [1] * (MAX_DIMS + 1), [2, -2]])
        fields["tensors"] = [["uint8", shape]]
        payload_len = rng.choice([0, 1, 4])
    elif kind == 7:  # sizes that need no bytes but whose strides overflow
        fields["tensors"] = [["float32", [0, 1 << 39, 1 << 39, 1 << 39]]]
        payload_len = 0
    elif kind == 8:
        fields["tensors"] = [["bool", []]] * 4097
        payload_len = 4097
    elif kind == 9:
        payload_len = max(0, payload_len + rng.choice([-3, -1, 1, 2, 64]))
    elif kind == 10:
        fields["extra"] = _random_value(rng, 1)  # unknown keys are ignored: a valid frame
    else:
        return msgpack.packb(_random_value(rng, 3, any_keys=True)), rng.randrange(8)
    return msgpack.packb(fields), payload_len


def _mutated_header(rng: random.Random, lean: bool = False) -> tuple[bytes, int]:
    """A valid header (msgpack, or `lean`) with bits flipped, a byte changed, cut short, bytes
    added, or the payload length it is sent with made wrong."""
    fields, payload_len = _valid_header(rng, op=rng.choice(["ping", *_OPS]))
    data = bytearray(lean_header(fields) if lean else msgpack.packb(fields))
    kind = rng.randrange(5)
    if kind == 0:
        flip_bits(rng, data, rng.randint(1, 3))
    elif kind == 1:
        data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 2:
        del data[rng.randrange(1, len(data)) :]
    elif kind == 3:
        data += rng.randbytes(rng.randint(1, 8))
    else:
        payload_len = max(0, payload_len + rng.choice([-3, -1, 1, 2, 64]))
    return bytes(data), payload_len


def lean_header(fields: dict[str, Any]) -> bytes:
    """The lean form (frame.py) of a valid header's fields, built here from the format itself."""
    name = fields["op"].encode()
    parts = [struct.pack("!BBQB", 0xC1, len(name), fields["id"], len(fields["tensors"])), name]
    for dtype, shape in fields["tensors"]:
        parts.append(struct.pack(f"!BB{len(shape)}Q", list(DTYPES).index(dtype), len(shape), *shape))
    if fields["meta"]:
        parts.append(msgpack.packb(fields["meta"]))
    return b"".join(parts)


def _valid_encoded(rng: random.Random, op: str | None = None) -> tuple[bytes, int]:
    fields, payload_len = _valid_header(rng, op)
    return (lean_header(fields) if rng.random() < 0.5 else msgpack.packb(fields)), payload_len


def _mutated_lean_header(rng: random.Random) -> tuple[bytes, int]:
    return _mutated_header(rng, lean=True)


def _server_accepts(key: bytes, seq: int, header: bytes, payload_len: int) -> Header | None:
    """What the server makes of a frame signed with our key: the parsed header, or None if it
    must close the connection. Counts on frame.py being right; the fuzz checks the server agrees."""
    try:
        parsed = receive(key, seq, signed(header, payload_len, key, seq))
        for dtype, shape in parsed.specs:
            torch.empty(shape, dtype=dtype)
    except Exception:
        return None
    return parsed


def _send_signed(
    session: Session, rng: random.Random, header: bytes, payload_len: int, stats: Counter
) -> bool:
    """Sends one frame with a valid MAC; returns whether the server keeps the connection."""
    parsed = _server_accepts(session.key, session.seq, header, payload_len)
    payload = rng.randbytes(payload_len)
    data = signed(header, payload_len, session.key, session.seq) + payload
    stats["frames"] += 1
    if parsed is None:
        session.drain()
        try:
            session.send(data)
        except OSError:
            pass  # refused as soon as the prefix arrived
        session.expect_closed()
        return False
    session.seq += 1
    session.send(data)
    if parsed.id:
        op = "reply" if parsed.op == "ping" else "error"
        session.expected.append((parsed.id, op, msgpack.packb(parsed.meta), payload))
    return True


def _fuzz_handshake(rng: random.Random, host: str, port: int, secret: bytes, stats: Counter) -> None:
    """(a) garbage in place of the client's half of the handshake."""
    with socket.create_connection((host, port), timeout=IO_TIMEOUT_S) as sock:
        stats["frames"] += 1
        stats["bad_handshakes"] += 1
        if rng.random() < 0.1:
            return  # connect and leave at once
        hello = handshake._recv_exact(sock, len(handshake.MAGIC) + handshake.NONCE_BYTES)
        assert hello.startswith(handshake.MAGIC)
        if rng.random() < 0.3:  # well formed, but made with another secret
            nonce = rng.randbytes(handshake.NONCE_BYTES)
            other = hashlib.sha256(secret + b"not").digest()
            proof = hmac.digest(other, b"client" + hello[8:] + nonce, hashlib.sha256)
            garbage = nonce + proof
        else:
            garbage = rng.randbytes(rng.choice([0, 1, 31, 63, 64, 64, 65, 200, 5000]))
        try:
            sock.sendall(garbage)
            sock.shutdown(socket.SHUT_WR)
            rest = sock.recv(64)
        except OSError:
            rest = b""
        assert rest == b"", f"server answered a client without the secret: {rest!r}"


def _closing_frame(rng: random.Random, session: Session, stats: Counter) -> None:
    """(b) a frame whose prefix or MAC is wrong: the server must close."""
    stats["frames"] += 1
    stats["bad_macs"] += 1
    if rng.random() < 0.3:
        data = rng.randbytes(frame.PREFIX.size)
        if rng.random() < 0.5:  # plausible lengths, so the server reads on to the MAC
            data = struct.pack("!IQ", rng.randrange(1, 200), rng.randrange(64)) + data[12:]
        data += rng.randbytes(rng.randrange(300))
    else:
        header, payload_len = _valid_encoded(rng)
        flipped = bytearray(signed(header, payload_len, session.key, session.seq))
        flip_bits(rng, flipped, rng.randint(1, 3))
        data = bytes(flipped) + rng.randbytes(payload_len)
    # The oracle: whatever we built, the codec must refuse it, or the server is right to answer.
    assert refused(session.key, session.seq, data), "a closing frame that the codec accepts"
    session.drain()
    try:
        session.send(data)
    except OSError:
        pass
    session.expect_closed()


def _fuzz_session(rng: random.Random, host: str, port: int, secret: bytes, stats: Counter) -> None:
    """(d) valid frames, mostly unknown ops, then (b) or (c) frames until one closes it."""
    session = Session(host, port, secret)
    try:
        for _ in range(rng.randrange(4)):
            header, payload_len = _valid_encoded(rng, op="ping" if rng.random() < 0.2 else None)
            _send_signed(session, rng, header, payload_len, stats)
            stats["valid_frames"] += 1
        stats["replies"] += session.drain()
        if rng.random() < 0.1:
            return  # an orderly goodbye
        while True:
            if rng.random() < 0.25:
                _closing_frame(rng, session, stats)
                return
            stats["parser_frames"] += 1
            pick = rng.random()
            make = _wrong_header if pick < 0.45 else _mutated_header if pick < 0.7 else _mutated_lean_header
            if not _send_signed(session, rng, *make(rng), stats):
                return
            stats["parser_frames_accepted"] += 1
    finally:
        session.close()


def fuzz_server(host: str, port: int, secret: bytes, *, frames: int = 10_000, seed: int = 0) -> Counter:
    """Sends at least `frames` random and mutated frames to the server at host:port and checks
    that it refuses each bad one by closing that connection, and answers each good one."""
    rng = random.Random(seed)
    stats: Counter = Counter()
    while stats["frames"] < frames:
        if rng.random() < 0.25:
            _fuzz_handshake(rng, host, port, secret, stats)
        else:
            _fuzz_session(rng, host, port, secret, stats)
            stats["sessions"] += 1
    return stats


class PingHandler(Handler):
    """What every paratrain server answers: "ping" echoes meta and tensors."""

    def handle(self, request: Request) -> None:
        if request.op == "ping":
            request.reply(request.meta, request.tensors)
        else:
            super().handle(request)
