"""The job's figures as the scheduler sees them: the latest heartbeat report of every process, and
what differences between two reports say (rates, time per step split into its phases, a loss curve).

The scheduler calls `record(role, rank, report)` for each heartbeat that carries a report (once per
heartbeat interval per process); the dashboard and `/metrics` read `state()`. `roles` and `job` are
callables from the scheduler (who is registered, with host, pid, state and last heartbeat; the
job's outcome and failures), so the board holds only what heartbeats brought.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paratrain.metrics.telemetry import PHASES

HISTORY = 600
"""Points kept per worker curve (ten minutes at the default one-second heartbeat)."""
TOP_KEYS = 20


@dataclass
class _Seen:
    """The reports of one process: the latest, the one before it, and a curve of a few figures."""

    latest: dict[str, Any] = field(default_factory=dict)
    previous: dict[str, Any] = field(default_factory=dict)
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))


class JobBoard:
    def __init__(
        self,
        roles: Callable[[], list[dict[str, Any]]],
        job: Callable[[], dict[str, Any]],
        strategy: str | None = None,
    ) -> None:
        self._roles, self._job = roles, job
        self.strategy = strategy
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int], _Seen] = {}

    def record(self, role: str, rank: int, report: dict[str, Any]) -> None:
        """One heartbeat's report; cheap (called on the scheduler's connection thread)."""
        if not isinstance(report, dict):
            return
        report = {**report, "received": time.time()}
        with self._lock:
            seen = self._seen.setdefault((role, rank), _Seen())
            seen.previous, seen.latest = seen.latest, report
            if role == "worker":
                rate = _rate(seen, "samples")
                seen.history.append([report["received"], report.get("steps"), report.get("loss"), rate])
                if report.get("strategy") and not self.strategy:
                    self.strategy = str(report["strategy"])
            elif role == "server":
                seen.history.append([report["received"], _rate(seen, "bytes_in"), _rate(seen, "bytes_out")])

    def reports(self) -> dict[tuple[str, int], dict[str, Any]]:
        with self._lock:
            return {who: dict(seen.latest) for who, seen in self._seen.items()}

    # -- the page's data ----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Everything the dashboard shows, as plain JSON."""
        roles = self._roles()
        with self._lock:
            workers = [
                self._worker(rank, seen)
                for (role, rank), seen in sorted(self._seen.items())
                if role == "worker"
            ]
            servers = [
                self._server(rank, seen)
                for (role, rank), seen in sorted(self._seen.items())
                if role == "server"
            ]
        return {
            "job": {**self._job(), "strategy": self.strategy},
            "roles": roles,
            "workers": workers,
            "servers": servers,
            "keys": hottest_keys(servers),
            "staleness": staleness_total(servers),
            "now": time.time(),
        }

    @staticmethod
    def _worker(rank: int, seen: _Seen) -> dict[str, Any]:
        latest, previous = seen.latest, seen.previous
        steps = (latest.get("steps") or 0) - (previous.get("steps") or 0)
        split = {}
        for phase in PHASES:
            spent = latest.get("seconds", {}).get(phase, 0.0) - previous.get("seconds", {}).get(phase, 0.0)
            split[phase] = spent / steps if steps > 0 else None
        return {
            "rank": rank,
            "step": latest.get("steps", 0),
            "samples": latest.get("samples", 0),
            "samples_per_s": _rate(seen, "samples"),
            "loss": latest.get("loss"),
            "seconds_per_step": split,
            "seconds": latest.get("seconds", {}),
            "rss_bytes": latest.get("rss_bytes"),
            "peak_memory_bytes": latest.get("peak_memory_bytes"),
            "history": [[t, s, loss] for t, s, loss, _ in seen.history if loss is not None],
        }

    @staticmethod
    def _server(rank: int, seen: _Seen) -> dict[str, Any]:
        latest = seen.latest
        return {
            "rank": rank,
            **{name: latest.get(name, 0) for name in ("pushes", "pulls", "bytes_in", "bytes_out", "late")},
            **{f"{name}_per_s": _rate(seen, name) for name in ("pushes", "pulls", "bytes_in", "bytes_out")},
            "waiting_pulls": latest.get("waiting_pulls", 0),
            "open_rounds": latest.get("open_rounds", 0),
            "rss_bytes": latest.get("rss_bytes"),
            "tables": latest.get("tables", []),
            "keys": latest.get("keys", []),
            "staleness": latest.get("staleness", []),
            "history": list(seen.history),
        }


def _rate(seen: _Seen, name: str) -> float | None:
    """Per second between the last two reports of a counter, on the sender's clock."""
    a, b = seen.previous, seen.latest
    if name not in a or name not in b or "time" not in a or "time" not in b:
        return None
    elapsed = b["time"] - a["time"]
    return (b[name] - a[name]) / elapsed if elapsed > 0 else None


def hottest_keys(servers: list[dict[str, Any]], top: int = TOP_KEYS) -> list[dict[str, Any]]:
    """The keys with the most bytes moved (in + out), each with the server that holds it."""
    rows = [{**key, "server": s["rank"]} for s in servers for key in s["keys"]]
    rows.sort(key=lambda k: k.get("bytes_in", 0) + k.get("bytes_out", 0), reverse=True)
    return rows[:top]


def staleness_total(servers: list[dict[str, Any]]) -> list[list[int]]:
    """[[rounds behind, pushes], ...] summed over servers, by rounds behind."""
    total: dict[int, int] = {}
    for s in servers:
        for behind, count in s["staleness"]:
            total[int(behind)] = total.get(int(behind), 0) + int(count)
    return [[behind, total[behind]] for behind in sorted(total)]
