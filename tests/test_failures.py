"""What a job does when one of its processes, or its launcher, is killed: every process of the job
exits on its own, and the last good checkpoint resumes to the result of an uninterrupted run.

The kill test runs `paratrain launch` on the Trainer parity job (dist_sync, a checkpoint every step,
a short sleep per step) four times on one checkpoint folder. Each run resumes from the last
checkpoint of the one before, and once it saved a checkpoint of its own, one process (the launcher,
the scheduler, a server, a worker) is killed with SIGKILL at a moment drawn from the seed; the
launcher and every process of the job must be gone within KILL_LIMIT_S. A fifth run must end where
the single-process reference does ("parity ok", the check the parity tests use).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from paratrain import checkpoint
from paratrain.testing import run_job

JOBS = Path(__file__).resolve().parent / "jobs"
PARATRAIN = str(Path(sys.executable).parent / "paratrain")
KILL_LIMIT_S = 10.0
STEPS = 40
SEEDS = [int(seed) for seed in os.environ.get("PARATRAIN_KILL_SEEDS", "1").split(",")]
"""CI runs one chain of four kills; PARATRAIN_KILL_SEEDS=1,2,3 runs more."""

_PID_LINE = re.compile(r"^\[(scheduler|server|worker) (\d+)\] pid (\d+)$", re.M)


def _gone(pid: int) -> bool:
    """Exited (a zombie counts as gone: whoever adopted it may not reap it at once)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_gone(pids: list[int], limit_s: float) -> float:
    """Seconds until every pid exited; kills survivors and fails after `limit_s`."""
    start = time.monotonic()
    while not all(_gone(pid) for pid in pids):
        if time.monotonic() - start > limit_s:
            left = [pid for pid in pids if not _gone(pid)]
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"processes still alive {limit_s} s after the kill: {left}")
        time.sleep(0.02)
    return time.monotonic() - start


