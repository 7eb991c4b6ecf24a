"""Two small things about the operating system that every layer needs, written once.

`process_alive(pid)` answers "is the process I started still running?". A zombie (exited, not yet
reaped by its parent) is not running: it holds no port, no memory and runs no code, and the
launchers' reaping is a separate question. A pid that exists but refuses our signal
(PermissionError) belongs to another user: every process paratrain asks about was started by this
user, so that pid was recycled and ours is gone.

`atomic_write(path, content)` writes a file so that a reader (on this machine or another that shares
the file system) sees the old version or the new one, never a part: a temporary file beside it,
fsynced, then renamed onto it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO


def process_alive(pid: int) -> bool:
    """True while process `pid`, one of this user's, runs (not once it is a zombie)."""
    if pid <= 0:  # 0 and negatives name process groups to os.kill, never one process
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc (not Linux), or it exited since
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # the name before ")" may hold spaces


def atomic_write(path: str | os.PathLike[str], content: bytes | str | Callable[[IO[bytes]], object]) -> None:
    """Replaces `path` with `content` (bytes, text as UTF-8, or a function that writes to the open
    binary file) all at once; on any error the old file is left as it was and no temporary remains."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
