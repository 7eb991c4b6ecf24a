"""Jobs as things: each submission's id, folder, state and logs, wherever its processes run.

    OUTPUT_DIR/jobs/<id>/
        spec.yaml       the resolved spec (paths absolute, defaults filled in)
        state.json      state, times, exit code, failure report, who drives it (JobRecord)
        job.log         every line of every process, prefixed `[role rank] ` (local, ray)
        logs/           one file per process: worker-0.log, server-0.log, ..., evaluator-0.log,
                        launcher.log (what the driver itself said); slurm-<n>.out under Slurm
        training.done   written when the training processes have ended (the evaluator's cue)

Each engine says how its jobs are handed over, asked about and stopped (engines/api.py): a job on
`local` or `ray` is driven by a detached driver process (job_driver.py) on the machine that
submitted it, and stopping it is SIGTERM to that driver; a job on `slurm` or `k8s` is handed to
the cluster's scheduler, asked about and cancelled with its commands. Where OUTPUT_DIR is a path
in the pods (k8s), the job's folder is kept under PARATRAIN_HOME instead.

state.json is rewritten atomically (temporary file, rename), so a reader on another machine sees
one version or the next. Every submission is also noted in PARATRAIN_HOME/jobs/<id> (default
~/.paratrain), a file naming its folder, so that `paratrain logs ID` and `stop ID` need no path.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import socket
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from paratrain.system import atomic_write, process_alive

STATES = ("pending", "running", "succeeded", "failed", "stopped")
FINAL = frozenset({"succeeded", "failed", "stopped"})
EXIT_INTERRUPTED = 130  # SIGINT, as a shell reports it
EXIT_TERMINATED = 143  # SIGTERM (what `paratrain stop` sends)
_ID = re.compile(r"^[a-z][a-z0-9-]*-\d{8}-\d{6}-[0-9a-f]{4}$")


@dataclass
class JobRecord:
    """The contents of state.json."""

    id: str
    name: str
    backend: str
    state: str = "pending"
    """One of STATES."""
    folder: str = ""
    """The job's folder (where this record lives)."""
    output_dir: str = ""
    workers: int = 0
    servers: int = 0
    evaluator: int = 0
    submitted: float = 0.0
    """Unix times; 0 for not yet."""
    started: float = 0.0
    ended: float = 0.0
    exit_code: int | None = None
    failure: str = ""
    """The failure (or stop) report, as the launcher printed it."""
    driver_pid: int | None = None
    """local, ray: the detached driver process."""
    driver_host: str = ""
    cluster_id: str = ""
    """slurm: the Slurm job id; k8s: the job's name (its objects' label) and namespace, name/ns."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def final(self) -> bool:
        return self.state in FINAL


def paratrain_home() -> Path:
    return Path(os.environ.get("PARATRAIN_HOME") or Path.home() / ".paratrain")


def new_job_id(name: str) -> str:
    """<name>-<UTC date>-<time>-<4 hex digits>: sorts by submission, and is a DNS label."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


def create_job(record: JobRecord, spec_text: str) -> Path:
    """Makes the job's folder with its spec and first state, and notes it in PARATRAIN_HOME."""
    folder = Path(record.folder)
    (folder / "logs").mkdir(parents=True, exist_ok=False)
    atomic_write(folder / "spec.yaml", spec_text)
    write_record(record)
    index = paratrain_home() / "jobs"
    index.mkdir(parents=True, exist_ok=True)
    atomic_write(index / record.id, f"{folder}\n")
    return folder


