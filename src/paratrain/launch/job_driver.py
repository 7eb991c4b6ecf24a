"""The driver of one submitted job on `local` or `ray`: `python -m paratrain.launch.job_driver FOLDER`.

`paratrain submit` starts it detached (its own session, output to logs/launcher.log) in the job's
work_dir. It marks the job running, runs its engine (a DrivenEngine: engines/api.py) with the job's
spec turned into a LaunchConfig, files each line the engine prints under its process (`LogFiles`),
runs the evaluator beside the job when the spec asks for one, and records how the job ended.
SIGTERM (what `paratrain stop` sends) reaches the engine's own handler, which stops every process on
every node; the job is then `stopped`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, cast

import yaml

from paratrain.launch import engines
from paratrain.launch.api import IDENTITY_VARS, LaunchConfig
from paratrain.launch.engines.api import DrivenEngine
from paratrain.launch.engines.ray.process import _WRAPPER
from paratrain.launch.jobs import EXIT_INTERRUPTED, EXIT_TERMINATED, JobRecord, read_record, update_record
from paratrain.launch.jobspec import JobSpec, launch_config
from paratrain.launch.report import JobResult

logger = logging.getLogger(__name__)

EVALUATOR_GRACE_S = 300.0
"""How long the evaluator may take, after training ended well, to score the last checkpoints."""
_STOP_GRACE_S = 5.0
_LINE = re.compile(r"^\[([a-z]+) (\d+)(?: @\S+)?\] (.*)$")


class LogFiles(io.TextIOBase):
    """A text stream that files every line: whole into job.log, and without its `[role rank] `
    prefix into logs/<role>-<rank>.log (other lines: logs/launcher.log). Both of an engine's
    streams may write to one LogFiles: a process's log holds its stdout and stderr, in order."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder
        self._files: dict[str, IO[str]] = {}
        self._lock = threading.Lock()
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
            for line in lines:
                self._file_line(line)
        return len(text)

    def _file_line(self, line: str) -> None:
        match = _LINE.match(line)
        name, body = (f"{match[1]}-{match[2]}", match[3]) if match else ("launcher", line)
        self._open("job.log").write(line + "\n")
        self._open(f"logs/{name}.log").write(body + "\n")

    def _open(self, name: str) -> IO[str]:
        if name not in self._files:
            self._files[name] = open(self.folder / name, "a", buffering=1)  # noqa: SIM115 (line-buffered: followable)
        return self._files[name]

    def flush(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.flush()

    def close(self) -> None:
        with self._lock:
            if self._partial:
                self._file_line(self._partial)
                self._partial = ""
            for f in self._files.values():
                f.close()
            self._files.clear()
        super().close()


def load_folder_spec(folder: Path) -> JobSpec:
    """The resolved spec that `submit` wrote into the job's folder."""
    return JobSpec.model_validate(yaml.safe_load((folder / "spec.yaml").read_text()))


def drive(folder: Path) -> int:
    """Runs the job in `folder` to its end and records it; the job's exit status."""
    spec = load_folder_spec(folder)
    record = update_record(
        folder, state="running", started=time.time(), driver_pid=os.getpid(), driver_host=socket.gethostname()
    )
    logs = LogFiles(folder)
    config = launch_config(spec, record.id, str(folder / "logs"))
    evaluator = None
    # Until the engine installs its own handlers (and after), SIGTERM stops the job here.
    previous = {signum: signal.signal(signum, _raise_stopped) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        if spec.evaluator:
            evaluator = Evaluator(config, folder, logs)
            update_record(folder, extra={"evaluator_pid": evaluator.proc.pid})
        engine = engines.get(spec.backend)
        assert isinstance(engine, DrivenEngine), f"{spec.backend} jobs are not driven from here"
        result = engine.drive(spec, config, cast(IO[str], logs))
    except _Stopped:
        result = JobResult(EXIT_TERMINATED, None, "paratrain: stopped before every process had started\n", [])
    finally:
        (folder / "training.done").touch()
    update_record(folder, extra={"pids": result.pids})
    exit_code, report = result.exit_code, result.report
    try:
        if evaluator is not None:
            exit_code, report = evaluator.finish(exit_code, report)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    logs.close()
    _record_end(folder, record, exit_code, report)
    return exit_code


class _Stopped(Exception):
    """SIGTERM or SIGINT outside the engine's own handling."""


def _raise_stopped(signum: int, frame: Any) -> None:
    raise _Stopped


def _record_end(folder: Path, record: JobRecord, exit_code: int, report: str) -> None:
    stopped = exit_code in (EXIT_INTERRUPTED, EXIT_TERMINATED)
    state = "succeeded" if exit_code == 0 else "stopped" if stopped else "failed"
    update_record(folder, state=state, ended=time.time(), exit_code=exit_code, failure=report)


class Evaluator:
    """The evaluator process: the job's script with PARATRAIN_TASK=evaluator and no cluster identity
    (paratrain.init() makes it a single process), beside the driver. PARATRAIN_TRAINING_DONE names the
    file that appears when training has ended (checkpoint.follow stops there)."""

    def __init__(self, config: LaunchConfig, folder: Path, logs: LogFiles) -> None:
        env = {k: v for k, v in os.environ.items() if k not in IDENTITY_VARS}
        env.update(config.job_env())
        env.update(
            PARATRAIN_TASK="evaluator",
            PARATRAIN_TRAINING_DONE=str(folder / "training.done"),
            PYTHONUNBUFFERED="1",
        )
        env.setdefault("OMP_NUM_THREADS", "1")
        # Through the Ray engine's process wrapper: the evaluator dies with this driver, even a SIGKILLed one.
        python = shutil.which(config.python) or config.python  # the wrapper execs an absolute path
        wrapper = [python, "-c", _WRAPPER, str(os.getpid()), python]
        self.proc = subprocess.Popen(
            [*wrapper, "-u", config.script, *config.args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._pump = threading.Thread(target=self._copy, args=(self.proc.stdout, logs), daemon=True)
        self._pump.start()
        self._stop_asked = False

    @staticmethod
    def _copy(pipe: IO[bytes], logs: LogFiles) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                logs.write(f"[evaluator 0] {raw.decode('utf-8', 'replace').rstrip()}\n")

    def finish(self, exit_code: int, report: str) -> tuple[int, str]:
        """After training ended: waits for the evaluator when training succeeded, else stops it.
        Returns the job's exit status and report, the evaluator's failure included."""
        if exit_code == 0:
            with self._sigterm_stops():
                returncode = self._wait(EVALUATOR_GRACE_S)
            if self._stop_asked:
                self._stop()
                return (
                    EXIT_TERMINATED,
                    "paratrain: stopped while the evaluator was scoring the last checkpoints\n",
                )
            if returncode is None:
                self._stop()
                return 1, f"paratrain: job failed: evaluator 0 did not finish within {EVALUATOR_GRACE_S} s\n"
            if returncode != 0:
                return 1, f"paratrain: job failed: evaluator 0 exited with code {returncode}\n"
            return exit_code, report
        self._stop()
        return exit_code, report

    def _wait(self, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._stop_asked:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return self.proc.wait(timeout=0.5)
        return None

    @contextlib.contextmanager
    def _sigterm_stops(self) -> Any:
        def asked(signum: int, frame: Any) -> None:
            self._stop_asked = True

        previous = {s: signal.signal(s, asked) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _stop(self) -> None:
        for signum, wait_s in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, 30.0)):
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signum)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
        self._pump.join(5.0)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="paratrain: %(message)s")
    if len(argv) != 2:
        print("usage: python -m paratrain.launch.job_driver JOB_FOLDER", file=sys.stderr)
        return 2
    folder = Path(argv[1])
    try:
        return drive(folder)
    except BaseException as exc:  # the record must say why, whatever happened
        record = read_record(folder)
        if not record.final:
            update_record(
                folder, state="failed", ended=time.time(), failure=f"paratrain: the driver failed: {exc!r}\n"
            )
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv))
