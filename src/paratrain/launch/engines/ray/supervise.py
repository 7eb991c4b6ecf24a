"""The driver's side of a Ray job once its processes run: their output, their exits, the stop.

`Supervisor` holds the job's `RayChild`ren (one per process, each with its actor and node) and
long-polls their actors (`ray.wait` on the pending polls, one thread): it prints each line prefixed
`[role rank @node] `, keeps the stderr tail, and ends the job as the local engine does
(launch/engines/local/job.py is the model): success when every worker exits 0 and then the scheduler and
servers by themselves; the first failure, a process lost with its node included, stops everything
(SIGTERM to each process group through its actor, then SIGKILL), and report.py's report names
role, rank, node and cause. In an elastic job (`Restarts`, restarts.py) a worker that dies or is
lost with its node does not stop the job; while restarts are left the driver starts it again
(`restart`, given by driver.py) and waits for that start alongside the polls. SIGINT and SIGTERM to
the driver are counted by `Interrupts`, which every wait checks at least every POLL_S. driver.py
starts the processes and builds the result.
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from paratrain.cluster.spec import EXIT_ABORTED
from paratrain.launch.children import STDERR_TAIL_LINES
from paratrain.launch.engines.ray.placement import NodeInfo
from paratrain.launch.lines import ChildLines
from paratrain.launch.report import (
    ChildFailure,
    ChildRecord,
    Printer,
    _exit_reason,
    _signal_name,
    blame,
    earliest,
    early_exit_deadline,
    no_exit_outcome,
    only_replacements_left,
    workers_running,
)
from paratrain.launch.restarts import Restarts

POLL_S = 0.5
"""How long one ray.wait (and one actor poll) lasts: the driver notices an interrupt this fast."""
_KILL_WAIT_S = 30.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Interrupts:
    """SIGINT and SIGTERM as the driver got them; a wait gives way to each one once."""

    def __init__(self) -> None:
        self.first: int | None = None
        """The first signal the driver got, for the report."""
        self.count = 0
        self.seen = 0
        """How many the waits have given way to; a wait returns early while count exceeds it."""

    @property
    def pending(self) -> bool:
        return self.count > self.seen

    def note(self, signum: int, frame: Any = None) -> None:
        self.first = self.first or signum
        self.count += 1

    @contextlib.contextmanager
    def handled(self) -> Iterator[None]:
        """SIGINT/SIGTERM are noted here while inside (only possible in the main thread; elsewhere
        the job cannot be interrupted but by its timeout)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signums = (signal.SIGINT, signal.SIGTERM)
        previous = {signum: signal.getsignal(signum) for signum in signums}
        for signum in signums:
            signal.signal(signum, self.note)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


class RayChild:
    """One process of the job as the driver sees it: its actor, its node and its exit."""

    def __init__(self, role: str, rank: int, actor: Any) -> None:
        self.role = role
        self.rank = rank
        self.label = f"{role} {rank}"
        self.actor = actor
        self.node = NodeInfo(ip="?", node_id="?")
        self.node_label = "?"
        self.pid = 0
        self.poll_ref: Any = None
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self.ended = False
        self.returncode: int | None = None
        self.lost: str | None = None
        """Why its actor is gone (its node died, or Ray lost it); None while it answers."""
        self.exit_time: float | None = None
        self.failure_reason: str | None = None
        self.shown: dict[int, ChildLines] = {}
        """Per stream (1, 2), what of its lines the terminal sees when the printer folds them."""
        self.replacement = False
        """Started in place of a dead worker (elastic jobs): it may not have joined yet."""
        self.start_ref: Any = None
        """A replacement's pending start (RoleProcess.start_here); None once it runs."""
        self.start_deadline = 0.0

    @property
    def running(self) -> bool:
        """Running as far as the driver knows: its exit (or loss) has not been processed yet."""
        return not self.ended

    @property
    def prefix(self) -> str:
        return f"[{self.label} @{self.node_label}] "

    def signal(self, signum: int) -> None:
        if self.running:
            self.actor.signal.remote(signum)

    def record(self) -> ChildRecord:
        return ChildRecord(self.role, self.rank, self.pid, self.returncode)

    def failure(self, reason: str) -> ChildFailure:
        rc = self.returncode
        signame = _signal_name(-rc) if rc is not None and rc < 0 else None
        host = self.node_label
        return ChildFailure(self.role, self.rank, self.pid, host, rc, signame, reason, list(self.stderr_tail))