class Launch:
    """`paratrain launch` in its own process group, its output read by threads."""

    def __init__(self, args: list[str], workers: int, servers: int) -> None:
        cmd = [PARATRAIN, "launch", "-w", str(workers), "-s", str(servers), str(JOBS / "print_pid.py"), *args]
        self.count = 1 + workers + servers
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [
            threading.Thread(target=self._read, args=(pipe, lines), daemon=True)
            for pipe, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _read(pipe, lines: list[str]) -> None:  # noqa: ANN001
        for line in pipe:
            lines.append(line)

    def pids(self, limit_s: float = 60.0) -> dict[tuple[str, int], int]:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = {(r, int(k)): int(p) for r, k, p in _PID_LINE.findall("".join(self.out))}
            if len(found) == self.count:
                return found
            time.sleep(0.02)
        self.kill()
        raise AssertionError(f"not every process started:\n{''.join(self.err)}")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for pid in {int(p) for *_, p in _PID_LINE.findall("".join(self.out))}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stderr(self) -> str:
        for thread in self._threads:
            thread.join(timeout=5)
        return "".join(self.err)


def wait_for_checkpoint(folder: Path, launch: Launch, past: int, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while (found := checkpoint.latest(folder)) is None or found.step <= past:
        assert launch.proc.poll() is None, f"the job ended before its first checkpoint:\n{launch.stderr()}"
        assert time.monotonic() < deadline, f"no checkpoint past step {past} within {limit_s} s"
        time.sleep(0.02)


def kill_one(args: list[str], ckpt: Path, target: str, rng: random.Random, start: int) -> tuple[float, int]:
    """Runs the job until it saved a checkpoint past `start`, kills `target` at a random moment,
    and returns how long every process took to go and the step of the last checkpoint."""
    launch = Launch([str(JOBS / "train_parity.py"), *args, "delay=0.1"], workers=2, servers=1)
    try:
        pids = launch.pids()
        wait_for_checkpoint(ckpt, launch, past=start)
        time.sleep(rng.uniform(0.0, 0.5))  # somewhere in training: in a step, a barrier or a save
        assert launch.proc.poll() is None, "the job ended before the kill"
        if target == "launcher":
            os.killpg(launch.proc.pid, signal.SIGKILL)
        else:
            os.kill(pids[target, rng.randrange(2) if target == "worker" else 0], signal.SIGKILL)
        seconds = wait_gone([launch.proc.pid, *pids.values()], KILL_LIMIT_S)
    except BaseException:
        launch.kill()
        raise
    launch.proc.wait()
    started = re.findall(r"^\[worker \d\] starting at step (\d+)$", "".join(launch.out), re.M)
    assert started == [str(start)] * 2, f"the run did not resume from step {start}: {started}"
    if target != "launcher":
        first = launch.stderr().split("paratrain: job failed: ", 1)[-1].splitlines()[0]
        assert first.startswith(target) and "killed by signal SIGKILL" in first, first
    saved = checkpoint.latest(ckpt)
    assert saved is not None and start < saved.step < STEPS, (start, saved)
    return seconds, saved.step


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SEEDS)
def test_kills_end_every_process_and_each_run_resumes_from_the_last_checkpoint(tmp_path, seed):
    # One chain of runs on one checkpoint folder: each run resumes from the last checkpoint of the
    # one before, is killed (the launcher, the scheduler, a server or a worker, in an order and at
    # moments drawn from the seed), and the last run must end where an uninterrupted run does.
    rng = random.Random(seed)
    ckpt = tmp_path / "ckpt"
    args = ["dist_sync", str(STEPS), f"ckpt={ckpt}"]
    targets = ["launcher", "scheduler", "server", "worker"]
    rng.shuffle(targets)
    step = 0
    for target in targets:
        seconds, saved = kill_one(args, ckpt, target, rng, start=step)
        print(f"{target} killed after step {saved}: every process gone in {seconds:.2f} s")
        step = saved
    resumed = run_job(JOBS / "train_parity.py", workers=2, servers=1, args=args, timeout_s=120)
    for rank in range(2):
        lines = resumed.lines("worker", rank)
        assert f"trained steps {step}..{STEPS}" in lines, lines
        assert any(line.startswith("parity ok") for line in lines), resumed.stdout


# ---- the scheduler: who is named when something goes wrong --------------------------------------
FAST = "paratrain.JobConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0)"


def first_line(outcome) -> str:  # noqa: ANN001
    return outcome.report.splitlines()[0]


def test_a_refused_node_with_the_secret_does_not_abort_a_running_job():
    # A stray process that holds the secret registers as a rank that is taken, then as one that
    # does not exist: each is refused and named, and the job goes on.
    outcome = run_job(
        f"""
        import paratrain
        from paratrain.errors import RemoteError
        from paratrain.transport.client import RpcClient
        ctx = paratrain.init({FAST})
        ctx.barrier(name="running")
        if ctx.rank == 0:
            spec = ctx.spec
            stray = RpcClient(spec.scheduler_host, spec.scheduler_port, spec.secret)
            for rank in (1, 7):
                meta = {{"role": "worker", "rank": rank, "host": "127.0.0.1", "port": 0, "pid": 4242,
                         "version": paratrain.__version__, "config": ctx.config.as_dict(),
                         "config_digest": ctx.config.digest()}}
                try:
                    stray.call("register", meta, timeout_s=30)
                    print("accepted", rank)
                except RemoteError as exc:
                    print("refused", rank)
            stray.close()
        ctx.barrier(name="after")
        print("done")
        """,
        workers=2,
        servers=1,
    )
    assert outcome.lines("worker", 0, "stdout") == ["refused 1", "refused 7", "done"]
    assert outcome.lines("worker", 1, "stdout") == ["done"]
    log = "\n".join(outcome.lines("scheduler", 0, "stderr"))
    assert "refused a registration from 127.0.0.1:" in log
    assert "worker 1 (host 127.0.0.1, pid 4242): worker 1 is already registered" in log
    assert "rank 7 is outside 0..1 for 2 workers" in log


def test_a_frozen_node_is_the_first_thing_the_report_names():
    # SIGSTOP keeps the process and its sockets alive: only missing heartbeats can reveal it, and
    # the others exit 75 (aborted) while it never exits, yet the report's first line names it.
    outcome = run_job(
        f"""
        import os, signal, time, paratrain
        ctx = paratrain.init({FAST})
        if ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        ctx.barrier()
        time.sleep(120)
        """,
        workers=2,
        servers=1,
        expect="failure",
        stop_grace_s=2.0,
    )
    assert first_line(outcome).startswith("paratrain: job failed: worker 1 (pid "), outcome.report
    assert "sent no heartbeat for" in first_line(outcome), outcome.report
    assert "worker 1 (host 127.0.0.1" in outcome.report and "last heard at" in outcome.report


def test_the_start_timeout_names_who_is_missing_and_what_was_refused():
    # Worker 1 has the wrong secret (as a node of another job or a misconfigured host would): it is
    # refused and never registers. The job ends at the start timeout naming it and the refusal.
    outcome = run_job(
        """
        import os, time, paratrain
        from paratrain.cluster.spec import spec_from_env
        from paratrain.errors import AuthenticationError
        from paratrain.transport.client import RpcClient
        spec = spec_from_env()
        if spec.role == "worker" and spec.rank == 1:
            try:
                RpcClient(spec.scheduler_host, spec.scheduler_port, b"w" * 32)
            except AuthenticationError as exc:
                print("refused:", exc)
            time.sleep(120)
        paratrain.init(paratrain.JobConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0,
                                           start_timeout_s=3.0))
        """,
        workers=2,
        servers=1,
        expect="failure",
        stop_grace_s=2.0,
    )
    line = first_line(outcome)
    assert line.startswith("paratrain: job failed: worker 1 (pid "), outcome.report
    assert "worker 1 did not register within 3.0 s; refused meanwhile: 127.0.0.1:" in line, line
    assert "(client does not hold the job secret" in line, line  # with its troubleshooting link
    reason = [s for s in outcome.lines("worker", 0, "stderr") if "aborted the job" in s]
    assert reason and "worker 1 did not register" in reason[0], outcome.stderr


def test_a_server_that_dies_under_dist_async_is_named_not_the_worker_that_lost_it(tmp_path):
    # The server's serving side dies while its link to the scheduler lives on, so the workers see
    # it gone before the scheduler could: the reason every process prints must still name it.
    marker = tmp_path / "pushing"
    outcome = run_job(
        f"""
        import gc, os, threading, time, torch, paratrain, paratrain.kvstore
        from paratrain.errors import KVStoreError
        from paratrain.transport.rpc import RpcServer
        if os.environ["PARATRAIN_ROLE"] == "server":
            def crash():
                while not os.path.exists({str(marker)!r}):
                    time.sleep(0.01)
                for server in [o for o in gc.get_objects() if isinstance(o, RpcServer)]:
                    server.close()
            threading.Thread(target=crash, daemon=True).start()
        ctx = paratrain.init({FAST})
        kv = paratrain.kvstore.create("dist_async")
        kv.init(["w"], [torch.zeros(100)])
        kv.barrier()
        if ctx.rank == 0:
            open({str(marker)!r}, "w").close()
        try:
            while True:
                kv.push(["w"], [torch.ones(100)]).wait()
        except KVStoreError as exc:
            print("lost the server")
        time.sleep(120)  # the scheduler's abort ends us
        """,
        workers=2,
        servers=1,
        expect="failure",
        stop_grace_s=2.0,
    )
    line = first_line(outcome)
    assert line.startswith("paratrain: job failed: server 0 (pid "), outcome.report
    assert "server 0 (host 127.0.0.1, pid" in line and "is unreachable: worker" in line, line
    for rank in range(2):
        reason = [s for s in outcome.lines("worker", rank, "stderr") if "aborted the job" in s]
        assert reason and reason[0].split("aborted the job: ")[1].startswith("server 0"), outcome.stderr
