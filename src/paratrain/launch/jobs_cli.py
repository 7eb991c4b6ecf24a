"""The job platform's commands: submit, jobs, logs, stop, checkpoints.

    paratrain submit [--dry-run] [--backend B] [-f] job.yaml    a job from its spec (jobspec.py)
    paratrain jobs [OUTPUT_DIR]                                  every job, with its state
    paratrain logs ID [--role worker --rank 1] [-f]              one process's output, or the job's
    paratrain stop ID                                            every process of the job, anywhere
    paratrain checkpoints OUTPUT_DIR                             complete checkpoints, while training

`submit` returns once the job is handed over (to a detached driver on local and ray, to sbatch or
kubectl), printing its id; `-f` then follows its output and exits with the job's status. `jobs`,
`checkpoints` and `logs` print JSON with `-o json` (for scripts): a list of objects, and for `logs`
one object per line of output (JSON lines: role, rank, host where known, line).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from paratrain.errors import LaunchError
from paratrain.launch import engines, jobs

if TYPE_CHECKING:  # pydantic is imported by `submit` alone, so that `paratrain launch` starts fast
    from paratrain.launch.engines.api import Engine, LogSource

_POLL_S = 0.5

_OUTPUT = click.option(
    "-o",
    "--output",
    "output",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="text: a table for people; json: for scripts.",
)


@click.command()
@click.option("--dry-run", is_flag=True, help="Print what would run (the sbatch script, the manifests) only.")
@click.option(
    "--backend",
    type=engines.EngineChoice(),
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
    engine = engines.get(spec.backend)
    job_id = jobs.new_job_id(spec.name)
    folder = engine.job_folder(spec.output_dir, job_id)
    config = launch_config(spec, job_id, engine.log_dir(spec, job_id, folder))
    problems = engine.submit_problems(spec, dry_run)
    if problems and dry_run:  # the spec may be meant for another machine's file system
        click.echo("\n".join(f"paratrain: warning: {spec_file}: {p} here" for p in problems), err=True)
    elif problems:
        click.echo("\n".join(f"{spec_file}: {p}" for p in problems), err=True)
        ctx.exit(2)
    try:
        text = engine.dry_run(spec, config, job_id, folder)  # also what a submission would write
    except ValueError as exc:  # a value the engine's script or manifests cannot carry
        click.echo(f"{spec_file}: {exc}", err=True)
        ctx.exit(2)
    if dry_run:
        click.echo(text, nl=False)
        ctx.exit(0)
    record = jobs.open_job(spec, job_id, folder, make_output_dir=engine.paths_here)
    try:
        engine.hand_over(spec, config, record, folder)
    except (LaunchError, ValueError) as exc:
        jobs.update_record(folder, state="failed", ended=time.time(), failure=f"paratrain: {exc}\n")
        click.echo(f"paratrain: job {job_id} could not be submitted: {exc}", err=True)
        ctx.exit(1)
    click.echo(f"paratrain: submitted job {job_id} ({spec.backend}); its folder is {folder}")
    click.echo(f"  state: {engine.describe_state_command(spec)}")
    click.echo(f"  output: paratrain logs {job_id} [--role worker --rank 0] [-f]")
    click.echo(f"  stop: paratrain stop {job_id}")
    if follow:
        ctx.exit(_show_logs(engine, folder, None, 0, follow=True, wait_end=True))


def _show_logs(
    engine: Engine, folder: Path, role: str | None, rank: int, follow: bool, wait_end: bool
) -> int:
    """Prints a job's output (or one process's) through the engine's command, or from its log file."""
    command = engine.logs_command(jobs.read_record(folder), role, rank, follow)
    if command is not None:
        return subprocess.call(command)
    return _follow_job(engine, folder, role, rank, follow=follow, wait_end=wait_end)


# ---- jobs ---------------------------------------------------------------------------------------


def _refresh(record: jobs.JobRecord) -> jobs.JobRecord:
    """The record, with the job's state as its engine now knows it."""
    return engines.get(record.backend).refresh(record)


