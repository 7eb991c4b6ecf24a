"""`paratrain stacks JOB`: the Python stacks of every thread of every process of a running job.

Every process of a job writes its threads' stacks to its stderr on SIGUSR1 (cluster/stacks.py),
which the job's driver files into logs/<role>-<rank>.log. This command finds the job's processes
(local backend: the processes whose PARATRAIN_LAUNCHER_PID is the job's driver, read from /proc,
so it runs on the machine that runs the job), signals each that handles the signal (one still
starting, before paratrain.init, would be ended by it), and prints what each log gained.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import click

from paratrain.launch import engines, jobs

WAIT_S = 5.0
"""How long to wait for a process's stacks to reach its log."""
_QUIET_S = 0.3
"""A log that gained nothing for this long, after the stacks began, has them all."""


@dataclass(frozen=True)
class JobProcess:
    role: str
    rank: int
    pid: int

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"


def job_processes(launcher_pid: int, proc: Path = Path("/proc")) -> list[JobProcess]:
    """The processes started by the launcher with pid `launcher_pid` (Linux: read from /proc)."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or another user's
            continue
        env = dict(item.partition(b"=")[::2] for item in raw.split(b"\0") if b"=" in item)
        if env.get(b"PARATRAIN_LAUNCHER_PID") != str(launcher_pid).encode() or b"PARATRAIN_ROLE" not in env:
            continue
        if not _catches_sigusr1(entry):  # not yet in paratrain.init: the signal would end it
            continue
        rank = env.get(b"PARATRAIN_RANK", b"0").decode() or "0"
        found.append(JobProcess(env[b"PARATRAIN_ROLE"].decode(), int(rank), int(entry.name)))
    return sorted(found, key=lambda p: (p.role, p.rank))


def _catches_sigusr1(entry: Path) -> bool:
    """Whether the process has a handler for SIGUSR1 (its SigCgt mask, /proc/PID/status)."""
    try:
        status = (entry / "status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)
    return False


def collect(processes: list[JobProcess], logs: Path, wait_s: float = WAIT_S) -> dict[str, str]:
    """Signal each process and return, by name, what its log gained: its stacks."""
    offsets = {p.name: _size(logs / f"{p.name}.log") for p in processes}
    for p in processes:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            offsets.pop(p.name)
    deadline = time.monotonic() + wait_s
    gained: dict[str, str] = {}
    last_change = time.monotonic()
    while time.monotonic() < deadline:
        now = {name: _read_from(logs / f"{name}.log", offset) for name, offset in offsets.items()}
        if now != gained:
            gained, last_change = now, time.monotonic()
        elif all(now.values()) and time.monotonic() - last_change > _QUIET_S:
            break
        time.sleep(0.05)
    return gained


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


@click.command()
@click.argument("job")
@click.option("--output-dir", default=None, help="Where the job's folder is, when not submitted from here.")
@click.pass_context
def stacks(ctx: click.Context, job: str, output_dir: str | None) -> None:
    """Print the Python stacks of every thread of every process of job JOB (local backend)."""
    try:
        folder = jobs.find_job(job, output_dir)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    record = jobs.refresh(jobs.read_record(folder))
    if record.final:
        raise click.ClickException(f"job {record.id} is {record.state}: it has no processes")
    if not engines.get(record.backend).processes_here or record.driver_pid is None:
        raise click.ClickException(
            f"job {record.id} runs on {record.backend}: `paratrain stacks` reaches the processes of "
            "local jobs; elsewhere send SIGUSR1 to a process, which writes its stacks to its log"
        )
    processes = job_processes(record.driver_pid)
    if not processes:
        raise click.ClickException(f"job {record.id}: no process of it runs on this machine now")
    gained = collect(processes, folder / "logs")
    for p in processes:
        click.echo(f"==== {p.role} {p.rank} (pid {p.pid}) ====")
        click.echo(gained.get(p.name, "").rstrip() or "(no stacks reached its log)")
