"""The local launcher, its CLI and the run_job test helper, with scripts that need no runtime.

The scripts read PARATRAIN_ROLE/RANK themselves. Workers mark themselves done with a file; the
scheduler and servers exit 0 once every worker's mark exists (what paratrain.init() will do for
them). Every run_job call also asserts that no child survives and the scheduler's port is closed.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import IO

import pytest
from click.testing import CliRunner

from paratrain.cluster.spec import EXIT_ABORTED
from paratrain.launch.cli import main
from paratrain.launch.engines.local.job import LocalJobConfig
from paratrain.launch.report import _first_failure
from paratrain.testing import (
    assert_all_gone,
    free_port,
    listening_ports,
    run_job,
)

pytestmark = pytest.mark.timeout(60)

PARATRAIN = str(Path(sys.executable).parent / "paratrain")

PRELUDE = '''
import os, signal, sys, time
from pathlib import Path

from paratrain.system import process_alive

ROLE = os.environ["PARATRAIN_ROLE"]
RANK = int(os.environ["PARATRAIN_RANK"])
NUM_WORKERS = int(os.environ["PARATRAIN_NUM_WORKERS"])
NUM_SERVERS = int(os.environ["PARATRAIN_NUM_SERVERS"])
MARKERS = Path(os.environ["TEST_MARKERS"])


def mark(name, text=""):
    """Creates MARKERS/name atomically, so a reader never sees it half written."""
    tmp = MARKERS / f".{name}.{os.getpid()}"
    tmp.write_text(text)
    tmp.rename(MARKERS / name)


def wait_for(*names, limit_s=30.0):
    deadline = time.monotonic() + limit_s
    while not all((MARKERS / name).exists() for name in names):
        if time.monotonic() > deadline:
            sys.exit(f"{ROLE} {RANK}: waited {limit_s} s for {names}")
        time.sleep(0.01)


def wait_until_gone(pid):
    while process_alive(pid):
        time.sleep(0.01)


def serve_until_workers_done():
    """What a scheduler or server does in these tests: exit 0 once every worker is done."""
    wait_for(*(f"worker-{rank}.done" for rank in range(NUM_WORKERS)))
    sys.exit(0)
'''


def job(body: str) -> str:
    return PRELUDE + textwrap.dedent(body)


@pytest.fixture
def markers(tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "markers"
    path.mkdir()
    return {"TEST_MARKERS": str(path)}


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


# ---- a healthy job ---------------------------------------------------------------------------

ROLL_CALL = job(
    """
    import socket

    def listening_inodes(port):
        inodes = set()
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):
            for row in Path(name).read_text().splitlines()[1:]:
                f = row.split()
                if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{f[9]}]")
        return inodes

    def holds(pid, inodes):
        links = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                links.add(os.readlink(fd))
            except OSError:
                pass
        return bool(links & inodes)

    host, port = os.environ["PARATRAIN_SCHEDULER"].rsplit(":", 1)
    print(f"hello from {ROLE} {RANK} of {NUM_WORKERS} workers and {NUM_SERVERS} servers")
    print(f"{ROLE} {RANK} on stderr", file=sys.stderr)
    print("host", os.environ["PARATRAIN_HOST"], "unbuffered", os.environ["PYTHONUNBUFFERED"])
    print("launcher", os.environ["PARATRAIN_LAUNCHER_PID"], "extra", os.environ["EXTRA"])
    print("has scheduler fd", "PARATRAIN_SCHEDULER_FD" in os.environ)
    for i in range(200):
        print(f"chunk {i} " + "x" * 40)
    if ROLE == "scheduler":
        listener = socket.socket(fileno=int(os.environ["PARATRAIN_SCHEDULER_FD"]))
        print("inherited socket port matches", listener.getsockname()[1] == int(port))
        print("scheduler holds its socket", holds(os.getpid(), listening_inodes(int(port))))
        listener.settimeout(30)
        ranks = []
        for _ in range(NUM_WORKERS):
            conn, _ = listener.accept()
            with conn:
                ranks.append(int(conn.makefile().readline()))
        print("registered workers", sorted(ranks))
        serve_until_workers_done()
    elif ROLE == "server":
        serve_until_workers_done()
    else:
        launcher = int(os.environ["PARATRAIN_LAUNCHER_PID"])
        print("launcher holds the socket", holds(launcher, listening_inodes(int(port))))
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(f"{RANK}\\n".encode())
        mark(f"worker-{RANK}.done")
    """
)


def test_every_role_runs_with_its_identity_and_its_output_comes_back_per_child(markers):
    outcome = run_job(ROLL_CALL, workers=3, servers=2, env={**markers, "EXTRA": "yes"})

    assert outcome.exit_code == 0 and outcome.failure is None and outcome.report == ""
    children = [("scheduler", 0), ("server", 0), ("server", 1)] + [("worker", r) for r in range(3)]
    assert len(outcome.pids) == len(children)
    for role, rank in children:
        out = outcome.lines(role, rank, "stdout")
        assert out[0] == f"hello from {role} {rank} of 3 workers and 2 servers"
        assert out[1] == "host 127.0.0.1 unbuffered 1"
        assert out[2] == f"launcher {os.getpid()} extra yes"
        assert out[3] == f"has scheduler fd {role == 'scheduler'}"
        chunks = [line for line in out if line.startswith("chunk ")]
        assert chunks == [f"chunk {i} " + "x" * 40 for i in range(200)]
        assert outcome.lines(role, rank, "stderr") == [f"{role} {rank} on stderr"]
        assert f"[{role} {rank}] hello from {role} {rank} of" in outcome.stdout
    for line in outcome.stdout.splitlines():  # whole lines only, each from one child
        assert re.fullmatch(r"\[(scheduler 0|server [01]|worker [012])\] \S.*", line), line

    scheduler = outcome.lines("scheduler", 0)
    assert "inherited socket port matches True" in scheduler
    assert "scheduler holds its socket True" in scheduler
    assert "registered workers [0, 1, 2]" in scheduler
    for rank in range(3):
        assert "launcher holds the socket False" in outcome.lines("worker", rank)
    assert port_of(outcome.scheduler_address) not in listening_ports()


SECRET_CHECK = job(
    """
    import hashlib

    secret = os.environ["PARATRAIN_SECRET"]
    print("secret bytes", len(bytes.fromhex(secret)))
    print("secret sha256", hashlib.sha256(secret.encode()).hexdigest())
    mark(f"{ROLE}-{RANK}.started")
    everyone = ["scheduler-0.started"] + [f"server-{r}.started" for r in range(NUM_SERVERS)]
    wait_for(*everyone, *(f"worker-{r}.started" for r in range(NUM_WORKERS)))
    if ROLE == "worker":
        leaks = []  # while every process of the job is alive: no command line holds the secret
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and secret.encode() in (proc / "cmdline").read_bytes():
                    leaks.append(proc.name)
            except OSError:
                pass
        print("command lines holding the secret", leaks)
        mark(f"worker-{RANK}.done")
    else:
        serve_until_workers_done()
    """
)


def test_the_secret_is_shared_by_environment_and_on_no_command_line(markers):
    outcome = run_job(SECRET_CHECK, workers=2, servers=1, env=markers)

    children = [("scheduler", 0), ("server", 0), ("worker", 0), ("worker", 1)]
    hashes = set()
    for role, rank in children:
        lines = outcome.lines(role, rank)
        assert "secret bytes 32" in lines
        hashes.update(line for line in lines if line.startswith("secret sha256 "))
    assert len(hashes) == 1
    for rank in range(2):
        assert "command lines holding the secret []" in outcome.lines("worker", rank)


def test_a_second_job_gets_another_secret(markers):
    def secret_hash() -> str:
        for name in os.listdir(markers["TEST_MARKERS"]):
            os.remove(os.path.join(markers["TEST_MARKERS"], name))
        outcome = run_job(SECRET_CHECK, workers=1, servers=0, env=markers)
        return next(x for x in outcome.lines("worker", 0) if x.startswith("secret sha256"))

    assert secret_hash() != secret_hash()


# ---- failures --------------------------------------------------------------------------------

FAILING_WORKER = job(
    """
    if ROLE != "worker":
        serve_until_workers_done()
    elif RANK == 1:
        how = sys.argv[1]
        print("worker 1 is about to fail", file=sys.stderr)
        if how == "raise":
            raise RuntimeError("worker 1 broke on purpose")
        if how == "exit":
            sys.exit(3)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "chatty":
            for i in range(100):
                print(f"line {i}", file=sys.stderr)
            sys.exit(3)
    elif RANK == 0:
        mark("worker-0.done")  # one worker succeeds, one is still running when worker 1 fails
    else:
        time.sleep(600)
    """
)


@pytest.mark.parametrize(
    "how, returncode, signame, reason, evidence",
    [
        ("raise", 1, None, "exited with code 1", "RuntimeError: worker 1 broke on purpose"),
        ("exit", 3, None, "exited with code 3", "worker 1 is about to fail"),
        ("kill", -signal.SIGKILL, "SIGKILL", "was killed by signal SIGKILL", "about to fail"),
    ],
)
def test_a_failing_worker_stops_the_job_and_is_named(markers, how, returncode, signame, reason, evidence):
    outcome = run_job(FAILING_WORKER, workers=3, servers=2, args=[how], env=markers, expect="failure")

    assert outcome.exit_code == 1
    failure = outcome.failure
    assert failure is not None
    assert (failure.role, failure.rank, failure.host) == ("worker", 1, "127.0.0.1")
    assert (failure.returncode, failure.signal, failure.reason) == (returncode, signame, reason)
    assert failure.pid in outcome.pids
    header = f"paratrain: job failed: worker 1 (pid {failure.pid}, host 127.0.0.1) {reason}"
    assert outcome.report.startswith(header + "\n")
    assert evidence in outcome.report
    assert any(evidence in line for line in failure.stderr_tail)
    assert outcome.stderr.endswith(outcome.report)  # printed after the children's output
    assert port_of(outcome.scheduler_address) not in listening_ports()


def test_the_report_keeps_only_the_last_stderr_lines(markers):
    outcome = run_job(FAILING_WORKER, workers=2, servers=0, args=["chatty"], env=markers, expect="failure")

    assert outcome.failure is not None
    assert outcome.failure.stderr_tail == [f"line {i}" for i in range(70, 100)]
    assert "    line 99" in outcome.report and "    line 69" not in outcome.report
    assert len(outcome.lines("worker", 1, "stderr")) == 101  # the full output still comes back


ABORT_AFTER_FAILURE = job(
    """
    if ROLE != "worker":
        serve_until_workers_done()
    elif RANK == 1:
        wait_for("worker-0.ready")
        mark("worker-1.pid", str(os.getpid()))
        sys.exit(3)
    else:
        # Like a worker that the scheduler aborts because worker 1 failed: it exits with
        # EXIT_ABORTED after worker 1 is gone, or when the launcher stops it first.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(75))
        mark("worker-0.ready")
        wait_for("worker-1.pid")
        wait_until_gone(int((MARKERS / "worker-1.pid").read_text()))
        sys.exit(75)
    """
)


def test_an_aborted_exit_after_the_real_failure_is_not_the_cause(markers):
    outcome = run_job(ABORT_AFTER_FAILURE, workers=2, servers=1, env=markers, expect="failure")

    assert outcome.failure is not None
    assert (outcome.failure.role, outcome.failure.rank) == ("worker", 1)
    assert outcome.failure.returncode == 3
    assert outcome.report.startswith("paratrain: job failed: worker 1 (pid ")


ABORT_BEFORE_FAILURE = job(
    """
    if ROLE != "worker":
        serve_until_workers_done()
    elif RANK == 0:
        mark("worker-0.pid", str(os.getpid()))
        sys.exit(75)
    else:
        # The cause exits after a consequence: the launcher must wait for it, not blame worker 0.
        wait_for("worker-0.pid")
        wait_until_gone(int((MARKERS / "worker-0.pid").read_text()))
        print("worker 1 fails for real", file=sys.stderr)
        sys.exit(3)
    """
)


def test_a_failure_that_follows_an_aborted_exit_is_the_cause(markers):
    outcome = run_job(
        ABORT_BEFORE_FAILURE, workers=2, servers=1, env=markers, expect="failure", stop_grace_s=30
    )

    assert outcome.failure is not None
    assert (outcome.failure.role, outcome.failure.rank) == ("worker", 1)
    assert outcome.failure.returncode == 3
    assert "worker 1 fails for real" in outcome.report
    assert re.search(
        r"also stopped, as the job was aborted \(exit code 75\): worker 0 \(pid \d+\)", outcome.report
    )


def test_first_failure_prefers_the_earliest_cause_over_aborted_exits():
    def exit_(name: str, returncode: int, t: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, returncode=returncode, exit_time=t)

    aborted, cause, later = exit_("a", EXIT_ABORTED, 1.0), exit_("c", 3, 2.0), exit_("l", -9, 3.0)
    assert _first_failure([later, aborted, cause]) is cause
    second_abort = exit_("b", EXIT_ABORTED, 0.5)
    assert _first_failure([aborted, second_abort]) is second_abort
    assert _first_failure([cause]) is cause
    early_clean = exit_("s", 0, 0.1)  # a scheduler that left once a failing worker said it finished
    assert _first_failure([early_clean, cause, aborted]) is cause
    assert _first_failure([aborted, early_clean]) is early_clean


SCHEDULER_LEAVES_EARLY = job(
    """
    if ROLE == "scheduler":
        sys.exit(0)
    time.sleep(600)
    """
)


def test_a_scheduler_that_exits_before_the_workers_finish_fails_the_job(markers):
    outcome = run_job(
        SCHEDULER_LEAVES_EARLY,
        workers=2,
        servers=1,
        env=markers,
        exit_grace_s=0.5,
        expect="failure",
    )

    assert outcome.failure is not None
    assert (outcome.failure.role, outcome.failure.rank) == ("scheduler", 0)
    assert outcome.failure.returncode == 0
    assert "exited early" in outcome.report.splitlines()[0]


SERVER_STAYS = job(
    """
    if ROLE == "worker":
        mark(f"worker-{RANK}.done")
    elif ROLE == "server" and RANK == 1:
        time.sleep(600)
    else:
        serve_until_workers_done()
    """
)


def test_a_server_that_does_not_exit_after_the_workers_finish_is_stopped(markers):
    outcome = run_job(SERVER_STAYS, workers=2, servers=2, env=markers, exit_grace_s=0.5, expect="failure")

    assert outcome.failure is not None
    assert (outcome.failure.role, outcome.failure.rank) == ("server", 1)
    assert outcome.report.startswith("paratrain: job failed: server 1 (pid ")
    assert "did not exit within 0.5 s after every worker finished" in outcome.report
    assert "stopped by the launcher: server 1 (pid " in outcome.report


HANGING = job(
    """
    if ROLE == "worker" and RANK == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops this one
    print(f"{ROLE} {RANK} is up")
    time.sleep(600)
    """
)


def test_the_job_timeout_stops_everything(markers):
    outcome = run_job(
        HANGING, workers=2, servers=1, env=markers, timeout_s=2.0, stop_grace_s=0.5, expect=None
    )

    assert outcome.exit_code == 1
    assert outcome.failure is not None and outcome.failure.role == "worker"
    assert outcome.failure.reason == "was still running when the job timed out after 2.0 s"
    still_running = outcome.report.splitlines()[1]
    for name in ("scheduler 0", "server 0", "worker 0", "worker 1"):
        assert name in still_running


# ---- the run_job helper itself ---------------------------------------------------------------


def test_run_job_brings_the_child_traceback_into_the_assertion(markers):
    with pytest.raises(AssertionError) as info:
        run_job(FAILING_WORKER, workers=2, args=["raise"], env=markers)
    message = str(info.value)
    assert "paratrain: job failed: worker 1" in message
    assert "[worker 1] RuntimeError: worker 1 broke on purpose" in message


SUCCEEDING = job(
    """
    print(f"{ROLE} {RANK} is fine")
    if ROLE == "worker":
        mark(f"worker-{RANK}.done")
    else:
        serve_until_workers_done()
    """
)


def test_run_job_takes_a_path_and_complains_when_an_expected_failure_succeeds(markers, tmp_path):
    script = tmp_path / "ok.py"
    script.write_text(SUCCEEDING)
    with pytest.raises(AssertionError, match="expected a failure") as info:
        run_job(script, workers=1, servers=1, env=markers, expect="failure")
    assert "[server 0] server 0 is fine" in str(info.value)


def test_assert_all_gone_names_and_kills_survivors():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with pytest.raises(AssertionError, match=str(proc.pid)):
            assert_all_gone([proc.pid], wait_s=0.1)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def test_listening_ports_sees_a_listening_socket_and_free_port_is_free():
    import socket

    port = free_port()
    assert port not in listening_ports()
    with socket.create_server(("127.0.0.1", port)):
        assert port in listening_ports()


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_workers", 0),
        ("num_servers", -1),
        ("timeout_s", 0),
        ("stop_grace_s", -1.0),
        ("exit_grace_s", -0.5),
        ("host", ""),
        ("script", ""),
    ],
)
def test_config_rejects_bad_values_naming_field_and_value(field, value):
    kwargs = {"script": "train.py", field: value}
    with pytest.raises(ValueError, match=re.escape(field)) as info:
        LocalJobConfig(**kwargs)
    assert repr(value) in str(info.value)


# ---- the command line ------------------------------------------------------------------------

CLI_SCRIPT = job(
    """
    print(f"pid {os.getpid()}")
    if ROLE == "worker":
        print("argv", sys.argv[1:])
    mark(f"{ROLE}-{RANK}.up")
    if ROLE != "worker":
        serve_until_workers_done()
    else:
        if "--fail" in sys.argv and RANK == 1:
            wait_for("scheduler-0.up", "worker-0.up")  # every pid is printed before the job stops
            sys.exit(4)
        mark(f"worker-{RANK}.done")
    """
)


def _pids_in(stdout: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"^\[\w+ \d+\] pid (\d+)$", stdout, re.M)]


def _scheduler_port_in(stderr: str) -> int:
    match = re.search(r"scheduler at [\w.]+:(\d+)", stderr)
    assert match, stderr
    return int(match[1])


@pytest.mark.parametrize(
    "script_args, exit_code",
    [(["--flag", "-w", "7", "--", "x"], 0), (["--fail", "-s", "3"], 1)],
)
def test_cli_passes_script_args_through_and_exits_with_the_job_status(
    markers, tmp_path, script_args, exit_code
):
    script = tmp_path / "cli_job.py"
    script.write_text(CLI_SCRIPT)
    cmd = [PARATRAIN, "launch", "-w", "2", "-s", "0", "--", str(script), *script_args]
    proc = subprocess.run(cmd, env={**os.environ, **markers}, capture_output=True, text=True, timeout=50)

    assert proc.returncode == exit_code, proc.stderr
    assert f"[worker 0] argv {script_args!r}" in proc.stdout.splitlines()
    assert "[scheduler 0] pid " in proc.stdout and "[server " not in proc.stdout
    pids = _pids_in(proc.stdout)
    assert len(pids) == 3
    assert_all_gone(pids)
    assert _scheduler_port_in(proc.stderr) not in listening_ports()
    if exit_code:
        assert "paratrain: job failed: worker 1 (pid " in proc.stderr
        assert ") exited with code 4" in proc.stderr


def test_cli_without_double_dash_and_version(markers, tmp_path):
    script = tmp_path / "cli_job.py"
    script.write_text(CLI_SCRIPT)
    cmd = [PARATRAIN, "launch", "-w", "1", "-s", "1", str(script), "-w", "9"]
    proc = subprocess.run(cmd, env={**os.environ, **markers}, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "[worker 0] argv ['-w', '9']" in proc.stdout.splitlines()

    version = subprocess.run([PARATRAIN, "--version"], capture_output=True, text=True, timeout=50)
    assert version.returncode == 0 and "0.1.0" in version.stdout


SLEEPER = job(
    """
    print(f"pid {os.getpid()}")
    time.sleep(600)
    """
)


class _Reader:
    """Reads a pipe in a thread, so that a test can wait for lines with a deadline."""

    def __init__(self, pipe: IO[str]) -> None:
        self.lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self.seen: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe: IO[str]) -> None:
        for line in pipe:
            self.seen.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def pids(self, count: int, limit_s: float) -> list[int]:
        """Waits until `count` children have printed their pid."""
        deadline = time.monotonic() + limit_s
        while len(_pids_in("".join(self.seen))) < count and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                if self.lines.get(timeout=0.1) is None:
                    break
        return _pids_in("".join(self.seen))

    def text(self) -> str:
        self._thread.join(10)
        return "".join(self.seen)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_launcher_stops_every_child(markers, tmp_path, signum):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    cmd = [PARATRAIN, "launch", "-w", "2", "-s", "1", str(script)]
    env = {**os.environ, **markers}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = _Reader(proc.stdout), _Reader(proc.stderr)
    try:
        assert len(out.pids(4, limit_s=30)) == 4, err.text()
        proc.send_signal(signum)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:  # the launcher is stuck: clean up after it, then fail
            proc.kill()
            proc.wait()
            for pid in _pids_in(out.text()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    stderr = err.text()
    pids = _pids_in(out.text())
    assert proc.returncode == 128 + signum, stderr  # 130 for SIGINT, 143 for SIGTERM, as a shell says
    assert "paratrain: interrupted by " + signal.Signals(signum).name in stderr
    assert_all_gone(pids)
    assert _scheduler_port_in(stderr) not in listening_ports()


THREADS_SCRIPT = job(
    """
    if ROLE == "worker":
        print("threads", os.environ.get("OMP_NUM_THREADS"), os.environ.get("MKL_NUM_THREADS"))
        mark(f"worker-{RANK}.done")
    else:
        serve_until_workers_done()
    """
)


@pytest.mark.parametrize("user_threads", [None, "3"])
def test_the_launcher_gives_each_process_its_share_of_the_cores(markers, tmp_path, user_threads):
    script = tmp_path / "threads_job.py"
    script.write_text(THREADS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if user_threads:
        env["OMP_NUM_THREADS"] = user_threads
    cmd = [PARATRAIN, "launch", "-w", "2", "-s", "1", str(script)]
    proc = subprocess.run(cmd, env={**env, **markers}, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    share = str(max(1, len(os.sched_getaffinity(0)) // 3))
    expected = f"threads {user_threads} None" if user_threads else f"threads {share} {share}"
    assert f"[worker 1] {expected}" in proc.stdout.splitlines()
    said = "as set by the user" if user_threads else f"OMP_NUM_THREADS={share} ("
    assert f"threads per process: {said}" in proc.stderr


@pytest.mark.parametrize(
    "strategy, named",
    [("dist_snyc", "'dist_snyc'"), ("ps:consistency=eventual", "consistency"), ("hybrid", "num_servers=0")],
)
def test_a_bad_strategy_fails_before_any_process_starts(markers, tmp_path, strategy, named):
    # In this process (click's runner): a `paratrain` process would spend 2 CPU-s importing torch
    # for the strategy's check; the tests above run the command itself.
    script = tmp_path / "cli_job.py"
    script.write_text(CLI_SCRIPT)
    args = ["launch", "-w", "2", "-s", "0", "--strategy", strategy, str(script)]
    done = CliRunner().invoke(main, args, env=markers)
    assert done.exit_code == 2, done.output
    assert named in done.stderr and "pid " not in done.stdout
