"""The job platform's commands: submit, jobs, logs, stop, checkpoints.

    paratrain submit [--dry-run] [--backend B] [-f] job.yaml    a job from its spec (jobspec.py)
    paratrain jobs [OUTPUT_DIR]                                  every job, with its state
    paratrain logs ID [--role worker --rank 1] [-f]              one process's output, or the job's
    paratrain stop ID                                            every process of the job, anywhere
    paratrain checkpoints OUTPUT_DIR                             complete checkpoints, while training

`submit` returns once the job is handed over (to a detached driver on local and ray, to sbatch or
kubectl), printing its id; `-f` then follows its output and exits with the job's status.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from paratrain.launch import job_cluster, jobs

if TYPE_CHECKING:  # pydantic is imported by `submit` alone: `paratrain launch` starts as fast as before
    from paratrain.launch.api import LaunchConfig
    from paratrain.launch.jobspec import JobSpec

_POLL_S = 0.5
_STOP_WAIT_S = 90.0


@click.command()
@click.option("--dry-run", is_flag=True, help="Print what would run (the sbatch script, the manifests) only.")
@click.option(
    "--backend",
    type=click.Choice(["local", "ray", "slurm", "k8s"]),
    default=None,
    help="Instead of the spec's.",
)
@click.option(
    "-f", "--follow", is_flag=True, help="Follow the job's output until it ends; exit with its status."
)
@click.argument("spec_file", metavar="JOB.yaml", type=click.Path(dir_okay=False))
@click.pass_context
def submit(ctx: click.Context, dry_run: bool, backend: str | None, follow: bool, spec_file: str) -> None:
    """Submit the job that JOB.yaml describes (see docs/jobspec.md)."""
    from paratrain.launch.jobspec import SpecError, launch_config, load_spec

    try:
        spec = load_spec(spec_file, overrides={"backend": backend} if backend else None)
    except SpecError as exc:
        click.echo("\n".join(exc.problems), err=True)
        ctx.exit(2)
    job_id = jobs.new_job_id(spec.name)
    folder = jobs.job_folder(spec.output_dir, job_id, spec.backend)
    log_dir = f"{spec.output_dir}/jobs/{job_id}/logs" if spec.backend == "k8s" else str(folder / "logs")
    config = launch_config(spec, job_id, log_dir)
    problems = _local_problems(spec)
    if spec.backend == "k8s" and spec.k8s.image is None and not dry_run:
        problems.append("k8s.image: is required to submit (the image every pod runs)")
    if problems and dry_run:  # the spec may be meant for another machine's file system
        click.echo("\n".join(f"paratrain: warning: {spec_file}: {p} here" for p in problems), err=True)
    elif problems:
        click.echo("\n".join(f"{spec_file}: {p}" for p in problems), err=True)
        ctx.exit(2)
    if dry_run:
        ctx.exit(_dry_run(spec, config, job_id, folder))
    record = jobs.open_job(spec, job_id, folder)
    try:
        _hand_over(spec, config, record, folder)
    except job_cluster.ClusterError as exc:
        jobs.update_record(folder, state="failed", ended=time.time(), failure=f"paratrain: {exc}\n")
        click.echo(f"paratrain: job {job_id} could not be submitted: {exc}", err=True)
        ctx.exit(1)
    click.echo(f"paratrain: submitted job {job_id} ({spec.backend}); its folder is {folder}")
    click.echo(f"  state: paratrain jobs {spec.output_dir if spec.backend != 'k8s' else ''}".rstrip())
    click.echo(f"  output: paratrain logs {job_id} [--role worker --rank 0] [-f]")
    click.echo(f"  stop: paratrain stop {job_id}")
    if follow and spec.backend == "k8s":
        cluster_id = jobs.read_record(folder).cluster_id
        ctx.exit(subprocess.call(job_cluster.k8s_logs_command(cluster_id, None, 0, follow=True)))
    if follow:
        ctx.exit(_follow_job(folder, None, 0, follow=True, wait_end=True))


def _local_problems(spec: JobSpec) -> list[str]:
    """What can be checked on this machine before anything starts (not on k8s: paths in the pods)."""
    if spec.backend == "k8s":
        return []
    from paratrain.launch.jobspec import script_path

    problems = []
    script = script_path(spec)
    if not os.path.isfile(script):
        problems.append(f"entry.script: {script} is not a file")
    if spec.data_dir is not None and not os.path.isdir(spec.data_dir):
        problems.append(f"data_dir: {spec.data_dir} is not a folder")
    return problems


def _dry_run(spec: JobSpec, config: LaunchConfig, job_id: str, folder: Path) -> int:
    if spec.backend == "slurm":
        options = job_cluster.slurm_options(spec, job_id, folder, dry_run=True)
        click.echo(job_cluster.slurm_script(spec, config, options), nl=False)
        return 0
    if spec.backend == "k8s":
        from paratrain.launch.engines.k8s.manifests import manifests_yaml

        options = job_cluster.k8s_options(spec, job_id, dry_run=True)
        click.echo(manifests_yaml(job_cluster.k8s_manifests(spec, config, options)), nl=False)
        return 0
    where = "this machine" if spec.backend == "local" else f"the Ray cluster at {spec.ray.address}"
    click.echo(f"job {job_id}: {spec.workers} worker(s), {spec.servers} server(s) on {where}")
    if spec.evaluator:
        click.echo("  and 1 evaluator beside the driver (PARATRAIN_TASK=evaluator)")
    click.echo(f"  in {spec.work_dir}: {config.python} -u {config.script} {' '.join(config.args)}".rstrip())
    for key, value in config.job_env().items():
        click.echo(f"  {key}={value}")
    click.echo(f"  job folder: {folder}")
    return 0


def _hand_over(spec: JobSpec, config: LaunchConfig, record: jobs.JobRecord, folder: Path) -> None:
    if spec.backend == "slurm":
        options = job_cluster.slurm_options(spec, record.id, folder, dry_run=False)
        cluster_id = job_cluster.sbatch(job_cluster.slurm_script(spec, config, options))
        jobs.update_record(folder, cluster_id=cluster_id)
    elif spec.backend == "k8s":
        options = job_cluster.k8s_options(spec, record.id, dry_run=False)
        from paratrain.launch.engines.k8s.manifests import manifests_yaml

        job_cluster.k8s_apply(options, manifests_yaml(job_cluster.k8s_manifests(spec, config, options)))
        jobs.update_record(folder, cluster_id=f"{record.id}/{spec.k8s.namespace}")
    else:
        pid = _detach(
            [sys.executable, "-m", "paratrain.launch.job_driver", str(folder)],
            cwd=spec.work_dir,
            log=folder / "logs" / "launcher.log",
        )
        jobs.update_record(folder, driver_pid=pid, driver_host=socket.gethostname())


# Starts argv[2:] in a session of its own with its output appended to argv[1], prints its pid and
# exits: the driver is then nobody's child here, so it is reaped when it ends even while `submit -f`
# (or a test) is still running, and a Ctrl-C in this shell later is not the job's business.
_DETACH = (
    "import subprocess, sys\n"
    "with open(sys.argv[1], 'ab') as log:\n"
    "    print(subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log, stderr=log,"
    " start_new_session=True).pid)\n"
)


def _detach(cmd: list[str], cwd: str | None, log: Path) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _DETACH, str(log), *cmd], cwd=cwd, capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise job_cluster.ClusterError(f"could not start the job's driver: {done.stderr.strip()}")
    return int(done.stdout)


# ---- jobs ---------------------------------------------------------------------------------------


def _refresh(record: jobs.JobRecord) -> jobs.JobRecord:
    """The record, with a cluster job's state as its cluster now tells it."""
    record = jobs.refresh(record)
    if record.final or not record.cluster_id:
        return record
    try:
        if record.backend == "slurm":
            state = job_cluster.slurm_state(record.cluster_id)
        else:
            state = job_cluster.k8s_state(record.cluster_id)
    except job_cluster.ClusterError:
        return record
    if state is None or state == record.state:
        return record
    changes: dict[str, Any] = {"state": state}
    if state == "running" and not record.started:
        changes["started"] = time.time()
    if state in jobs.FINAL:
        changes["ended"] = time.time()
    return jobs.update_record(record.folder, **changes)


