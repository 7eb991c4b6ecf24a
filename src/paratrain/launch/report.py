"""How a job ended, described: the records of its processes and the text of its report.

The engines that supervise processes themselves (local, ray) hand their exits here. This module names exit
codes and signals, picks the first failure that is a cause (an exit with EXIT_ABORTED is a
consequence of another node's failure) and writes the report printed about a failure or interruption.
It starts, waits for and stops nothing.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from paratrain.cluster.spec import EXIT_ABORTED
from paratrain.launch.lines import Fold, unprefixed


@dataclass(frozen=True)
class ChildFailure:
    """The process the launcher blames for a failed job, and why."""

    role: str
    rank: int
    pid: int
    host: str
    returncode: int | None
    """The exit code (negative: killed by a signal); None if it was still running."""
    signal: str | None
    """The name of the signal that killed it (e.g. SIGKILL), or None."""
    reason: str
    """What happened, e.g. "exited with code 3" or "was killed by signal SIGKILL"."""
    stderr_tail: list[str]
    """Its last stderr lines (at most STDERR_TAIL_LINES)."""

    def describe(self) -> str:
        return f"{self.role} {self.rank} (pid {self.pid}, host {self.host}) {self.reason}"


@dataclass(frozen=True)
class ChildRecord:
    """One process of a finished job."""

    role: str
    rank: int
    pid: int
    returncode: int | None
    """Its exit code (negative: killed by that signal); None only if it could not be reaped."""


@dataclass
class JobResult:
    """How a job ended."""

    exit_code: int
    """0 if every worker succeeded and the rest exited cleanly; 128 + the signal's number if
    interrupted (130 for SIGINT, 143 for SIGTERM, as a shell reports a process they ended);
    otherwise 1."""
    failure: ChildFailure | None
    report: str
    """The text printed about the failure or interruption; "" on success."""
    children: list[ChildRecord]
    scheduler_address: str = ""
    """host:port the scheduler listened on."""

    @property
    def pids(self) -> list[int]:
        return [child.pid for child in self.children]


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _exit_reason(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by signal {_signal_name(-returncode)}"
    if returncode == EXIT_ABORTED:
        return f"exited with code {returncode} (aborted because another process failed)"
    return f"exited with code {returncode}"


def _first_failure(failed: Sequence[Any]) -> Any:
    """The earliest failed exit that is a cause. An exit with an error comes before an early clean
    exit (code 0), which comes before EXIT_ABORTED (a consequence of another node's failure). A
    worker that ends with `sys.exit(3)` has already told the scheduler it finished (exit hooks cannot
    see the status), so the scheduler may exit 0, early, before that worker's exit is seen."""
    return min(
        failed, key=lambda child: (child.returncode == EXIT_ABORTED, child.returncode == 0, child.exit_time)
    )


_ABORT_REASON = re.compile(r"paratrain: (?:job aborted|\w+ stopping: the scheduler aborted the job): (.+)$")
_NAMED = re.compile(r"^(scheduler|server|worker) (\d+)\b")


def _named_by_scheduler(children: Sequence[Any]) -> tuple[Any, str] | None:
    """When every failed exit was EXIT_ABORTED, the cause may not have exited at all (a frozen
    node) or exited later: the scheduler's abort reason, which it and every aborted node print,
    names it. Returns that child and the reason, or None."""
    for child in children:
        for line in child.stderr_tail:
            found = _ABORT_REASON.search(line)
            named = _NAMED.match(found[1]) if found else None
            if found is None or named is None:
                continue
            for cause in children:
                if (cause.role, cause.rank) == (named[1], int(named[2])):
                    return cause, f"was named by the scheduler: {found[1]}"
    return None


def blame(
    outcome: str,
    failed: Sequence[Any],
    still_running: Sequence[Any],
    children: Sequence[Any],
    timeout_s: float | None,
    exit_grace_s: float,
) -> ChildFailure:
    """The process a supervising engine (local, ray) blames for an outcome other than ok or
    interrupted. "failed": the first failed exit that is a cause (`_first_failure`), or, when every
    exit was EXIT_ABORTED, the process the scheduler's abort reason names. "timeout": a worker still
    running (they are what the job waits for), else any. "grace": the first process that did not exit
    after every worker finished. Each child has role, rank, returncode, failure_reason, stderr_tail
    and `failure(reason)`."""
    if outcome == "failed":
        child = _first_failure(failed)
        named = _named_by_scheduler(children) if child.returncode == EXIT_ABORTED else None
        if named is not None:  # every exit was a consequence: the scheduler knows the cause
            return named[0].failure(named[1])
        assert child.failure_reason is not None
        return child.failure(child.failure_reason)
    left = still_running or children
    if outcome == "timeout":
        workers = [c for c in left if c.role == "worker"]
        reason = f"was still running when the job timed out after {timeout_s} s"
        return (workers or left)[0].failure(reason)
    reason = f"did not exit within {exit_grace_s} s after every worker finished"
    return left[0].failure(reason)


def workers_running(children: Sequence[Any]) -> bool:
    return any(c.running for c in children if c.role == "worker")


def early_exit_deadline(early: Sequence[Any], exit_grace_s: float) -> float | None:
    """When a scheduler or server that exited 0 while workers still ran (`early`) fails the job:
    unless the workers too exit 0 within exit_grace_s, as a worker may tell the scheduler it is done
    and still be tearing down when the scheduler exits. None while no such exit happened."""
    times = [c.exit_time for c in early if c.exit_time is not None]
    return min(times) + exit_grace_s if times else None


def earliest(*deadlines: float | None) -> float | None:
    return min((d for d in deadlines if d is not None), default=None)


def no_exit_outcome(early: Sequence[Any], failed: list, early_end: float | None) -> str:
    """A supervisor's wait for the next exit ended with none: "failed" once the early exits
    (early_exit_deadline) outlived their grace (they join `failed`), else "timeout"."""
    if early_end is not None and time.monotonic() >= early_end:
        failed.extend(early)
        return "failed"
    return "timeout"


def only_replacements_left(children: Sequence[Any]) -> bool:
    """In an elastic job: the scheduler ended the job (it exited 0) and every worker still running
    is a replacement (one that had joined would have kept the scheduler going), which finds the
    scheduler gone and exits by itself."""
    done = any(c.role == "scheduler" and c.returncode == 0 for c in children)
    running = [c for c in children if c.role == "worker" and c.running]
    return done and all(c.replacement for c in running)


def interrupted_exit_code(signum: int | None) -> int:
    """The launcher's exit status after SIGINT or SIGTERM: 128 + the signal's number, the status a
    shell gives a process that signal ended (so a batch system sees which one it was)."""
    return 128 + (signum or signal.SIGINT)


def _interrupted_report(signum: int | None) -> str:
    name = _signal_name(signum) if signum else "a signal"
    return f"paratrain: interrupted by {name}; stopped every process of the job\n"


_EXCEPTION = re.compile(r"^(?!paratrain: )[A-Za-z_][\w.]*(?:: |$)")  # not paratrain's own notices


def _exception_line(tail: Sequence[str]) -> str | None:
    """The exception that ended the last traceback in a stderr tail ("ValueError: ..."), or None:
    the last unindented line, in the form of an exception, right after an indented frame line
    (torch.distributed's "[rankN]: " before each line does not count)."""
    tail = [unprefixed(line) for line in tail]
    for i in range(len(tail) - 1, 0, -1):
        if tail[i - 1].startswith("  ") and _EXCEPTION.match(tail[i]):
            return tail[i]
    return None


def _failure_report(failure: ChildFailure, failed: Sequence[Any], still_running: Sequence[Any]) -> str:
    """The report of a failed job: who failed and why first (a Python exception as its one line:
    its traceback was printed above), then the others. `failed` holds the children whose exit
    failed the job and `still_running` those the launcher had to stop (each with role, rank,
    label, pid and failure_reason)."""
    lines = [f"paratrain: job failed: {failure.describe()}"]
    raised = failure.returncode is not None and failure.returncode > 0 and failure.returncode != EXIT_ABORTED
    cause = _exception_line(failure.stderr_tail) if raised else None
    if cause is not None:
        lines.append(f"  {cause}")
    if still_running and not failed:
        stopped = ", ".join(f"{c.label} (pid {c.pid})" for c in still_running)
        lines.append(f"  still running, stopped by the launcher: {stopped}")
    others = [c for c in failed if (c.role, c.rank) != (failure.role, failure.rank)]
    for child in others:
        if child.returncode != EXIT_ABORTED:
            lines.append(f"  also: {child.label} (pid {child.pid}) {child.failure_reason}")
    aborted = ", ".join(f"{c.label} (pid {c.pid})" for c in others if c.returncode == EXIT_ABORTED)
    if aborted:
        lines.append(f"  also stopped, as the job was aborted (exit code {EXIT_ABORTED}): {aborted}")
    label = f"{failure.role} {failure.rank}"
    if cause is None and failure.stderr_tail:
        lines.append(f"  last {len(failure.stderr_tail)} stderr lines of {label}:")
        lines.extend(f"    {line}" for line in failure.stderr_tail)
    elif cause is None:
        lines.append(f"  {label} wrote nothing to stderr")
    return "\n".join(lines) + "\n"


class Printer:
    """Writes whole lines to a launcher's streams; one lock so lines never interleave. With `fold`,
    the children's abort notices and repeated tracebacks are left out (lines.py)."""

    def __init__(self, out: IO[str], err: IO[str], fold: bool = False) -> None:
        self.out = out
        self.err = err
        self.fold = Fold() if fold else None
        self._lock = threading.Lock()

    def write(self, stream: IO[str], text: str) -> None:
        with self._lock:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):
                pass  # a closed or broken stream must not stop the job's supervision


def write_outcome(printer: Printer, result: JobResult, num_workers: int, started: float) -> None:
    """The launcher's last words: the report of a failure or interruption, else how long it took."""
    if result.report:
        printer.write(printer.err, result.report)
    elif result.exit_code == 0:
        elapsed = time.monotonic() - started
        printer.write(
            printer.err, f"paratrain: job finished: {num_workers} worker(s) succeeded in {elapsed:.1f} s\n"
        )
