"""The Slurm engine: one sbatch script whose single srun starts every role (sbatch.py); a
submitted job is asked about with squeue/sacct and stopped with scancel (job_cluster.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from paratrain.launch import job_cluster, jobs
from paratrain.launch.engines.api import ClusterEngine, LaunchArgs, LogSource, SpecProblem
from paratrain.launch.engines.slurm.sbatch import SlurmOptions, extra_option, setup_command

if TYPE_CHECKING:
    from paratrain.launch.api import LaunchConfig
    from paratrain.launch.jobspec import JobSpec


class SlurmEngine(ClusterEngine):
    options_type = SlurmOptions

    def options(self, args: LaunchArgs) -> SlurmOptions:
        return SlurmOptions(
            partition=args.partition,
            time=args.time_limit,
            nodes=args.nodes,
            account=args.account,
            qos=args.qos,
            constraint=args.constraint,
            extra_sbatch=args.extra_sbatch,
            setup=args.setup,
            dry_run=args.dry_run,
            **args.resources,
        )

    def launch(self, config: LaunchConfig, options: SlurmOptions) -> int:
        from paratrain.launch.engines.slurm.sbatch import run_slurm_job

        return run_slurm_job(config, options)

    def job_options(self, spec: JobSpec, job_id: str, folder: Path, dry_run: bool) -> SlurmOptions:
        return job_cluster.slurm_options(spec, job_id, folder, dry_run)

    def spec_problems(self, spec: JobSpec) -> list[SpecProblem]:
        problems = super().spec_problems(spec)
        if spec.resources.server.gpus:
            problems.append((("resources", "server", "gpus"), "servers take no GPUs"))
        checks = (("extra_sbatch", extra_option), ("setup", setup_command))
        for name, check in checks:
            for i, line in enumerate(getattr(spec.slurm, name)):
                try:
                    check(line, f"{name}[{i}]")
                except ValueError as exc:
                    problems.append((("slurm", name, str(i)), str(exc).split(": ", 1)[-1]))
        return problems

    def dry_run(self, spec: JobSpec, config: LaunchConfig, job_id: str, folder: Path) -> str:
        return job_cluster.slurm_script(spec, config, self.job_options(spec, job_id, folder, dry_run=True))

    def submit(self, spec: JobSpec, config: LaunchConfig, record: jobs.JobRecord, folder: Path) -> str:
        options = self.job_options(spec, record.id, folder, dry_run=False)
        return job_cluster.sbatch(job_cluster.slurm_script(spec, config, options))

    def cluster_state(self, cluster_id: str) -> str | None:
        return job_cluster.slurm_state(cluster_id)

    def cancel(self, cluster_id: str) -> None:
        job_cluster.run_command(["scancel", cluster_id])

    def log_source(self, folder: Path, record: jobs.JobRecord, role: str | None, rank: int) -> LogSource:
        """The job's one output file, which every task writes with its `[role rank @node] ` prefix."""
        return LogSource(job_cluster.slurm_output(folder, record.cluster_id), job_cluster.slurm_lines)
