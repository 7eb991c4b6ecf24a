"""The two OS helpers every layer shares (paratrain/system.py): which processes count as alive, and
a write that readers see whole or not at all."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.system import atomic_write, process_alive


def test_a_running_process_is_alive_and_a_zombie_is_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_alive(child.pid)
        child.kill()
        deadline = time.monotonic() + 30
        while process_alive(child.pid):  # exited but not reaped by us: a zombie, not running
            assert time.monotonic() < deadline, "a killed, unreaped child still counts as alive"
            time.sleep(0.01)
        assert Path(f"/proc/{child.pid}/stat").exists()  # still a zombie: only reaping removes it
    finally:
        child.kill()
        child.wait()
    assert not process_alive(child.pid)


def test_no_process_group_and_no_other_users_process_counts() -> None:
    assert process_alive(os.getpid())
    assert not process_alive(0)  # os.kill(0, 0) would signal our own group
    assert not process_alive(-1)


def test_a_pid_that_refuses_our_signal_is_not_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """PermissionError: the pid is another user's, so the process we started (as this user) is gone."""

    def refused(pid: int, signum: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", refused)
    assert not process_alive(os.getpid())


def test_an_atomic_write_replaces_the_whole_file_or_nothing(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    atomic_write(path, "old\n")
    atomic_write(path, b"new\n")
    assert path.read_bytes() == b"new\n"

    def half_then_fail(f) -> None:
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert path.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temporary left behind
