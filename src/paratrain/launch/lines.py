"""What of the children's output reaches the user's terminal when `paratrain launch` folds it.

A job that fails prints its cause in one process and its consequences in all the others: the
scheduler's "aborting the job: worker 0 ... lost its connection", every other process's "stopping:
the scheduler aborted the job: ...", and often the same traceback from every worker that ran the same
bad line. Folded, those abort notices are left out (the launcher's report names who stopped and why)
and a traceback that another process already printed becomes one line naming it, so the cause is
printed once, first. Only what is printed changes: every line still reaches the child's stderr tail.

torch.distributed, once its process group exists, prefixes every line of an uncaught exception's
traceback with the process's rank ("[rank1]: Traceback ..."): that prefix is dropped (`unprefixed`),
as the launcher's own prefix says who wrote the line, so the traceback folds as any other.
"""

from __future__ import annotations

import re
import threading

ABORT_NOTICE = re.compile(
    r"aborting the job: |paratrain: job aborted: |paratrain: \w+ stopping: the scheduler aborted the job: "
)
"""A line in which a process says it stops because the scheduler aborted the job (a consequence)."""
TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
"""What torch.distributed's excepthook puts before every line of a traceback."""
TRACEBACK = "Traceback (most recent call last):"
MAX_TRACEBACK_LINES = 400
"""A traceback longer than this is printed as it comes (a deep recursion), not held back."""


def unprefixed(line: str) -> str:
    """`line` without torch.distributed's "[rankN]: " (module docstring)."""
    return TORCH_RANK_PREFIX.sub("", line, count=1)


class Fold:
    """Shared by the children of one job: the tracebacks printed so far, and who printed each."""

    def __init__(self) -> None:
        self._printed: dict[str, str] = {}
        self._lock = threading.Lock()

    def claim(self, traceback: str, label: str) -> str | None:
        """None if `label` is the first to print this traceback (it prints it); else who was."""
        with self._lock:
            first = self._printed.setdefault(traceback, label)
        return None if first == label else first

    def begun(self, held: list[str], label: str) -> str | None:
        """Who (other than `label`) printed a traceback that begins with the lines `held`, if any."""
        start = "\n".join(held)
        with self._lock:
            printed = list(self._printed.items())
        return next((who for text, who in printed if who != label and text.startswith(start)), None)

    def lines(self, label: str) -> ChildLines:
        """The filter for one stream of the child called `label` (e.g. "worker 1")."""
        return ChildLines(label, self)


class ChildLines:
    """One stream of one child as the terminal sees it: `feed` each line, print what it returns,
    and `close` at the end of the stream. A traceback is held until its last line (the exception),
    then printed whole, or as one line if another child printed the same one."""

    def __init__(self, label: str, fold: Fold) -> None:
        self.label = label
        self.fold = fold
        self._held: list[str] = []

    def feed(self, line: str) -> list[str]:
        line = unprefixed(line)
        if self._held:
            return self._hold(line)
        at = line.find(TRACEBACK)
        if at >= 0:  # after other text where two threads of the child wrote at once
            before = self.feed(line[:at]) if at else []
            self._held = [line[at:]]
            return before
        if ABORT_NOTICE.search(line):
            return []
        return [line]

    def _hold(self, line: str) -> list[str]:
        # A child's abort notice, written by another of its threads while the traceback is being
        # printed, may land between its lines or at the end of one; it is left out as anywhere else,
        # and so is the empty line it leaves behind.
        notice = ABORT_NOTICE.search(line)
        if notice:
            line = line[: notice.start()]
        if not line:
            return []
        self._held.append(line)
        ended = not line.startswith((" ", "\t")) or len(self._held) >= MAX_TRACEBACK_LINES
        return self._release() if ended else []

    def close(self) -> list[str]:
        """What is still held when the stream ends: a traceback cut short (its process stopped, as
        the job was aborted, while printing it). One line if another child printed a traceback that
        begins the same way, else printed as far as it came."""
        held, self._held = self._held, []
        first = self.fold.begun(held, self.label) if held else None
        return held if first is None else [f"(the same traceback as {first}, cut short)"]

    def _release(self) -> list[str]:
        held, self._held = self._held, []
        first = self.fold.claim("\n".join(held), self.label)
        if first is None:
            return held
        return [f"(the same traceback as {first}, ending: {held[-1]})"]
