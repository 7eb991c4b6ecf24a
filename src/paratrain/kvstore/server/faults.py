"""A test-only knob (in the manner of ps-lite's PS_DROP_MSG): a server SIGKILLs itself at a named
moment of the job's life, so that tests lose a server at every moment, start-up and end included,
not only mid-round.

    PARATRAIN_TEST_KILL_SERVER="RANK MOMENT [N]"

MOMENT is `start` (listening, before it registers with the scheduler), `started` (registered: the
job started, before it serves anything), or a kvstore request's op (`configure`, `init`,
`set_optimizer`, `set_hyper`, `push`, `pushpull`, `get_state`, `leave`, ...): the server dies on
receiving its N-th request of that op (default the first), before handling it. Read by the server's
entry point (node.py) only; a restarted server (`--max-restarts`) reads it again, so tests that
restart servers do not use it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENV_VAR = "PARATRAIN_TEST_KILL_SERVER"


@dataclass(frozen=True)
class KillAt:
    """Where this server dies: `moment` (see the module docstring), at its `count`-th occurrence."""

    moment: str
    count: int = 1

    def __post_init__(self) -> None:
        if not self.moment or not self.moment.replace("_", "").isalpha():
            raise ValueError(f"{ENV_VAR}: moment {self.moment!r} is not a moment or an op name")
        if self.count < 1:
            raise ValueError(f"{ENV_VAR}: count {self.count!r} must be >= 1")


def kill_at(rank: int, env: Mapping[str, str] | None = None) -> KillAt | None:
    """The moment server `rank` is to die at, from the environment; None for every other server."""
    text = (os.environ if env is None else env).get(ENV_VAR, "").split()
    if not text:
        return None
    if len(text) not in (2, 3) or not text[0].isdigit() or (len(text) == 3 and not text[2].isdigit()):
        raise ValueError(f"{ENV_VAR}={' '.join(text)!r} is not 'RANK MOMENT [N]'")
    if int(text[0]) != rank:
        return None
    return KillAt(text[1], int(text[2]) if len(text) == 3 else 1)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def at(point: KillAt | None, moment: str) -> None:
    """Dies here if `point` names `moment` (the start-up moments: counted once)."""
    if point is not None and point.moment == moment:
        die()


class KillingHandler:
    """A server's request handler that dies on the `count`-th request of op `moment`."""

    def __init__(self, handler: Any, point: KillAt) -> None:
        self._handler, self._point = handler, point
        self._seen = 0
        self._lock = threading.Lock()

    def handle(self, request: Any) -> None:
        if request.op == self._point.moment:
            with self._lock:
                self._seen += 1
                if self._seen == self._point.count:
                    die()
        self._handler.handle(request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)


def armed(handler: Any, point: KillAt | None) -> Any:
    """`handler`, dying at `point` if that is a request's op."""
    if point is None or point.moment in ("start", "started"):
        return handler
    return KillingHandler(handler, point)
