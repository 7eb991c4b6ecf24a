"""The command-line side of seeing a job: `paratrain launch`'s dashboard and trace options, and
`paratrain trace merge`.

    paratrain launch --dashboard [--dashboard-port 8265] [--dashboard-linger 60] --trace traces train.py
    paratrain trace merge traces -o job-trace.json      # then open it in https://ui.perfetto.dev
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from paratrain.metrics.dashboard import DashboardConfig
from paratrain.metrics.observe import DASHBOARD_VAR, LINGER_VAR, TRACE_VAR

_OPTIONS = (
    click.option(
        "--dashboard",
        "dashboard_on",
        is_flag=True,
        help="Serve the live dashboard and Prometheus /metrics from the scheduler; the URL (with its "
        "token) is printed at start.",
    ),
    click.option("--dashboard-host", default="127.0.0.1", show_default=True, help="The dashboard's address."),
    click.option(
        "--dashboard-port",
        type=click.IntRange(0, 65535),
        default=0,
        help="The dashboard's port (0: a free one).",
    ),
    click.option(
        "--dashboard-linger",
        type=click.FloatRange(min=0),
        default=0.0,
        show_default=True,
        help="After a failed job, keep the dashboard up this many seconds to read what failed.",
    ),
    click.option(
        "--trace",
        "trace_dir",
        type=click.Path(file_okay=False),
        default=None,
        help="Every process writes a Chrome-trace timeline into this folder "
        "(merge them with `paratrain trace merge`).",
    ),
)


def observe_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Adds the options above to a command (they arrive as keyword arguments; see `observe_env`)."""
    for option in reversed(_OPTIONS):
        fn = option(fn)
    return fn


def dashboard_config(options: dict[str, Any]) -> DashboardConfig | None:
    if not options["dashboard_on"]:
        return None
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise click.UsageError(
            f"--dashboard needs {exc.name}: pip install 'paratrain[dashboard]' (starlette, uvicorn, "
            "prometheus-client)"
        ) from None
    return DashboardConfig(
        host=options["dashboard_host"], port=options["dashboard_port"], linger_s=options["dashboard_linger"]
    )


def observe_env(options: dict[str, Any], local: bool) -> dict[str, str]:
    """Variables for every process from the options above (see `observing_env`)."""
    return observing_env(options["trace_dir"], dashboard_config(options), local)


def observing_env(trace_dir: str | None, board: DashboardConfig | None, local: bool) -> dict[str, str]:
    """Variables for every process: the trace folder (absolute: processes may start elsewhere),
    and, where the launcher does not bind the dashboard itself (not local), its address."""
    env = {}
    if trace_dir:
        env[TRACE_VAR] = os.path.abspath(trace_dir)
    if board is not None and not local:
        env[DASHBOARD_VAR] = f"{board.host}:{board.port}"
        env[LINGER_VAR] = str(board.linger_s)
    return env


@click.group("trace")
def trace() -> None:
    """Timelines written by `paratrain launch --trace DIR` (or Trainer(trace_dir=...))."""


@trace.command("merge")
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False), default=None, help="Default: FOLDER/job-trace.json"
)
def merge(folder: str, output: str | None) -> None:
    """Join every process's trace in FOLDER into one file, one track per process, on the scheduler's clock."""
    from paratrain.metrics.trace import merge_traces

    try:
        merged = merge_traces(folder)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    path = Path(output) if output else Path(folder) / "job-trace.json"
    path.write_text(json.dumps(merged))
    tracks = sum(1 for e in merged["traceEvents"] if e["name"] == "process_name")
    click.echo(
        f"wrote {path}: {tracks} processes, {len(merged['traceEvents'])} events (open in ui.perfetto.dev)"
    )