class Supervisor:
    """The loop that reacts to the exits of a job's processes, and stops them."""

    def __init__(
        self,
        printer: Printer,
        interrupts: Interrupts,
        stop_grace_s: float,
        exit_grace_s: float,
        timeout_s: float | None,
        restarts: Restarts | None = None,
    ) -> None:
        self.printer = printer
        self.restarts = restarts or Restarts()
        self.ending = False
        """Elastic: the job is done while replacements that never joined still run; they exit."""
        self.stopping = False
        self.interrupts = interrupts
        self.stop_grace_s = stop_grace_s
        self.exit_grace_s = exit_grace_s
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.children: list[RayChild] = []
        self.failed: list[RayChild] = []
        """Children whose exit (before we began stopping) failed the job."""
        self.early: list[RayChild] = []
        """Schedulers and servers that exited 0 while workers were still running."""
        self.still_running: list[RayChild] = []
        """Children that had to be stopped."""

    def supervise(self) -> str:
        """Waits for the job to end; returns ok, failed, timeout, grace or interrupted."""
        while self._workers_running():
            early_end = self._early_exit_deadline()
            ended = self._next_exits(earliest(self.deadline, early_end))
            if self.interrupts.pending:
                return "interrupted"
            if ended is None:
                return no_exit_outcome(self.early, self.failed, early_end)
            for child in ended:
                if not self._record(child):
                    return self._after_failure()
        self.early.clear()  # they only left a little before the last worker: no harm done
        return self._await_rest()

    def _workers_running(self) -> bool:
        return workers_running(self.children)

    def _early_exit_deadline(self) -> float | None:
        return early_exit_deadline(self.early, self.exit_grace_s)

    def _await_rest(self) -> str:
        """Every worker exited 0: the scheduler and servers now exit by themselves."""
        grace_end = time.monotonic() + self.exit_grace_s
        deadline = grace_end if self.deadline is None else min(grace_end, self.deadline)
        while any(c.running for c in self.children):
            ended = self._next_exits(deadline)
            if self.interrupts.pending:
                return "interrupted"
            if ended is None:
                return "grace" if deadline == grace_end else "timeout"
            for child in ended:
                if not self._record(child):
                    return self._after_failure()
        return "ok"

    def _after_failure(self) -> str:
        """After an EXIT_ABORTED exit the real cause may still be on its way: give the others
        stop_grace_s to exit by themselves before stopping them."""
        end = time.monotonic() + self.stop_grace_s
        while all(c.returncode == EXIT_ABORTED for c in self.failed) and self._any_running():
            ended = self._next_exits(end)
            if self.interrupts.pending:
                return "interrupted"
            if ended is None:
                break
            for child in ended:
                self._record(child)
        return "failed"

    def _any_running(self) -> bool:
        return any(c.running for c in self.children)

    def _next_exits(self, deadline: float | None) -> list[RayChild] | None:
        """Prints the output that came in; returns the children that ended meanwhile (maybe
        none), or None once the deadline has passed. Returns early on an interrupt."""
        import ray

        while not self.interrupts.pending:
            wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if wait <= 0:
                return None
            expired = self._expired_starts()
            if expired:
                return expired
            by_ref = {}  # a running child has a poll in flight, or a replacement its start
            for c in self.children:
                ref = c.poll_ref if c.poll_ref is not None else c.start_ref
                if c.running and ref is not None:
                    by_ref[ref] = c
            if not by_ref:
                return []
            ready, rest = ray.wait(list(by_ref), num_returns=1, timeout=wait)
            if ready and rest:
                more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
                ready += more
            ended = [child for child in (by_ref[ref] for ref in ready) if self._take(child)]
            if ended:
                return ended
        return []

    def _take(self, child: RayChild) -> bool:
        """Prints one finished poll's output and asks for the next; True if the child ended."""
        import ray

        if child.start_ref is not None:
            return self._take_start(child)
        try:
            reply = ray.get(child.poll_ref)
        except ray.exceptions.RayError as exc:
            child.lost = _lost_reason(child, exc)
            child.ended, child.exit_time, child.poll_ref = True, time.monotonic(), None
            for stream in (1, 2):
                self._show(child, stream, None)
            return True
        ended = reply["returncode"] is not None
        for stream, line in reply["lines"]:
            if stream == 2:
                child.stderr_tail.append(line)
            self._show(child, stream, line)
        for stream in (1, 2) if ended else ():
            self._show(child, stream, None)
        if reply["dropped"]:
            self.printer.write(self.printer.err, f"{child.prefix}({reply['dropped']} lines dropped)\n")
        if reply["returncode"] is None:
            child.poll_ref = child.actor.poll.remote(POLL_S)
            return False
        child.returncode, child.poll_ref = reply["returncode"], None
        # When it exited, on the driver's clock: the first failure is the first to exit, not the
        # first whose news came in (several exits often arrive in one batch).
        ago = max(0.0, time.time() - reply["exited_at"])
        child.ended, child.exit_time = True, time.monotonic() - ago
        return True

    def _take_start(self, child: RayChild) -> bool:
        """A replacement's start finished: it runs (then poll it), or it could not start (ended)."""
        import ray

        try:
            where = ray.get(child.start_ref)
        except ray.exceptions.RayError as exc:
            child.lost = f"could not be started again: {first_line(exc)}"
            child.start_ref, child.ended, child.exit_time = None, True, time.monotonic()
            return True
        child.start_ref = None
        self.started(child, where)
        child.poll_ref = child.actor.poll.remote(POLL_S)
        if self.stopping:  # it came up after the others were told to stop
            child.signal(signal.SIGKILL)
        return False

    def _expired_starts(self) -> list[RayChild]:
        """Replacements whose start took longer than allowed (their node gone, the cluster full):
        lost, as a death (the driver's release kills their actors)."""
        now, expired = time.monotonic(), []
        for child in self.children:
            if child.running and child.start_ref is not None and now > child.start_deadline:
                child.lost = "was not started again: Ray placed no actor for it in time"
                child.start_ref, child.ended, child.exit_time = None, True, now
                expired.append(child)
        return expired

    # -- elastic jobs (restarts.py)

    def restart(self, dead: RayChild) -> None:
        """Starts a replacement of `dead`: a new RayChild in self.children whose start_ref is set."""
        raise NotImplementedError

    def started(self, child: RayChild, where: dict[str, Any]) -> None:
        """Notes where a replacement runs (RoleProcess.start_here's reply)."""
        raise NotImplementedError

    def _lost(self, child: RayChild) -> None:
        """A worker of an elastic job died: the scheduler drops it; restart it while restarts last."""
        reason = child.lost or _exit_reason(child.returncode or 0)
        again, line = self.restarts.take(f"{child.label} (pid {child.pid}, host {child.node_label}) {reason}")
        self.printer.write(self.printer.err, line)
        if again:
            self.restart(child)

    def _only_replacements_left(self) -> bool:
        return self.restarts.on and not self.ending and only_replacements_left(self.children)

    def _show(self, child: RayChild, stream: int, line: str | None) -> None:
        """Prints one line of a child (None: its output ended), folded if the printer folds."""
        stream_out = self.printer.out if stream == 1 else self.printer.err
        fold = self.printer.fold
        if fold is None:
            texts = [] if line is None else [line]
        else:
            shown = child.shown.setdefault(stream, fold.lines(child.label))
            texts = shown.close() if line is None else shown.feed(line)
        for text in texts:
            self.printer.write(stream_out, f"{child.prefix}{text}\n")

    def _record(self, child: RayChild) -> bool:
        """Notes one exit or loss (before stopping began); returns False if it fails the job."""
        if child.role == "worker" and (
            self.restarts.is_death(child.role, child.returncode, child.lost is not None)
            or (self.ending and self.restarts.on)
        ):
            if not self.ending and not self.failed:  # not while the job is failing anyway
                self._lost(child)
            return True
        if child.lost is not None or child.returncode != 0:
            child.failure_reason = child.lost or _exit_reason(child.returncode or 0)
            self.failed.append(child)
            self.failed.extend(self.early)  # an earlier clean exit may be the cause of this one
            self.early.clear()
            return False
        if child.role != "worker" and self._workers_running() and not self.ending:
            child.failure_reason = "exited early (code 0) before every worker finished"
            self.early.append(child)
        if self._only_replacements_left():
            self.ending = True
            self.early.clear()
        return True

    # -- stopping

    def stop(self) -> None:
        """SIGTERM to every running process group, SIGKILL after stop_grace_s; waits for the exits."""
        self.stopping = True
        self.still_running = [c for c in self.children if c.running and c.poll_ref is not None]
        if not self.still_running:
            return
        for child in self.still_running:
            child.signal(signal.SIGTERM)
        if self._drain(time.monotonic() + self.stop_grace_s, interruptible=True):
            return
        for child in self.children:
            child.signal(signal.SIGKILL)
        if not self._drain(time.monotonic() + _KILL_WAIT_S, interruptible=False):
            left = ", ".join(f"{c.label} (pid {c.pid} @{c.node_label})" for c in self.children if c.running)
            self.printer.write(self.printer.err, f"paratrain: could not reap {left}\n")

    def _drain(self, deadline: float, interruptible: bool) -> bool:
        """Takes exits until every started process exited (True) or the deadline (False). A new
        interrupt while stopping skips the rest of the grace period (when interruptible)."""
        seen = self.interrupts.count
        while any(c.running and c.poll_ref is not None for c in self.children):
            if interruptible and self.interrupts.count != seen:
                return False
            self.interrupts.seen = self.interrupts.count  # past ones must not cut the wait short
            if self._next_exits(deadline) is None:
                return False
        return True

    def failure(self, outcome: str) -> ChildFailure:
        """The process to blame for an outcome other than ok or interrupted."""
        return blame(
            outcome, self.failed, self.still_running, self.children, self.timeout_s, self.exit_grace_s
        )


def _lost_reason(child: RayChild, exc: Exception) -> str:
    """Why a child's actor stopped answering: its node died, or Ray says otherwise."""
    import ray

    node = next((n for n in ray.nodes() if n.get("NodeID") == child.node.node_id), None)
    if node is not None and not node.get("Alive", True):
        return f"was lost with its node {child.node_label} (Ray node {child.node.node_id[:12]} died)"
    return f"was lost: its Ray actor died ({first_line(exc)})"


def first_line(exc: BaseException) -> str:
    """An error of Ray's in one line: its first line and, when that is not all, its last (where
    Ray puts the remote exception, e.g. "ModuleNotFoundError: No module named 'paratrain'")."""
    lines = [_ANSI.sub("", line).strip() for line in str(exc).strip().splitlines()]
    lines = [line for line in lines if line]
    text = lines[0] if lines else ""
    if len(lines) > 1:
        text = f"{text} ... {lines[-1]}"
    return f"{type(exc).__name__}: {text}"
