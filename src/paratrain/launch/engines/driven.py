"""The job platform's side of a `DrivenEngine` (api.py): a submitted job runs under a detached
driver process on this machine (`python -m paratrain.launch.job_driver FOLDER`), and stopping the
job is SIGTERM to that driver, which stops every process as the engine does on Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from paratrain.errors import LaunchError
from paratrain.launch import jobs
from paratrain.system import process_alive

if TYPE_CHECKING:
    from paratrain.launch.jobspec import JobSpec

_POLL_S = 0.5
_STOP_WAIT_S = 90.0

# Starts argv[2:] in a session of its own with its output appended to argv[1], prints its pid and
# exits: the driver is then nobody's child here, so it is reaped when it ends even while `submit -f`
# (or a test) is still running, and a Ctrl-C in this shell later is not the job's business.
_DETACH = (
    "import subprocess, sys\n"
    "with open(sys.argv[1], 'ab') as log:\n"
    "    print(subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log, stderr=log,"
    " start_new_session=True).pid)\n"
)


def start_driver(spec: JobSpec, folder: Path) -> None:
    """Starts the job's driver, detached, in the spec's work_dir; notes its pid in the record."""
    cmd = [sys.executable, "-m", "paratrain.launch.job_driver", str(folder)]
    log = folder / "logs" / "launcher.log"
    done = subprocess.run(
        [sys.executable, "-c", _DETACH, str(log), *cmd],
        cwd=spec.work_dir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:
        raise LaunchError(f"could not start the job's driver: {done.stderr.strip()}")
    jobs.update_record(folder, driver_pid=int(done.stdout), driver_host=socket.gethostname())


def stop_driver(record: jobs.JobRecord) -> jobs.JobRecord:
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
        if record.final and not process_alive(record.driver_pid or 0):
            return record
        if not process_alive(record.driver_pid or 0):
            break
        time.sleep(_POLL_S)
    else:
        raise RuntimeError(f"its driver (pid {record.driver_pid}) did not stop within {_STOP_WAIT_S} s")
    evaluator = record.extra.get("evaluator_pid")  # the driver died before stopping it
    if evaluator and process_alive(evaluator):
        os.killpg(evaluator, signal.SIGKILL)
    if record.final:
        return record
    report = "paratrain: stopped by paratrain stop; its driver ended without recording how\n"
    return jobs.update_record(record.folder, state="stopped", ended=time.time(), failure=report)
