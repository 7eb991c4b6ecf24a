"""The Python stacks of a stuck job: every process can write all its threads' stacks to its log.

`install()` (paratrain.init, in every process of a job) registers faulthandler on SIGUSR1, so that
`paratrain stacks JOB` (launch/stacks_cli.py) or `kill -USR1 PID` makes a process write the stacks
of all its threads to its stderr, which the launcher keeps in the process's log; faulthandler
writes them from a C signal handler, so even a process whose main thread never returns to the
interpreter (a long time.sleep, a native call) answers.

A wait that passes its warning time (KVStoreConfig.wait_warning_s) calls `ask(why)`: this process's
link sends the scheduler `stacks_wanted`; the scheduler asks every node to `dump_stacks`, and each one
writes its threads' stacks to its log and answers with the top frames of its main thread in the
user's code (`user_frames`), which the scheduler logs, one line per process, beside the warning;
the line of a worker the wait is for (`awaited`, from the servers' answer) says so.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import sysconfig
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

SIGNAL = getattr(signal, "SIGUSR1", None)
"""The signal that makes a process of a job write its stacks (none on Windows)."""
HEADER = "paratrain: the stacks of every thread of this process"
"""The line written before the stacks (`paratrain stacks` reads the log from it on)."""
_SKIPPED = tuple(
    os.path.normcase(os.path.dirname(path)) + os.sep
    for path in {
        os.path.dirname(os.path.abspath(__file__)),  # paratrain/
        sysconfig.get_paths()["stdlib"] + "/x",
        sysconfig.get_paths()["purelib"] + "/torch/x",
    }
)
"""Frames under these folders are not the user's: paratrain, the standard library, torch."""

_asker: Callable[[str, tuple[int, ...]], None] | None = None


def install() -> None:
    """Write every thread's stack to stderr on SIGUSR1 (where the platform has it)."""
    if SIGNAL is None:
        return
    try:
        faulthandler.register(SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError, RuntimeError) as exc:  # stderr without a descriptor
        logger.debug("no stack dumps on SIGUSR1: %r", exc)


def dump(why: str) -> None:
    """Write every thread's stack to stderr now, after a line saying why."""
    try:
        print(f"{HEADER} ({why}):", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (ValueError, OSError, AttributeError) as exc:
        logger.warning("could not write this process's stacks: %r", exc)


def user_frames(limit: int = 4) -> list[str]:
    """The innermost `limit` frames of the main thread in the user's code: "file:line in function"."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    found: list[str] = []
    while frame is not None and len(found) < limit:
        path = os.path.normcase(os.path.abspath(frame.f_code.co_filename))
        if not path.startswith(_SKIPPED) and not frame.f_code.co_filename.startswith("<frozen"):
            found.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return found


def set_asker(ask_fn: Callable[[str, tuple[int, ...]], None] | None) -> None:
    """How this process asks the job for its stacks (its scheduler link's; node.py sets it)."""
    global _asker
    _asker = ask_fn


def ask(why: str, awaited: tuple[int, ...] = ()) -> None:
    """Ask every process of the job for its stacks (a no-op outside a job); `awaited`: the workers
    the wait is for."""
    if _asker is None:
        return
    try:
        _asker(why, tuple(awaited))
    except Exception as exc:  # a courtesy to the reader of the logs: the wait goes on regardless
        logger.debug("could not ask for the job's stacks: %r", exc)