@click.command(name="jobs")
@click.argument("output_dir", required=False, type=click.Path(file_okay=False))
@_OUTPUT
def list_jobs(output_dir: str | None, output: str) -> None:
    """List the jobs under OUTPUT_DIR/jobs (default: every job this user submitted on this machine,
    as noted in ~/.paratrain/jobs, or $PARATRAIN_HOME/jobs)."""
    records = [_refresh(record) for record in jobs.list_jobs(output_dir)]
    if output == "json":  # each record as state.json holds it: its fields are documented in jobs.py
        click.echo(json.dumps([dataclasses.asdict(record) for record in records], indent=2))
        return
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
@_OUTPUT
@click.pass_context
def logs(
    ctx: click.Context,
    job: str,
    output_dir: str | None,
    role: str | None,
    rank: int | None,
    follow: bool,
    output: str,
) -> None:
    """Show (or follow) the output of job JOB: every process's, or one role and rank's."""
    if rank is not None and role is None:
        raise click.UsageError("--rank needs --role")
    folder = _find(job, output_dir)
    record = jobs.read_record(folder)
    engine = engines.get(record.backend)
    if output == "json":
        if engine.logs_command(record, role, rank or 0, follow) is not None:
            raise click.UsageError(
                f"-o json: the {record.backend} backend's output is read by its own command"
            )
        ctx.exit(_follow_job(engine, folder, role, rank or 0, follow, wait_end=False, as_json=True))
    ctx.exit(_show_logs(engine, folder, role, rank or 0, follow=follow, wait_end=False))


def _find(job: str, output_dir: str | None) -> Path:
    try:
        return jobs.find_job(job, output_dir)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _follow_job(
    engine: Engine,
    folder: Path,
    role: str | None,
    rank: int,
    follow: bool,
    wait_end: bool,
    as_json: bool = False,
) -> int:
    """Prints the log from its start (`as_json`: as JSON lines); with `follow`, until the job has
    ended. Returns 0, or with `wait_end` the job's exit status."""
    record = _refresh(jobs.read_record(folder))
    reader = _LogReader(engine.log_source(folder, record, role, rank), role, rank)
    while True:
        ended = record.final  # read before the log: what it wrote before ending is then printed
        text = reader.read_new(final=ended or not follow)
        sys.stdout.write(json_lines(text, role, rank) if as_json else text)
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


# A line of a job's whole output: "[role rank] text", or "[role rank @host] text" (the cluster engines').
_PREFIXED = re.compile(r"\[(\w+) (\d+)(?: @(\S+))?\] (.*)")


def json_lines(text: str, role: str | None, rank: int) -> str:
    """Output lines as JSON lines: one process's (`role`), or the job's, whose prefixes name the
    process; a line without one is the launcher's."""
    out = []
    for line in text.splitlines():
        entry: dict[str, object] = {"role": role, "rank": rank, "line": line}
        if role is None:
            found = _PREFIXED.fullmatch(line)
            entry = {"role": "launcher", "rank": 0, "line": line}
            if found:
                entry = {"role": found[1], "rank": int(found[2]), "line": found[4]}
                if found[3]:
                    entry["host"] = found[3]
        out.append(json.dumps(entry) + "\n")
    return "".join(out)


class _LogReader:
    """What a log file gained since the last read, in whole lines (and the rest once final): the
    job's or one process's log, or under Slurm that process's lines of the job's output."""

    def __init__(self, source: LogSource, role: str | None, rank: int) -> None:
        self.path, self.lines = source.path, source.lines
        self.role, self.rank = role, rank
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
        return text if self.lines is None else self.lines(text, self.role, self.rank)


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
        record = engines.get(record.backend).stop(record)
    except (LaunchError, RuntimeError) as exc:
        click.echo(f"paratrain: could not stop job {record.id}: {exc}", err=True)
        ctx.exit(1)
    click.echo(f"paratrain: job {record.id} {record.state}")


# ---- checkpoints ------------------------------------------------------------------------------


@click.command()
@click.argument("output_dir", type=click.Path(exists=True, file_okay=False))
@_OUTPUT
def checkpoints(output_dir: str, output: str) -> None:
    """List the complete checkpoints in OUTPUT_DIR (or a checkpoint folder), while training runs."""
    from paratrain.checkpoint.reader import checkpoint_root, folder_size, read_evaluation
    from paratrain.checkpoint.store import list_checkpoints

    root = checkpoint_root(output_dir)
    found = list_checkpoints(root)
    if output == "json":
        listed = [
            {
                "step": checkpoint.step,
                "path": str(checkpoint.path),
                "time": checkpoint.meta.get("time"),
                "bytes": folder_size(checkpoint),
                "metrics": checkpoint.meta.get("metrics") or {},
                "evaluation": {k: v for k, v in (read_evaluation(checkpoint) or {}).items() if k != "time"},
            }
            for checkpoint in found
        ]
        click.echo(json.dumps(listed, indent=2))
        return
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
