"""Checkpoint files, commits and the latest pointer, in one process (a reader thread for concurrency)."""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from paratrain.checkpoint import (
    CheckpointError,
    commit,
    latest,
    list_checkpoints,
    load,
    load_file,
    save_file,
    staging_dir,
)
from paratrain.testing import run_job  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def _write_marker(path: str) -> None:
    Path(path).write_text("code from the checkpoint ran")


class _Evil:
    """Unpickling this calls _write_marker: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (_write_marker, (self.marker,))


def _save_step(root: Path, step: int, *, keep: int | None = None) -> Path:
    folder = staging_dir(root, step)
    save_file(folder / "model.pt", {"step": torch.tensor(step), "w": torch.full((64,), float(step))})
    save_file(folder / "servers" / "key-0.pt", {"values": {0: torch.arange(4)}})
    return commit(root, step, {"world_size": 2}, keep=keep)


def test_save_load_round_trip_nested(tmp_path: Path) -> None:
    state = {
        "model": {"w": torch.randn(3, 4), "b": torch.zeros(4, dtype=torch.float64)},
        "optimizer": {
            "state": {0: {"exp_avg": torch.ones(2)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}],
        },
        "step": 7,
        "flags": [True, None, "text", 1.5],
    }
    save_file(tmp_path / "a.pt", state)
    got = load_file(tmp_path / "a.pt")
    assert torch.equal(got["model"]["w"], state["model"]["w"])
    assert got["model"]["b"].dtype == torch.float64
    assert torch.equal(got["optimizer"]["state"][0]["exp_avg"], torch.ones(2))
    assert got["optimizer"]["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.99)}]
    assert got["step"] == 7 and got["flags"] == [True, None, "text", 1.5]
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]  # no temporary file left behind


def test_save_refuses_objects_that_would_not_load(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"state\['x'\]\[1\]"):
        save_file(tmp_path / "a.pt", {"x": [1, object()]})
    with pytest.raises(TypeError, match="must be a dict"):
        save_file(tmp_path / "a.pt", [torch.zeros(1)])
    assert not (tmp_path / "a.pt").exists()


@pytest.mark.parametrize("writer", ["torch", "pickle"])
def test_load_refuses_code_in_file(tmp_path: Path, writer: str) -> None:
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pt"
    if writer == "torch":
        torch.save({"x": _Evil(marker)}, path)
    else:
        path.write_bytes(pickle.dumps({"x": _Evil(marker)}, protocol=2))
    with pytest.raises(CheckpointError, match="evil.pt"):
        load_file(path)
    assert not marker.exists()
    # The payload is live: an unsafe load would have run it.
    if writer == "torch":
        torch.load(path, weights_only=False)
    else:
        pickle.loads(path.read_bytes())
    assert marker.exists()


def test_load_refuses_corrupt_and_missing_file(tmp_path: Path) -> None:
    save_file(tmp_path / "a.pt", {"w": torch.randn(100)})
    data = (tmp_path / "a.pt").read_bytes()
    (tmp_path / "a.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="a.pt"):
        load_file(tmp_path / "a.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_file(tmp_path / "missing.pt")


def test_commit_writes_meta_and_pointer(tmp_path: Path) -> None:
    final = _save_step(tmp_path, 3)
    assert final == tmp_path / "step-00000003"
    assert (tmp_path / "latest").read_text().strip() == "step-00000003"
    checkpoint = latest(tmp_path)
    assert checkpoint is not None and checkpoint.step == 3 and checkpoint.path == final
    assert checkpoint.meta["files"] == ["model.pt", "servers/key-0.pt"]
    assert checkpoint.meta["world_size"] == 2 and checkpoint.meta["step"] == 3
    assert isinstance(checkpoint.meta["time"], float)
    assert torch.equal(load_file(checkpoint.file("servers/key-0.pt"))["values"][0], torch.arange(4))
    assert load(tmp_path) == checkpoint and load(final) == checkpoint
    with pytest.raises(ValueError, match="name"):
        checkpoint.file("../x")


def test_staging_folder_is_ignored(tmp_path: Path) -> None:
    _save_step(tmp_path, 1)
    folder = staging_dir(tmp_path, 2)
    assert folder == tmp_path / "step-00000002.partial" and folder.is_dir()
    save_file(folder / "model.pt", {"w": torch.zeros(1)})
    (tmp_path / "latest").unlink()  # even without the pointer, the fallback skips the staging folder
    assert latest(tmp_path).step == 1
    assert [c.step for c in list_checkpoints(tmp_path)] == [1]
    with pytest.raises(CheckpointError, match="never committed"):
        load(folder)


def test_nothing_to_load(tmp_path: Path) -> None:
    assert latest(tmp_path / "absent") is None
    assert latest(tmp_path) is None
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load(tmp_path)
    with pytest.raises(CheckpointError, match="no staging folder"):
        commit(tmp_path, 5, {})


def test_pointer_to_deleted_folder_falls_back(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save_step(tmp_path, step)
    shutil.rmtree(tmp_path / "step-00000003")
    assert latest(tmp_path).step == 2
    (tmp_path / "latest").write_text("../../etc")  # a pointer naming no step folder is ignored
    assert latest(tmp_path).step == 2
    (tmp_path / "latest").write_bytes(b"\xff\xfe")
    assert latest(tmp_path).step == 2


def test_recommit_replaces_existing_step(tmp_path: Path) -> None:
    _save_step(tmp_path, 4)
    save_file(staging_dir(tmp_path, 4) / "other.pt", {"x": 1})
    commit(tmp_path, 4, {})
    assert latest(tmp_path).meta["files"] == ["other.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000004"]


def test_keep_prunes_oldest(tmp_path: Path) -> None:
    for step in range(1, 6):
        _save_step(tmp_path, step, keep=2)
    staging_dir(tmp_path, 9)  # a later step in progress survives pruning
    staging_dir(tmp_path, 0)  # an abandoned earlier one does not
    _save_step(tmp_path, 6, keep=2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [5, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step-00000005",
        "step-00000006",
        "step-00000009.partial",
    ]
    with pytest.raises(ValueError, match="keep=0"):
        commit(tmp_path, 9, {}, keep=0)


def test_reader_never_sees_partial_checkpoint(tmp_path: Path) -> None:
    done = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            while True:
                finished = done.is_set()
                checkpoint = latest(tmp_path)
                if checkpoint is not None:
                    state = load_file(checkpoint.file("model.pt"))
                    assert int(state["step"]) == checkpoint.step
                    assert torch.equal(state["w"], torch.full((64,), float(checkpoint.step)))
                    assert not seen or checkpoint.step >= seen[-1], (seen[-1], checkpoint.step)
                    seen.append(checkpoint.step)
                if finished:
                    return
        except BaseException as e:
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for step in range(1, 51):
            _save_step(tmp_path, step)
    finally:
        done.set()
        reader.join(timeout=20)
    assert not reader.is_alive()
    assert not errors, errors
    assert seen and seen[-1] == 50


def test_a_commit_lists_only_the_checkpoint_files_and_cleans_what_a_kill_left(tmp_path: Path) -> None:
    # A run killed mid-save left a temporary file in step 3's staging folder (the kvstore wrote
    # `servers.pt.tmp-PID`, unhidden; save_file writes `.NAME.tmp-PID`), a pointer's temporary file
    # and a folder moved aside by a replace or a prune. The resumed run saves step 3 again.
    staging = staging_dir(tmp_path, 3)
    (staging / "servers.pt.tmp-4242").write_bytes(b"half a file")
    (staging / ".worker-0.pt.tmp-4243").write_bytes(b"half a file")
    (tmp_path / ".latest.tmp-4244").write_bytes(b"step-0000")
    (tmp_path / ".step-00000002.old-4245").mkdir()
    (tmp_path / ".step-00000001.partial.old-4246").mkdir()
    save_file(staging / "worker-0.pt", {"x": torch.ones(1)})
    save_file(staging / "servers.pt", {"y": torch.ones(1)})
    final = commit(tmp_path, 3, {})
    assert load(tmp_path).meta["files"] == ["servers.pt", "worker-0.pt"]
    assert sorted(p.name for p in final.iterdir()) == ["meta.json", "servers.pt", "worker-0.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003"]


def test_the_kvstore_state_file_is_fsynced_before_it_is_renamed(tmp_path: Path, monkeypatch) -> None:
    import os

    from paratrain.kvstore import create

    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(
        os, "replace", lambda a, b: (events.append(f"replace {Path(a).name}"), real_replace(a, b))[1]
    )
    kv = create("local")
    kv.init("w", torch.arange(3.0))
    kv.init_table("t", 2)
    kv.save_state(tmp_path / "servers.pt")  # the local store rewrites the file to add its tables
    pid = os.getpid()
    assert events == ["fsync", f"replace .servers.pt.tmp-{pid}"] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["servers.pt"]


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 256 KiB tmpfs (mounting needs root: skipped otherwise)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_fails_the_checkpoint_in_one_line_and_keeps_the_last_good_one(small_disk: Path) -> None:
    root = small_disk / "ckpt"
    _save_step(root, 1)
    folder = staging_dir(root, 2)
    with pytest.raises(CheckpointError) as failed:
        save_file(folder / "model.pt", {"w": torch.zeros(1 << 17)})  # 512 KiB on a 256 KiB disk
    message = failed.value.args[0]  # str() adds the troubleshooting link
    assert (
        message == f"checkpoint 2 not written: no space left on tmpfs at {small_disk} ({folder / 'model.pt'})"
    )
    assert failed.value.__suppress_context__  # the line above is the whole report, not torch's
    assert not [p for p in folder.iterdir()]  # its temporary file is gone: the space is free again
    found = latest(root)
    assert found is not None and found.step == 1
    assert torch.equal(load_file(found.file("model.pt"))["w"], torch.full((64,), 1.0))


@pytest.mark.parametrize(
    "code, words",
    [
        (errno.ENOSPC, "checkpoint 5 not written: no space left on "),
        (errno.EDQUOT, "checkpoint 5 not written: disk quota exceeded on "),
        (errno.EROFS, "checkpoint 5 not written: the file system is read-only: "),
    ],
)
@pytest.mark.parametrize("stage", ["save", "commit"])
def test_disk_errors_name_the_checkpoint_the_problem_and_the_path(tmp_path, monkeypatch, code, words, stage):
    _save_step(tmp_path, 4)
    folder = staging_dir(tmp_path, 5)
    if stage == "commit":
        save_file(folder / "model.pt", {"w": torch.ones(4)})
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(CheckpointError) as failed:
        if stage == "save":
            save_file(folder / "model.pt", {"w": torch.ones(4)})
        else:
            commit(tmp_path, 5, {})
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert str(failed.value).startswith(words) and str(tmp_path) in str(failed.value), failed.value
    assert latest(tmp_path).step == 4


DISK_FILLING_JOB = """
import os, torch, paratrain
ctx = paratrain.init()
torch.manual_seed(0)
model = torch.nn.Linear(100, 100)  # 40 KB of weights: two or three checkpoints fill the disk
trainer = paratrain.Trainer(
    model, torch.optim.SGD(model.parameters(), lr=0.01), checkpoint_dir=os.environ["CKPT"],
    checkpoint_every=2, progress=False,
)
x = torch.randn(8, 100)
for _ in range(200):
    trainer.step((trainer.model(x) ** 2).mean())
print("the disk never filled", flush=True)
"""


@pytest.mark.timeout(180)
def test_a_job_whose_disk_fills_ends_naming_the_checkpoint_and_the_device(small_disk: Path) -> None:
    """The policy (docs/hardening.md): a checkpoint that cannot be written ends the job, with that
    line first in the launcher's report; the last good checkpoint is the one a restart finds."""
    root = small_disk / "ckpt"
    outcome = run_job(
        DISK_FILLING_JOB, workers=1, servers=1, env={"CKPT": str(root)}, expect="failure", timeout_s=150
    )
    report = outcome.report
    failed = re.search(r"checkpoint (\d+) not written: no space left on tmpfs at (\S+) \(", report)
    assert failed is not None and failed.group(2) == str(small_disk), report
    assert "enforce fail" not in report and "unexpected pos" not in report, report
    found = latest(root)
    assert found is not None and found.step < int(failed.group(1)), (found, report)
    assert load_file(found.file("model.pt"))["model"]["weight"].shape == (100, 100)
