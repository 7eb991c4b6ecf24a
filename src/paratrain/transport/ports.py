"""Binding a listening port, with one line that says what went wrong and which setting changes it.

A port already taken used to end a command with Python's traceback of `bind` ("[Errno 98] Address
already in use"), naming neither the port nor how to pick another. `binding` turns the errors of
binding into a `PortUnavailable` that names both; the commands print it as one line.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

from paratrain.errors import TransportError

_WHY = {
    errno.EADDRINUSE: "is taken by another process",
    errno.EACCES: "needs privileges this process does not have (ports below 1024 do)",
    errno.EADDRNOTAVAIL: "is on an address this machine does not have",
}


class PortUnavailable(TransportError):
    """A port that cannot be listened on; the message names it and the setting that changes it."""


@contextlib.contextmanager
def binding(host: str, port: int, change: str) -> Iterator[None]:
    """Bind in the block; a port that is taken (or forbidden) raises PortUnavailable, naming
    `host:port` and `change` (what to set instead, e.g. "choose another with --port")."""
    try:
        yield
    except OSError as exc:
        why = _WHY.get(exc.errno or 0)
        if why is None:
            raise
        raise unavailable(host, port, why, change) from None


def unavailable(host: str, port: int, why: str, change: str) -> PortUnavailable:
    """The error that says `port` on `host` cannot be used, `why`, and the setting that changes it.
    Also raised by those that only connect there: a listener that is no paratrain endpoint."""
    shown = f"[{host}]" if ":" in host else host
    return PortUnavailable(f"port {port} on {shown} {why}: {change}")


TAKEN = _WHY[errno.EADDRINUSE]