@click.command(name="jobs")
@click.argument("output_dir", required=False, type=click.Path(file_okay=False))
def list_jobs(output_dir: str | None) -> None:
    """List the jobs under OUTPUT_DIR/jobs (default: every job submitted from here)."""
    records = [_refresh(record) for record in jobs.list_jobs(output_dir)]
    if not records:
        where = f"{output_dir}/jobs" if output_dir else f"{jobs.paratrain_home() / 'jobs'}"
        click.echo(f"no jobs in {where}")
        return
    rows = [("ID", "STATE", "BACKEND", "ROLES", "STARTED", "DURATION", "EXIT")]
    for r in records:
        roles = f"{r.workers}w {r.servers}s" + (" 1e" if r.evaluator else "")
        code = "" if r.exit_code is None else str(r.exit_code)
        rows.append(
            (r.id, r.state, r.backend, roles, jobs.describe_time(r.started), jobs.describe_duration(r), code)
        )
    _table(rows)
    for r in records:
        if r.state == "failed" and r.failure:
            click.echo(f"{r.id}: {r.failure.strip().splitlines()[0]}")


def _table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


# ---- logs ---------------------------------------------------------------------------------------


@click.command()
@click.argument("job")
@click.option("--output-dir", default=None, help="Where the job's folder is, when not submitted from here.")
@click.option(
    "--role", type=click.Choice(["scheduler", "server", "worker", "evaluator", "launcher"]), default=None
)
@click.option("--rank", type=click.IntRange(min=0), default=None, help="With --role (default 0).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing as the process writes, until the job ends.")
@click.pass_context
def logs(
    ctx: click.Context, job: str, output_dir: str | None, role: str | None, rank: int | None, follow: bool
) -> None:
    """Show (or follow) the output of job JOB: every process's, or one role and rank's."""
    if rank is not None and role is None:
        raise click.UsageError("--rank needs --role")
    folder = _find(job, output_dir)
    record = jobs.read_record(folder)
    if record.backend == "k8s" and record.cluster_id:
        ctx.exit(subprocess.call(job_cluster.k8s_logs_command(record.cluster_id, role, rank or 0, follow)))
    ctx.exit(_follow_job(folder, role, rank or 0, follow=follow, wait_end=False))


