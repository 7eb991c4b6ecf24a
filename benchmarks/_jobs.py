"""Running a benchmark file again as a paratrain job (its --paratrain-role mode) and reading back the
result line that every worker prints. Kept apart from _anchors.py, which must not import paratrain."""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any


def run_role_job(
    script: str,
    role_args: Sequence[str],
    workers: int,
    servers: int,
    timeout_s: float,
    result: re.Pattern,
    placements: Mapping[str, Sequence[Any]] | None = None,
) -> list[tuple[str, ...]] | None:
    """The groups of `result` matched in the job's output, one per worker; None (after printing the
    job's last stderr lines) when the job failed or a worker printed no result. `placements`: where
    each process runs (LocalJobConfig.placements; default all here)."""
    from paratrain.launch.local import LocalJobConfig, run_local_job

    config = LocalJobConfig(
        script=script,
        args=tuple(role_args),
        num_workers=workers,
        num_servers=servers,
        timeout_s=timeout_s,
        placements=placements or {},
    )
    out, err = io.StringIO(), io.StringIO()
    outcome = run_local_job(config, out=out, err=err)
    found = [m.groups() for m in result.finditer(out.getvalue())]
    if outcome.exit_code != 0 or len(found) != workers:
        tail = "\n".join(err.getvalue().splitlines()[-40:])
        print(f"paratrain job {' '.join(role_args)} failed:\n{tail}", file=sys.stderr)
        return None
    return found
