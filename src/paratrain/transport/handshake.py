"""Mutual challenge-response on the per-job secret, and the per-connection frame keys.

    server -> client   MAGIC (8 bytes) | server nonce (32)
    client -> server   client nonce (32) | HMAC(secret, "client" | server nonce | client nonce)
    server -> client   HMAC(secret, "server" | client nonce | server nonce)

Neither side sends the secret. Both then derive one key per direction from the secret and both nonces,
so a frame recorded on one connection fails its MAC on any other, and the frame sequence numbers stop
replays within a connection.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

from paratrain.errors import AuthenticationError, TransportError

MAGIC = b"PTRAIN02"  # the wire's version: 02 added the lean frame header (frame.py)
NONCE_BYTES = 32


class HandshakeClosed(TransportError):
    """The peer closed the connection in the middle of the handshake (a server under a flood
    drops handshakes: trying again may succeed)."""


class NotParatrain(TransportError):
    """The peer's greeting is not paratrain's: another program listens on that port."""


class NoGreeting(HandshakeClosed):
    """The peer accepted the connection but sent no paratrain greeting within the handshake
    timeout: a stalled endpoint, or another program listening on that port."""


def _hmac(key: bytes, *parts: bytes) -> bytes:
    return hmac.digest(key, b"".join(parts), hashlib.sha256)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise HandshakeClosed(f"peer closed the connection during the handshake ({got}/{n} B)")
        got += k
    return bytes(buf)


def _keys(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, bytes]:
    session = _hmac(secret, b"session", server_nonce, client_nonce)
    return _hmac(session, b"client-to-server"), _hmac(session, b"server-to-client")


def accept(sock: socket.socket, secret: bytes) -> tuple[bytes, bytes]:
    """Server side. Returns (receive key, send key); raises AuthenticationError on a bad peer."""
    server_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + server_nonce)
    reply = _recv_exact(sock, NONCE_BYTES + 32)
    client_nonce, proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _hmac(secret, b"client", server_nonce, client_nonce)):
        raise AuthenticationError("client does not hold the job secret")
    sock.sendall(_hmac(secret, b"server", client_nonce, server_nonce))
    c2s, s2c = _keys(secret, server_nonce, client_nonce)
    return c2s, s2c


def connect(sock: socket.socket, secret: bytes) -> tuple[bytes, bytes]:
    """Client side. Returns (receive key, send key); raises AuthenticationError on a bad peer."""
    try:
        hello = _recv_exact(sock, len(MAGIC) + NONCE_BYTES)
    except TimeoutError:  # a paratrain endpoint greets as soon as it accepts
        raise NoGreeting("the peer accepted the connection but sent no paratrain greeting") from None
    if hello[: len(MAGIC)] != MAGIC:
        if hello[:6] == MAGIC[:6]:
            raise TransportError(
                f"peer speaks paratrain wire version {hello[6:8]!r}, this process {MAGIC[6:]!r}: "
                "run one paratrain version on every host"
            )
        raise NotParatrain(f"peer is not a paratrain endpoint (greeting {hello[:8]!r})")
    server_nonce = hello[len(MAGIC) :]
    client_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(client_nonce + _hmac(secret, b"client", server_nonce, client_nonce))
    try:
        proof = _recv_exact(sock, 32)
    except TransportError:
        raise AuthenticationError("server refused our handshake: wrong job secret?") from None
    if not hmac.compare_digest(proof, _hmac(secret, b"server", client_nonce, server_nonce)):
        raise AuthenticationError("server does not hold the job secret")
    c2s, s2c = _keys(secret, server_nonce, client_nonce)
    return s2c, c2s