def open_job(spec: Any, job_id: str, folder: Path, make_output_dir: bool = True) -> JobRecord:
    """The first record of a submission of `spec` (a resolved JobSpec), its folder made (and its
    output_dir, when that is a path on this machine)."""
    import yaml

    record = JobRecord(
        id=job_id,
        name=spec.name,
        backend=spec.backend,
        folder=str(folder),
        output_dir=spec.output_dir,
        workers=spec.workers,
        servers=spec.servers,
        evaluator=spec.evaluator,
        submitted=time.time(),
    )
    if make_output_dir:
        Path(spec.output_dir).mkdir(parents=True, exist_ok=True)
    create_job(record, yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
    return record


def write_record(record: JobRecord) -> None:
    atomic_write(
        Path(record.folder) / "state.json", json.dumps(asdict(record), indent=1, sort_keys=True) + "\n"
    )


def read_record(folder: str | os.PathLike[str]) -> JobRecord:
    """The record in `folder`; ValueError naming the file when it is missing or damaged."""
    path = Path(folder) / "state.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a job's state: {exc}") from None
    known = {f.name for f in fields(JobRecord)}
    return JobRecord(**{key: value for key, value in data.items() if key in known})


def update_record(folder: str | os.PathLike[str], **changes: Any) -> JobRecord:
    """Reads, changes and rewrites the record, holding the job's lock: `submit`, the driver and
    `stop` may each change it at once. `extra` is merged into the record's."""
    with open(Path(folder) / ".state.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = read_record(folder)
        for key, value in changes.items():
            if key == "extra":
                record.extra.update(value)
            else:
                setattr(record, key, value)
        write_record(record)
    return record


def find_job(job: str, output_dir: str | None = None) -> Path:
    """The folder of job `job`: an id (looked up in output_dir/jobs, then PARATRAIN_HOME) or a path
    to the folder itself. ValueError saying where it looked."""
    as_path = Path(job)
    if (as_path / "state.json").is_file():
        return as_path
    places = []
    if output_dir is not None:
        places.append(Path(output_dir) / "jobs" / job)
    note = paratrain_home() / "jobs" / job
    if "/" not in job and note.is_file():
        places.append(Path(note.read_text().strip()))
    for place in places:
        if (place / "state.json").is_file():
            return place
    where = f"{output_dir}/jobs, " if output_dir else ""
    raise ValueError(
        f"no job {job!r}: looked in {where}{paratrain_home() / 'jobs'} (give OUTPUT_DIR with --output-dir, "
        f"or the job's folder)"
    )


def list_jobs(output_dir: str | None = None) -> list[JobRecord]:
    """Every job under output_dir/jobs, or every job noted in PARATRAIN_HOME; oldest first."""
    if output_dir is not None:
        folders = sorted(p for p in (Path(output_dir) / "jobs").glob("*") if (p / "state.json").is_file())
    else:
        notes = sorted((paratrain_home() / "jobs").glob("*"))
        folders = [Path(note.read_text().strip()) for note in notes if _ID.match(note.name)]
    records = []
    for folder in folders:
        try:
            records.append(refresh(read_record(folder)))
        except ValueError:
            continue  # removed, or on a file system not mounted here
    return sorted(records, key=lambda r: (r.submitted, r.id))


def refresh(record: JobRecord) -> JobRecord:
    """The record, with a driver that died without saying so (this machine's) marked failed."""
    if record.final or record.driver_pid is None or record.driver_host != socket.gethostname():
        return record
    if not process_alive(record.driver_pid):
        record = read_record(record.folder)  # it may have finished between the two reads
        if not record.final:
            report = f"the job's driver (pid {record.driver_pid}) died without recording how the job ended"
            return update_record(record.folder, state="failed", ended=time.time(), failure=report)
    return record


def log_path(folder: str | os.PathLike[str], role: str | None, rank: int) -> Path:
    """job.log (every process), one process's log, or (role "launcher") what the driver said."""
    folder = Path(folder)
    if role is None:
        return folder / "job.log"
    return folder / "logs" / ("launcher.log" if role == "launcher" else f"{role}-{rank}.log")


def describe_time(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if when else "-"


def describe_duration(record: JobRecord, now: float | None = None) -> str:
    if not record.started:
        return "-"
    seconds = (record.ended or now or time.time()) - record.started
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