def _find(job: str, output_dir: str | None) -> Path:
    try:
        return jobs.find_job(job, output_dir)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _follow_job(folder: Path, role: str | None, rank: int, follow: bool, wait_end: bool) -> int:
    """Prints the log from its start; with `follow`, until the job has ended. Returns 0, or with
    `wait_end` the job's exit status."""
    record = _refresh(jobs.read_record(folder))
    reader = _LogReader(folder, record, role, rank)
    while True:
        ended = record.final  # read before the log: what it wrote before ending is then printed
        sys.stdout.write(reader.read_new(final=ended or not follow))
        sys.stdout.flush()
        if not follow or ended:
            break
        time.sleep(_POLL_S)
        record = _refresh(jobs.read_record(folder))
    if wait_end:
        if record.failure:
            sys.stderr.write(record.failure)
        click.echo(f"paratrain: job {record.id} {record.state}", err=True)
        return 0 if record.state == "succeeded" else (record.exit_code or 1)
    return 0


class _LogReader:
    """What a log file gained since the last read, in whole lines (and the rest once final): the
    job's or one process's log, or under Slurm that process's lines of the job's output."""

    def __init__(self, folder: Path, record: jobs.JobRecord, role: str | None, rank: int) -> None:
        self.slurm = record.backend == "slurm"
        self.role, self.rank = role, rank
        if self.slurm:
            self.path = job_cluster.slurm_output(folder, record.cluster_id)
        else:
            self.path = jobs.log_path(folder, role, rank)
        self.offset = 0
        self.partial = b""

    def read_new(self, final: bool) -> str:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return ""
        self.offset += len(data)
        data = self.partial + data
        cut = len(data) if final else data.rfind(b"\n") + 1
        self.partial = data[cut:]
        text = data[:cut].decode("utf-8", "replace")
        return job_cluster.slurm_lines(text, self.role, self.rank) if self.slurm else text


