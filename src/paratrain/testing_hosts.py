"""Simulated hosts for tests and benchmarks: N network namespaces on one private bridge.

    with SimulatedHosts(4, rate="1gbit") as hosts:
        hosts.run(0, ["ip", "addr"])                    # a command on host 0
        hosts.prefix(2)                                 # ["ip", "netns", "exec", "<ns>"]
        hosts.address(2)                                # "10.77.0.3"

Layout: a namespace `<tag>-br` holds a bridge `br0`; host i is a namespace `<tag>-<i>` whose only
link, `eth0` (address `<subnet>.<i+1>/24`), is one end of a veth pair whose other end, `h<i>`, is a
port of the bridge. Nothing is created in the caller's namespace, so test traffic can only reach
these namespaces (and each one's own loopback, which is up).

Shaping: with `rate`, a `tbf` qdisc sits on both ends of each veth: on `eth0` it limits what host i
sends, on `h<i>` what it receives (netem is missing from this kernel, and tbf on both ends is what a
switched full-duplex link looks like). `burst` is one TSO/GSO super-packet (64 KiB) plus headroom,
so tbf never has to split one; `limit` is the queue held before dropping (4 MiB, 32 ms at
1 Gbit/s; see LinkShape). Both are arguments.

Everything is removed when the block ends, and namespaces left by an earlier run whose process is
gone (a crashed or killed test) are removed when the next one starts: every name starts with
`ptsim<pid>`, and only names of dead pids are touched.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from paratrain.system import process_alive

if TYPE_CHECKING:
    from paratrain.launch.engines.local.job import ProcessHost

logger = logging.getLogger(__name__)

PREFIX = "ptsim"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")
_RUN_S = 30.0
_SERIAL = itertools.count()


def hosts_unavailable() -> str | None:
    """Why simulated hosts cannot be made here (for pytest's skip reason), or None if they can."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces)"
    if shutil.which("ip") is None:
        return "simulated hosts need iproute2's `ip`"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, timeout=_RUN_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns` does not work here: {exc}"
    return None


def shaping_unavailable() -> str | None:
    """Why links cannot be shaped here (no `tc`), or None."""
    return None if shutil.which("tc") else "shaping links needs iproute2's `tc`"


@dataclass(frozen=True)
class LinkShape:
    """A token-bucket limit on each direction of each host's link."""

    rate: str
    """tc's rate syntax, e.g. "1gbit" or "100mbit"."""
    burst_bytes: int = 128 * 1024
    """Bytes sent at once above the rate; at least one 64 KiB GSO packet, so tbf never splits one."""
    limit_bytes: int = 4 << 20
    """Bytes queued before packets drop: a deep-buffered switch port on the bridge side; on the
    host side, the NIC queue (1,000 packets by default, each up to a 64 KiB GSO packet) that
    TCP's small-queue limits keep from overflowing. With 1 MiB the host side dropped its own
    packets (several TCP flows at once)."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"\d+(\.\d+)?[kmg]?(bit|bps)", self.rate):
            raise ValueError(f"LinkShape.rate={self.rate!r} is not a tc rate such as '1gbit'")
        if not self.burst_bytes >= 65536:
            raise ValueError(f"LinkShape.burst_bytes={self.burst_bytes!r} must be >= 65536 (one GSO packet)")
        if not self.limit_bytes >= self.burst_bytes:
            raise ValueError(f"LinkShape.limit_bytes={self.limit_bytes!r} must be >= burst_bytes")

    def tc_args(self) -> list[str]:
        return ["tbf", "rate", self.rate, "burst", str(self.burst_bytes), "limit", str(self.limit_bytes)]


class SimulatedHosts:
    """`count` namespaces with addresses `<subnet>.1` ... on one bridge; see the module docstring."""

    def __init__(
        self,
        count: int,
        *,
        rate: str | None = None,
        shape: LinkShape | None = None,
        subnet: str = "10.77.0",
    ) -> None:
        """`rate` shapes every link with LinkShape's defaults; `shape` sets all of it."""
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 250:
            raise ValueError(f"count must be an int in 1..250, got {count!r}")
        if not re.fullmatch(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})", subnet):
            raise ValueError(f"subnet must be the first three octets, e.g. '10.77.0', got {subnet!r}")
        if rate is not None and shape is not None:
            raise ValueError("give rate or shape, not both")
        self.count = count
        self.shape = LinkShape(rate) if rate is not None else shape
        self.subnet = subnet
        self.tag = f"{PREFIX}{os.getpid()}-{next(_SERIAL)}"
        self.bridge = f"{self.tag}-br"
        self.names = [f"{self.tag}-{i}" for i in range(count)]
        self._made: list[str] = []

    # -- where things are
    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host i."""
        return ["ip", "netns", "exec", self.names[i]]

    def env(self, i: int) -> dict[str, str]:
        """What a process on host i needs in its environment: its address, and the interface Gloo
        must use (Gloo would otherwise look up the hostname, which names no namespace's address)."""
        return {"PARATRAIN_HOST": self.address(i), "GLOO_SOCKET_IFNAME": "eth0"}

    def placement(self, i: int) -> ProcessHost:
        """Where the local launcher starts a process that runs on host i."""
        from paratrain.launch.engines.local.job import ProcessHost  # the launcher, only where a job is placed

        return ProcessHost(self.address(i), tuple(self.prefix(i)), self.env(i))

    def run(self, i: int, cmd: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        """Runs `cmd` on host i to its end (check=True, output captured as text)."""
        return _run([*self.prefix(i), *cmd], **kwargs)

    # -- lifetime
    def __enter__(self) -> SimulatedHosts:
        remove_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _create(self) -> None:
        self._add_namespace(self.bridge)
        _ip(self.bridge, "link", "add", "br0", "type", "bridge")
        _ip(self.bridge, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            self._add_namespace(name)
            port = f"h{i}"
            _ip(self.bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip(self.bridge, "link", "set", port, "master", "br0")
            _ip(self.bridge, "link", "set", port, "up")
            _ip(name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip(name, "link", "set", "eth0", "up")
            if self.shape is not None:
                _run(["tc", "-n", name, "qdisc", "add", "dev", "eth0", "root", *self.shape.tc_args()])
                _run(["tc", "-n", self.bridge, "qdisc", "add", "dev", port, "root", *self.shape.tc_args()])

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        _ip(name, "link", "set", "lo", "up")

    def close(self) -> None:
        """Deletes every namespace made (their veths go with them); safe to call twice."""
        for name in reversed(self._made):
            _delete(name)
        self._made = []

    def listening_ports(self, i: int) -> set[int]:
        """TCP ports in LISTEN state on host i."""
        ports: set[int] = set()
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):
            rows = self.run(i, ["cat", name], check=False).stdout.splitlines()[1:]
            for row in rows:
                fields = row.split()
                if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        return ports


def remove_stale() -> list[str]:
    """Deletes namespaces that an earlier run, whose process is gone, left behind; returns them."""
    listed = _run(["ip", "netns", "list"]).stdout.split()
    stale = []
    for name in listed:
        match = _NAME.match(name)
        if match and not process_alive(int(match[1])):
            stale.append(name)
            _delete(name)
    if stale:
        logger.warning("removed network namespaces of an earlier run: %s", ", ".join(stale))
    return stale


def _delete(name: str) -> None:
    result = _run(["ip", "netns", "delete", name], check=False)
    if result.returncode != 0 and "No such file" not in result.stderr:
        logger.warning("could not delete network namespace %s: %s", name, result.stderr.strip())


def _ip(namespace: str, *args: str) -> None:
    _run(["ip", "-n", namespace, *args])


def _run(cmd: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    options: dict[str, object] = {"check": True, "capture_output": True, "text": True, "timeout": _RUN_S}
    options.update(kwargs)
    try:
        return subprocess.run(list(cmd), **options)  # type: ignore[call-overload]
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {exc.returncode}): {exc.stderr.strip()}") from None
