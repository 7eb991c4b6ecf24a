"""Running a benchmark file again as a paratrain job (its --paratrain-role mode) and reading back the
result line that every worker prints. Kept apart from _anchors.py, which must not import paratrain."""

from __future__ import annotations

import io
import re
import sys
import threading
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

URL = re.compile(r"dashboard at (http://\S+)")


class DashboardWatcher(io.StringIO):
    """Job output that, once the dashboard's URL is printed, reads /api/state and /metrics every
    `every_s` seconds until closed: what an open browser tab and a Prometheus scrape cost the job."""

    def __init__(self, every_s: float = 1.0) -> None:
        super().__init__()
        self.every_s = every_s
        self.reads = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def write(self, text: str) -> int:
        found = URL.search(text)
        if found and self._thread is None:
            self._thread = threading.Thread(target=self._poll, args=(found[1],), daemon=True)
            self._thread.start()
        return super().write(text)

    def _poll(self, url: str) -> None:
        base, token = url.split("/?token=")
        headers = {"Authorization": f"Bearer {token}"}
        while not self._stop.wait(self.every_s):
            for path in ("/api/state", "/metrics"):
                try:
                    with urllib.request.urlopen(
                        urllib.request.Request(base + path, headers=headers), timeout=5
                    ) as r:
                        r.read()
                    self.reads += 1
                except OSError:
                    pass  # not serving yet, or gone

    def close_watch(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


def run_role_job(
    script: str,
    role_args: Sequence[str],
    workers: int,
    servers: int,
    timeout_s: float,
    result: re.Pattern,
    placements: Mapping[str, Sequence[Any]] | None = None,
    dashboard: bool = False,
    server_losses: int = 0,
) -> list[tuple[str, ...]] | None:
    """The groups of `result` matched in the job's output, one per worker; None (after printing the
    job's last stderr lines) when the job failed or a worker printed no result. `placements`: where
    each process runs (LocalJobConfig.placements; default all here). `dashboard`: the scheduler
    serves the dashboard, read every second while the job runs (DashboardWatcher).
    `server_losses`: servers that may die without failing the job (replicated servers)."""
    from paratrain.launch.engines.local.job import LocalJobConfig, run_local_job
    from paratrain.metrics.dashboard import DashboardConfig

    config = LocalJobConfig(
        script=script,
        args=tuple(role_args),
        num_workers=workers,
        num_servers=servers,
        timeout_s=timeout_s,
        placements=placements or {},
        dashboard=DashboardConfig() if dashboard else None,
        server_losses=server_losses,
    )
    out, err = DashboardWatcher(), io.StringIO()
    try:
        outcome = run_local_job(config, out=out, err=err)
    finally:
        out.close_watch()
    if dashboard and not out.reads:
        print("the dashboard was never read while the job ran", file=sys.stderr)
    found = [m.groups() for m in result.finditer(out.getvalue())]
    if outcome.exit_code != 0 or len(found) != workers:
        tail = "\n".join(err.getvalue().splitlines()[-40:])
        print(f"paratrain job {' '.join(role_args)} failed:\n{tail}", file=sys.stderr)
        return None
    return found
