"""What an engine of `paratrain launch --backend NAME` must do, for the launcher and the job platform.

An engine is a class registered under its name (engines/__init__.py, one line). The launcher builds
the engine's options from the command line (`options`) and calls `launch`, which starts every
process where the engine puts them, watches them and stops them, or, for an engine whose cluster
has a scheduler of its own, hands the job over and returns. The job platform (`paratrain submit`,
`jobs`, `logs`, `stop`) asks the engine the rest: its options from a job spec, what a spec must hold
for it, a dry run's text, and how a submitted job is handed over, asked about, followed and stopped.

Two kinds implement the job platform's hooks: a `DrivenEngine` (driven.py: local, ray) runs each
submitted job under a detached driver process on the submitting machine, which calls `drive`; a
`ClusterEngine` (here: slurm, k8s) hands the job to a cluster's scheduler and asks that about it.
No code outside the registry compares an engine's name: it asks the engine.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar

from paratrain.launch import jobs

if TYPE_CHECKING:  # pydantic is imported by the job platform alone: `paratrain launch` starts fast
    from paratrain.launch.api import LaunchConfig
    from paratrain.launch.jobspec import JobSpec
    from paratrain.launch.report import JobResult
    from paratrain.metrics.dashboard import DashboardConfig

SpecProblem = tuple[tuple[str, ...], str]
"""A field of the job spec (its path) and what is wrong with it."""


@dataclass(frozen=True)
class LaunchArgs:
    """The engine options of `paratrain launch` as given on its command line; each engine reads
    the ones it has (cli.py's help says which)."""

    host: str = "127.0.0.1"
    dashboard: DashboardConfig | None = None
    address: str = "auto"
    partition: str | None = None
    time_limit: str | None = None
    nodes: int | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    extra_sbatch: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    image: str | None = None
    namespace: str = "default"
    pod_overrides: Mapping[str, Any] = field(default_factory=dict)
    k8s_form: str = "jobs"
    cpus_per_worker: float = 1.0
    cpus_per_server: float = 1.0
    gpus_per_worker: int = 0
    dry_run: bool = False

    @property
    def resources(self) -> dict[str, Any]:
        return {
            "cpus_per_worker": self.cpus_per_worker,
            "cpus_per_server": self.cpus_per_server,
            "gpus_per_worker": self.gpus_per_worker,
        }


@dataclass(frozen=True)
class LogSource:
    """Where a submitted job's output is read from on this machine, and which of its lines are one
    process's (`lines(text, role, rank)`; None: the file holds that process's lines alone)."""

    path: Path
    lines: Callable[[str, str | None, int], str] | None = None


class Engine(ABC):
    """One way of running a job's processes. Subclasses set the class attributes and implement the
    abstract methods; the rest have defaults that fit an engine whose processes see this machine's
    file system."""

    name: str = ""
    """The name `--backend` and a spec's `backend` give (set by the registry)."""
    options_type: ClassVar[type]
    """The frozen dataclass of this engine's own options (`options` and `job_options` make one)."""
    paths_here: ClassVar[bool] = True
    """The script and the job's folders are paths on this machine (False: in the image or pods)."""
    binds_dashboard: ClassVar[bool] = False
    """The launcher binds the dashboard's port here itself (else processes get its address)."""
    elastic: ClassVar[bool] = True
    """Supports --elastic and --max-restarts."""
    evaluator: ClassVar[bool] = False
    """Runs a spec's evaluator process beside the job."""
    processes_here: ClassVar[bool] = False
    """Every process of a job runs on this machine, under the job's driver (`paratrain stacks`
    signals them)."""

    # -- the launcher

    @abstractmethod
    def options(self, args: LaunchArgs) -> Any:
        """This engine's options from the command line; ValueError naming what is missing or wrong."""

    @abstractmethod
    def launch(self, config: LaunchConfig, options: Any) -> int:
        """`paratrain launch`: starts the job, watches it and stops it (or hands it over); its exit status."""

    # -- the job platform

    @abstractmethod
    def job_options(self, spec: JobSpec, job_id: str, folder: Path, dry_run: bool) -> Any:
        """This engine's options for a submitted job."""

    @abstractmethod
    def dry_run(self, spec: JobSpec, config: LaunchConfig, job_id: str, folder: Path) -> str:
        """What `paratrain submit --dry-run` prints: what would run."""

    @abstractmethod
    def hand_over(self, spec: JobSpec, config: LaunchConfig, record: jobs.JobRecord, folder: Path) -> None:
        """Starts the submitted job (its record is written); returns once it is handed over."""

    @abstractmethod
    def stop(self, record: jobs.JobRecord) -> jobs.JobRecord:
        """Stops every process of a submitted job; its record afterwards. RuntimeError or
        LaunchError saying why it could not."""

    def spec_problems(self, spec: JobSpec) -> list[SpecProblem]:
        """What a spec needs for this engine that the spec's models alone cannot say."""
        from paratrain.launch import engines

        problems: list[SpecProblem] = []
        asked = [("evaluator", "an evaluator runs", "evaluator")]
        asked += [(name, f"{name} works", "elastic") for name in ("elastic", "max_restarts")]
        for name, what, able in asked:
            if getattr(spec, name) and not getattr(self, able):
                *others, last = engines.names(partial(_can, able))
                where = f"{', '.join(others)} and {last}" if others else last
                problems.append(((name,), f"{what} on the {where} backends, not {self.name}"))
        return problems

    def submit_problems(self, spec: JobSpec, dry_run: bool) -> list[str]:
        """What `submit` can check on this machine before anything starts."""
        if not self.paths_here:
            return []
        from paratrain.launch.jobspec import script_path

        problems = []
        script = script_path(spec)
        if spec.entry.script is not None and not os.path.isfile(script):
            problems.append(f"entry.script: {script} is not a file")
        if spec.data_dir is not None and not os.path.isdir(spec.data_dir):
            problems.append(f"data_dir: {spec.data_dir} is not a folder")
        return problems

    def job_folder(self, output_dir: str, job_id: str) -> Path:
        """Where a submitted job's records live on this machine."""
        if not self.paths_here:  # output_dir is a path in the pods: keep the records here
            return jobs.paratrain_home() / f"{self.name}-jobs" / job_id
        return Path(output_dir) / "jobs" / job_id

    def log_dir(self, spec: JobSpec, job_id: str, folder: Path) -> str:
        """PARATRAIN_LOG_DIR, as the job's processes see it."""
        if not self.paths_here:
            return f"{spec.output_dir}/jobs/{job_id}/logs"
        return str(folder / "logs")

    def refresh(self, record: jobs.JobRecord) -> jobs.JobRecord:
        """The record, brought up to date with what is known of the job now."""
        return jobs.refresh(record)

    def log_source(self, folder: Path, record: jobs.JobRecord, role: str | None, rank: int) -> LogSource:
        """Where `paratrain logs` reads a process's output (or the job's, role None)."""
        return LogSource(jobs.log_path(folder, role, rank))

    def logs_command(
        self, record: jobs.JobRecord, role: str | None, rank: int, follow: bool
    ) -> list[str] | None:
        """A command that prints the output instead of a file here (None: read `log_source`)."""
        return None

    def describe_state_command(self, spec: JobSpec) -> str:
        """The `paratrain jobs` line `submit` prints."""
        return f"paratrain jobs {spec.output_dir}" if self.paths_here else "paratrain jobs"


def _can(ability: str, engine: Engine) -> bool:
    """Whether `engine` has the ability (a class attribute such as `elastic`)."""
    return bool(getattr(engine, ability))


class ClusterEngine(Engine):
    """An engine that hands each job to a cluster's own scheduler: submitted with one command,
    asked about, and cancelled with others. Its record's cluster_id names the job there."""

    @abstractmethod
    def submit(self, spec: JobSpec, config: LaunchConfig, record: jobs.JobRecord, folder: Path) -> str:
        """Submits the job; the cluster's id for it. LaunchError saying why it could not."""

    @abstractmethod
    def cluster_state(self, cluster_id: str) -> str | None:
        """The job's state (one of jobs.STATES) as the cluster tells it; None when it does not know."""

    @abstractmethod
    def cancel(self, cluster_id: str) -> None:
        """Ends the job on the cluster."""

    def hand_over(self, spec: JobSpec, config: LaunchConfig, record: jobs.JobRecord, folder: Path) -> None:
        jobs.update_record(folder, cluster_id=self.submit(spec, config, record, folder))

    def refresh(self, record: jobs.JobRecord) -> jobs.JobRecord:
        from paratrain.errors import LaunchError

        record = jobs.refresh(record)
        if record.final or not record.cluster_id:
            return record
        try:
            state = self.cluster_state(record.cluster_id)
        except LaunchError:
            return record
        if state is None or state == record.state:
            return record
        changes: dict[str, Any] = {"state": state}
        if state == "running" and not record.started:
            changes["started"] = time.time()
        if state in jobs.FINAL:
            changes["ended"] = time.time()
        return jobs.update_record(record.folder, **changes)

    def stop(self, record: jobs.JobRecord) -> jobs.JobRecord:
        if record.cluster_id:
            self.cancel(record.cluster_id)
        report = f"paratrain: stopped by paratrain stop ({record.backend} job {record.cluster_id})\n"
        return jobs.update_record(record.folder, state="stopped", ended=time.time(), failure=report)


class DrivenEngine(Engine):
    """An engine whose submitted jobs run under a detached driver process on this machine
    (job_driver.py), which calls `drive`; stopping the job is SIGTERM to that driver. The hand-over
    and stop are in driven.py."""

    evaluator = True

    @abstractmethod
    def drive(self, spec: JobSpec, config: LaunchConfig, out: IO[str]) -> JobResult:
        """Runs a submitted job to its end, every line of output to `out`; how it ended."""

    def dry_run(self, spec: JobSpec, config: LaunchConfig, job_id: str, folder: Path) -> str:
        lines = [f"job {job_id}: {spec.workers} worker(s), {spec.servers} server(s) on {self.where(spec)}"]
        if spec.evaluator:
            lines.append("  and 1 evaluator beside the driver (PARATRAIN_TASK=evaluator)")
        lines.append(
            f"  in {spec.work_dir}: {config.python} -u {config.script} {' '.join(config.args)}".rstrip()
        )
        lines += [f"  {key}={value}" for key, value in config.job_env().items()]
        lines.append(f"  job folder: {folder}")
        return "\n".join(lines) + "\n"

    def where(self, spec: JobSpec) -> str:
        """Where the processes run, in words (the dry run's first line)."""
        return "this machine"

    def hand_over(self, spec: JobSpec, config: LaunchConfig, record: jobs.JobRecord, folder: Path) -> None:
        from paratrain.launch.engines.driven import start_driver

        start_driver(spec, folder)

    def stop(self, record: jobs.JobRecord) -> jobs.JobRecord:
        from paratrain.launch.engines.driven import stop_driver

        return stop_driver(record)
