"""One role process of a Ray job, started and watched on its node by a Ray actor (see driver.py).

`RoleProcess` is a plain class: driver.py wraps it with `ray.remote`, so it runs inside a Ray actor on
the node its placement-group bundle landed on, and tests can use it without Ray. The driver calls:

    where()               this node's address and Ray node id
    listen(host)          (the scheduler's actor only) a listening socket, handed to the child
    start(cmd, env, cwd)  starts the script as a real OS process in its own session; returns its pid
    start_here(cmd, env, cwd)   the same with PARATRAIN_HOST = this node's address (a replacement of
                          a dead worker, whose node the driver learns only now); returns where() + pid
    poll(wait_s)          the output lines since the last poll, and the exit code once it exited
    signal(signum)        a signal to the child's process group
    close()               SIGKILL to what is left, and the listener closed

The child's output comes back through poll and not through Ray's log forwarding: the driver
prefixes each line with role, rank and node, keeps the stderr tail for its report, and learns the
exit only after the last line. Each child is started through a small exec wrapper that asks the
kernel to SIGKILL it when the thread that started it ends (PR_SET_PDEATHSIG), and it gets
PARATRAIN_LAUNCHER_PID = the actor's pid: if the actor dies with its node, or is killed, the child
goes too. The wrapper replaces a `preexec_fn`, which would make subprocess fork a process full of
Ray's gRPC threads.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from typing import IO, Any

from paratrain.launch.children import OUTPUT_JOIN_S, join_all

# Lines kept for the driver between two polls; beyond that the oldest are dropped (and counted),
# so a child that floods its output cannot fill the actor's memory while the driver is away.
MAX_BUFFERED_LINES = 10_000
MAX_LINES_PER_POLL = 2_000

# Runs in the child before the script: dies with the starting thread, then becomes the script.
_WRAPPER = (
    "import ctypes, os, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('paratrain: the Ray actor that started this process is gone')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class RoleProcess:
    """Starts one role process on this node and keeps its output until the driver polls it."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._lines: deque[tuple[int, str]] = deque()
        self._dropped = 0
        self._returncode: int | None = None
        self._exited_at: float | None = None
        self._finished = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._listener: socket.socket | None = None

    def where(self) -> dict[str, Any]:
        """This node: its address (what the processes bind and advertise) and Ray node id."""
        import ray  # only inside an actor

        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }

    def listen(self, host: str) -> int:
        """Opens the scheduler's listening socket on `host` and returns its port. The child gets it
        already listening (PARATRAIN_SCHEDULER_FD), so no port is raced for."""
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        self._listener = socket.create_server((host, 0), family=family, backlog=128)
        return int(self._listener.getsockname()[1])

    def start(self, cmd: list[str | None], env: dict[str, str], cwd: str | None = None) -> int:
        """Starts `cmd` (cmd[0] None: this node's Python) with this node's environment, less every
        PARATRAIN_* variable, plus `env`. Returns the child's pid. Once the last child has exited
        (and its exit was polled), another may be started: an elastic job's replacement."""
        with self._lock:
            if self._proc is not None and not self._finished:
                raise RuntimeError(f"pid {self._proc.pid} still runs: one process at a time")
            self._returncode, self._exited_at, self._finished = None, None, False
        argv = [sys.executable if part is None else part for part in cmd]
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("PARATRAIN_")}
        child_env.update(env)
        child_env["PARATRAIN_LAUNCHER_PID"] = str(os.getpid())
        pass_fds: tuple[int, ...] = ()
        if self._listener is not None:
            pass_fds = (self._listener.fileno(),)
            child_env["PARATRAIN_SCHEDULER_FD"] = str(self._listener.fileno())
        if cwd is not None and not os.path.isdir(cwd):
            cwd = None  # the driver's directory does not exist here: start where the actor runs
        wrapper = [sys.executable, "-c", _WRAPPER, str(os.getpid())]
        started: list[Any] = []
        ready = threading.Event()
        keeper = threading.Thread(
            target=self._keep, args=(wrapper + argv, child_env, cwd, pass_fds, started, ready), daemon=True
        )
        keeper.start()
        ready.wait()
        if isinstance(started[0], BaseException):
            raise started[0]
        if self._listener is not None:
            self._listener.close()  # the child holds it now; nothing of ours keeps the port
            self._listener = None
        return int(started[0])

    def start_here(
        self, cmd: list[str | None], env: dict[str, str], cwd: str | None = None
    ) -> dict[str, Any]:
        """start() on whatever node this actor runs, with PARATRAIN_HOST = that node's address.
        Returns where() with the child's pid."""
        where = self.where()
        return {**where, "pid": self.start(cmd, {**env, "PARATRAIN_HOST": where["ip"]}, cwd)}

    def _keep(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str | None,
        pass_fds: tuple[int, ...],
        started: list[Any],
        ready: threading.Event,
    ) -> None:
        """Starts the child and lives exactly as long as it does (PR_SET_PDEATHSIG is per thread)."""
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                pass_fds=pass_fds,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: a signal reaches its children too
            )
        except BaseException as exc:  # noqa: BLE001 -- handed to start(), which raises it
            started.append(exc)
            ready.set()
            return
        self._proc = proc
        started.append(proc.pid)
        ready.set()
        assert proc.stdout is not None and proc.stderr is not None
        pumps = [
            threading.Thread(target=self._pump, args=(proc.stdout, 1), daemon=True),
            threading.Thread(target=self._pump, args=(proc.stderr, 2), daemon=True),
        ]
        for pump in pumps:
            pump.start()
        returncode = proc.wait()
        exited_at = time.time()
        if not join_all(pumps, OUTPUT_JOIN_S):  # a descendant still holds the pipes
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            join_all(pumps, OUTPUT_JOIN_S)
        with self._lock:
            self._returncode, self._exited_at = returncode, exited_at
            self._finished = True
            self._lock.notify_all()

    def _pump(self, pipe: IO[bytes], stream: int) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                with self._lock:
                    if len(self._lines) >= MAX_BUFFERED_LINES:
                        self._lines.popleft()
                        self._dropped += 1
                    self._lines.append((stream, line))
                    self._lock.notify_all()

    def poll(self, wait_s: float) -> dict[str, Any]:
        """Waits up to `wait_s` for output or the exit. Returns {"lines": [(1|2, text), ...],
        "dropped": lines lost since the last poll, "returncode": None while it runs, "exited_at":
        the time.time() of the exit}; the exit comes only with the last of the output."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while not self._lines and not self._finished:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            count = min(len(self._lines), MAX_LINES_PER_POLL)
            lines = [self._lines.popleft() for _ in range(count)]
            dropped, self._dropped = self._dropped, 0
            done = self._finished and not self._lines
            return {
                "lines": lines,
                "dropped": dropped,
                "returncode": self._returncode if done else None,
                "exited_at": self._exited_at if done else None,
            }

    def signal(self, signum: int) -> None:
        """Sends `signum` to the child's process group (nothing if it already exited)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signum)

    def close(self) -> None:
        """SIGKILL to whatever of the child is left, and the listener closed."""
        self.signal(signal.SIGKILL)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
