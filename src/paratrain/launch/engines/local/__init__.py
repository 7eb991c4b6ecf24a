"""The local engine: every process of the job on this machine (job.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from paratrain.launch.engines.api import DrivenEngine, LaunchArgs

if TYPE_CHECKING:
    from paratrain.launch.api import LaunchConfig
    from paratrain.launch.jobspec import JobSpec
    from paratrain.launch.report import JobResult
    from paratrain.metrics.dashboard import DashboardConfig


@dataclass(frozen=True)
class LocalOptions:
    """What the local engine adds to a LaunchConfig."""

    host: str = "127.0.0.1"
    """The address every process binds and advertises."""
    dashboard: DashboardConfig | None = None
    """Serve the dashboard from the scheduler, on a port the launcher binds (None: no dashboard)."""
    gpus_per_worker: int = 0
    """GPUs of its own for each worker (job.py's `device_env`); 0: none chosen."""

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be an address, got {self.host!r}")
        if isinstance(self.gpus_per_worker, bool) or not isinstance(self.gpus_per_worker, int):
            raise TypeError(f"gpus_per_worker must be an int, got {self.gpus_per_worker!r}")
        if self.gpus_per_worker < 0:
            raise ValueError(f"gpus_per_worker must be >= 0, got {self.gpus_per_worker}")


class LocalEngine(DrivenEngine):
    options_type = LocalOptions
    binds_dashboard = True
    processes_here = True

    def options(self, args: LaunchArgs) -> LocalOptions:
        return LocalOptions(host=args.host, dashboard=args.dashboard, gpus_per_worker=args.gpus_per_worker)

    def launch(self, config: LaunchConfig, options: LocalOptions) -> int:
        from paratrain.launch.engines.local.job import run_launch

        return run_launch(
            config, host=options.host, dashboard=options.dashboard, gpus_per_worker=options.gpus_per_worker
        )

    def job_options(self, spec: JobSpec, job_id: str, folder: Path, dry_run: bool) -> LocalOptions:
        from paratrain.launch.jobspec import launch_args

        return self.options(launch_args(spec, dry_run))

    def drive(self, spec: JobSpec, config: LaunchConfig, out: IO[str]) -> JobResult:
        from paratrain.launch.engines.local.job import local_job, run_local_job

        options = self.job_options(spec, "", Path(), dry_run=False)
        local = local_job(config, options.host, options.dashboard, options.gpus_per_worker)
        return run_local_job(local, out=out, err=out)
