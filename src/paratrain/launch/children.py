"""The local launcher's children: one process of a job, the threads that carry its output to the
launcher's terminal, and the events its main loop reacts to (an exit, an interrupt)."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from paratrain.launch.report import ChildFailure, ChildRecord, Printer, _signal_name

STDERR_TAIL_LINES = 30
OUTPUT_JOIN_S = 5.0


@dataclass(frozen=True)
class Exit:
    child: Child
    returncode: int
    time: float


@dataclass(frozen=True)
class Interrupt:
    signum: int


class Child:
    """One process of the job: its Popen, its output threads and its exit."""

    def __init__(self, role: str, rank: int, host: str) -> None:
        self.role = role
        self.rank = rank
        self.host = host
        self.label = f"{role} {rank}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self.returncode: int | None = None
        self.exit_time: float | None = None
        self.failure_reason: str | None = None
        self.replacement = False
        """Started in place of a dead worker (elastic jobs): it may not have joined yet."""
        self.pumps: list[threading.Thread] = []

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        """Running as far as the main loop knows: its exit has not been processed yet."""
        return self.returncode is None

    def start(
        self,
        cmd: list[str],
        env: dict[str, str],
        pass_fds: Sequence[int],
        printer: Printer,
        events: queue.SimpleQueue[Any],
    ) -> None:
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            pass_fds=tuple(pass_fds),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: our signals reach its children too
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.pumps = [
            start_thread(pump, self.proc.stdout, self.label, printer.out, printer, None),
            start_thread(pump, self.proc.stderr, self.label, printer.err, printer, self.stderr_tail),
        ]
        start_thread(self._wait, events)

    def _wait(self, events: queue.SimpleQueue[Any]) -> None:
        assert self.proc is not None
        returncode = self.proc.wait()
        events.put(Exit(self, returncode, time.monotonic()))

    def signal(self, signum: int) -> None:
        if self.proc is None or not self.running:
            return
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # already gone; its exit is on its way through the queue

    def join_output(self) -> None:
        """Waits for its pipes to close; kills its process group if a descendant holds them."""
        if not join_all(self.pumps, OUTPUT_JOIN_S) and self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            join_all(self.pumps, OUTPUT_JOIN_S)

    def record(self) -> ChildRecord:
        return ChildRecord(self.role, self.rank, self.pid, self.returncode)

    def failure(self, reason: str) -> ChildFailure:
        rc = self.returncode
        signame = _signal_name(-rc) if rc is not None and rc < 0 else None
        tail = list(self.stderr_tail)
        return ChildFailure(self.role, self.rank, self.pid, self.host, rc, signame, reason, tail)


def start_thread(target: Any, *args: Any) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def join_all(threads: list[threading.Thread], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)


def pump(pipe: IO[bytes], label: str, stream: IO[str], printer: Printer, tail: deque[str] | None) -> None:
    shown = printer.fold.lines(label) if printer.fold is not None else None
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if tail is not None:
                tail.append(line)
            for text in [line] if shown is None else shown.feed(line):
                printer.write(stream, f"[{label}] {text}\n")
        for text in [] if shown is None else shown.close():
            printer.write(stream, f"[{label}] {text}\n")
