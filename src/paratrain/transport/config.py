"""What a user may set about the wire."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TLSConfig:
    """TLS around every connection, for networks that are not trusted. Payloads are then encrypted
    and authenticated by TLS; the handshake and frame MACs still run inside it."""

    certfile: str
    """This process's certificate (PEM); servers and clients present it."""
    keyfile: str
    """The private key of certfile (PEM)."""
    cafile: str
    """The CA (PEM) that peers' certificates must chain to."""


@dataclass(frozen=True)
class TransportConfig:
    connect_timeout_s: float = 60.0
    """How long a client keeps retrying a connection to a peer that is not listening yet."""
    handshake_timeout_s: float = 10.0
    """How long an accepted connection may take to authenticate before it is dropped: a deadline
    for the whole handshake, however the peer spreads its bytes."""
    max_handshakes: int = 128
    """Connections a server holds in their handshake at once (each costs a thread and a
    descriptor); past it, the oldest is dropped to make room."""
    max_handshakes_per_host: int = 32
    """The same, per peer address: one host cannot take every handshake slot of a server (on
    one machine every peer is 127.0.0.1, so there it is max_handshakes or less)."""
    request_timeout_s: float = 600.0
    """The default limit on waiting for one reply."""
    max_header_bytes: int = 64 * 1024
    """Frames with a larger header are refused and their connection closed."""
    max_payload_bytes: int = 1 << 34
    """Frames with a larger payload are refused and their connection closed."""
    tls: TLSConfig | None = None
    shm_ring_bytes: int = 128 << 20
    """Same-host peers move payloads through two shared-memory rings of this size per connection
    (pages are only used as written); 0 turns the same-host path off."""
    shm_min_bytes: int = 64 << 10
    """Smaller payloads go over the socket, where the syscall they ride on is already paid."""
    congestion_control: str | None = "cubic"
    """TCP congestion control of every connection (TCP_CONGESTION; None: the system's default).
    Why not the system's where that is bbr: a push and a pull load a link both ways at once, so
    each direction's ACKs queue behind the other direction's data, and bbr, which holds its data
    in flight to about twice the bandwidth times the unloaded round trip, then sends far below the
    link rate. On 1 Gbit/s links (benchmarks/hosts.py) cubic gave 0.77-0.78 s per 64 MB push+pull
    against 0.81-0.86 s with bbr, 0.61-0.63 s against 0.67-0.68 s with slices of 512 KiB. Where
    the kernel lacks the algorithm or refuses it, the connection keeps the default."""
    server_recv_buffer_bytes: int | None = 1 << 20
    """SO_RCVBUF of every connection a server accepts (None: the kernel's autotuning, which grows
    a busy connection's buffer to many MiB). Why a cap: a peer keeps up to the receive window in
    flight, so uncapped push flows fill the queue in front of a server's link (a switch port's, on
    benchmarks' simulated hosts a 4 MiB tbf queue: 32 ms at 1 Gbit/s), and a backup's replica and
    its confirmation wait behind them; a round's pulls wait for that confirmation. With 1 MiB
    (the kernel doubles it for its bookkeeping), replication=2 across hosts on 1 Gbit/s links took
    0.98-1.06 s per 64 MB pushpull against 1.07-1.13 s uncapped, the unreplicated job unchanged
    (benchmarks/failures_servers.py, hosts row). A flow's rate is capped at about the window over
    its round trip, so on links with a larger bandwidth-delay product than 1 MiB per connection
    (e.g. 10 Gbit/s at 1 ms with one worker) raise it or set None. Where it is above
    net.core.rmem_max, which the kernel would cut it to, autotuning stays."""

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "handshake_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"TransportConfig.{name}={value!r} must be > 0")
        for name in ("max_handshakes", "max_handshakes_per_host"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TransportConfig.{name}={value!r} must be an int >= 1")
        if not 64 <= self.max_header_bytes <= 128 * 1024:
            raise ValueError(
                f"TransportConfig.max_header_bytes={self.max_header_bytes!r} must be in 64..131072"
            )
        if not 0 <= self.shm_ring_bytes <= 1 << 32:
            raise ValueError(f"TransportConfig.shm_ring_bytes={self.shm_ring_bytes!r} must be in 0..2**32")
        if self.congestion_control is not None and not (
            isinstance(self.congestion_control, str) and self.congestion_control.isalnum()
        ):
            raise ValueError(
                f"TransportConfig.congestion_control={self.congestion_control!r} must be a name such as "
                "'cubic', or None"
            )
        if self.server_recv_buffer_bytes is not None and not (
            not isinstance(self.server_recv_buffer_bytes, bool)
            and isinstance(self.server_recv_buffer_bytes, int)
            and self.server_recv_buffer_bytes >= 4096
        ):
            raise ValueError(
                f"TransportConfig.server_recv_buffer_bytes={self.server_recv_buffer_bytes!r} must be an int "
                ">= 4096, or None"
            )
        if not self.shm_min_bytes >= 1:
            raise ValueError(f"TransportConfig.shm_min_bytes={self.shm_min_bytes!r} must be >= 1")
        if not self.max_payload_bytes >= 0:
            raise ValueError(f"TransportConfig.max_payload_bytes={self.max_payload_bytes!r} must be >= 0")