# ---- stop ---------------------------------------------------------------------------------------


@click.command()
@click.argument("job")
@click.option("--output-dir", default=None, help="Where the job's folder is, when not submitted from here.")
@click.pass_context
def stop(ctx: click.Context, job: str, output_dir: str | None) -> None:
    """Stop every process of job JOB, on whatever backend runs it."""
    folder = _find(job, output_dir)
    record = _refresh(jobs.read_record(folder))
    if record.final:
        click.echo(f"paratrain: job {record.id} already {record.state}")
        return
    try:
        if record.backend in ("slurm", "k8s"):
            record = _stop_on_cluster(record)
        else:
            record = _stop_driver(record)
    except (job_cluster.ClusterError, RuntimeError) as exc:
        click.echo(f"paratrain: could not stop job {record.id}: {exc}", err=True)
        ctx.exit(1)
    click.echo(f"paratrain: job {record.id} {record.state}")


def _stop_on_cluster(record: jobs.JobRecord) -> jobs.JobRecord:
    if record.cluster_id:
        if record.backend == "slurm":
            job_cluster.run_command(["scancel", record.cluster_id])
        else:
            job_cluster.k8s_delete(record.cluster_id)
    report = f"paratrain: stopped by paratrain stop ({record.backend} job {record.cluster_id})\n"
    return jobs.update_record(record.folder, state="stopped", ended=time.time(), failure=report)


def _stop_driver(record: jobs.JobRecord) -> jobs.JobRecord:
    """SIGTERM to the job's driver, which stops every process of the job; waits for it to say so."""
    if record.driver_pid is None:
        raise RuntimeError("its driver has not started yet")
    if record.driver_host != socket.gethostname():
        raise RuntimeError(f"it is driven from {record.driver_host}: run paratrain stop there")
    try:
        os.kill(record.driver_pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + _STOP_WAIT_S
    while time.monotonic() < deadline:
        record = jobs.read_record(record.folder)
        if record.final and not jobs.pid_alive(record.driver_pid or 0):
            return record
        if not jobs.pid_alive(record.driver_pid or 0):
            break
        time.sleep(_POLL_S)
    else:
        raise RuntimeError(f"its driver (pid {record.driver_pid}) did not stop within {_STOP_WAIT_S} s")
    evaluator = record.extra.get("evaluator_pid")  # the driver died before stopping it
    if evaluator and jobs.pid_alive(evaluator):
        os.killpg(evaluator, signal.SIGKILL)
    if record.final:
        return record
    report = "paratrain: stopped by paratrain stop; its driver ended without recording how\n"
    return jobs.update_record(record.folder, state="stopped", ended=time.time(), failure=report)


# ---- checkpoints ------------------------------------------------------------------------------


@click.command()
@click.argument("output_dir", type=click.Path(exists=True, file_okay=False))
def checkpoints(output_dir: str) -> None:
    """List the complete checkpoints in OUTPUT_DIR (or a checkpoint folder), while training runs."""
    from paratrain.checkpoint.reader import checkpoint_root, folder_size, read_evaluation
    from paratrain.checkpoint.store import list_checkpoints

    root = checkpoint_root(output_dir)
    found = list_checkpoints(root)
    if not found:
        click.echo(f"no complete checkpoint in {root}")
        return
    rows = [("STEP", "TIME", "SIZE", "METRICS", "EVALUATION")]
    for checkpoint in found:
        metrics = checkpoint.meta.get("metrics") or {}
        evaluation = read_evaluation(checkpoint) or {}
        evaluation.pop("time", None)
        rows.append(
            (
                str(checkpoint.step),
                jobs.describe_time(checkpoint.meta.get("time", 0)),
                _size(folder_size(checkpoint)),
                _scalars(metrics),
                _scalars(evaluation),
            )
        )
    _table(rows)


def _scalars(values: dict) -> str:
    shown = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(values.items())]
    return " ".join(shown) or "-"


def _size(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"


COMMANDS = (submit, list_jobs, logs, stop, checkpoints)
