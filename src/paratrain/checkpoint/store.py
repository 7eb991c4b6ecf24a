"""Checkpoint folders on disk: atomic files, atomic commits, and a pointer to the latest complete one.

Protocol. Every process that holds state (workers, the kvstore client writing the servers' state) saves
its files into the same staging folder `root/step-{step:08d}.partial/` (`staging_dir`, `save_file`). After
a barrier, worker 0 alone calls `commit`: it writes `meta.json`, renames the folder to `root/step-N`, and
rewrites the pointer file `root/latest` to name it. Every file, `meta.json` and the pointer are written
to a temporary name, fsynced and renamed, so a reader (another process, while training runs) sees either
the old or the new version, never half a file; a folder without `meta.json`, or ending in `.partial`,
is never treated as a checkpoint. A commit lists only the staged files (temporary files left by a
process killed mid-write are removed, never listed) and removes the root's debris of an earlier commit
killed midway (the pointer's temporary file, folders moved aside). Files hold tensors and plain data
only and are loaded with `weights_only=True`, so loading never runs code from the file.

A disk that fills up (or a quota, or a file system turned read-only) fails the save or the commit
with one CheckpointError, "checkpoint N not written: no space left on DEVICE (path)", instead of
what torch's writer says about it ("unexpected pos 704 vs 598", the cause buried in the chain).
Nothing of the step is committed, so the pointer still names the last good checkpoint; the Trainer
lets the error end the job (docs/hardening.md says why).

A reader can lose one race: `commit(..., keep=k)` may delete a checkpoint that a reader has just found.
Readers that must not fail retry `latest()` after a `CheckpointError`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle
import re
import shutil
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from paratrain.errors import CheckpointError
from paratrain.system import atomic_write

logger = logging.getLogger(__name__)

POINTER = "latest"
"""The file in the root that names the latest committed checkpoint folder."""
META = "meta.json"
"""The file whose presence makes a folder a complete checkpoint; written last, by `commit`."""
PARTIAL = ".partial"
"""Suffix of a staging folder that is still being written."""

_STEP_DIR = re.compile(r"step-(\d+)")
_PARTIAL_DIR = re.compile(r"step-(\d+)\.partial")
_TMP_FILE = re.compile(r"\.?.+\.tmp-\d+")  # hidden (save_file's), or from an older writer
_ROOT_DEBRIS = re.compile(r"\.(latest\.tmp|step-\d+(\.partial)?\.old)-\d+")

# The plain types that torch's weights_only unpickler rebuilds, so a save is refused up front rather
# than a load failing after a long run.
_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device)
_DICT_TYPES = (dict, OrderedDict, Counter)
_SEQ_TYPES = (list, tuple, set, torch.Size)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_DISK_FULL = {
    errno.ENOSPC: "no space left on",
    errno.EDQUOT: "disk quota exceeded on",
    errno.EROFS: "the file system is read-only:",
}


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint folder."""

    path: Path
    """The folder, `root/step-{step:08d}` (or any folder holding a `meta.json`)."""
    step: int
    """The training step it was taken at."""
    meta: dict
    """The parsed `meta.json`: the caller's fields plus "step", "time" (unix s) and "files"."""

    def __post_init__(self) -> None:
        if not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"Checkpoint.step={self.step!r} must be an int >= 0")

    def file(self, name: str) -> Path:
        """The path of one file of this checkpoint (relative name, '/'-separated; need not exist)."""
        return self.path / _relative_name(name)


def staging_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The folder every process saves step `step`'s files into; created if missing."""
    path = Path(root) / (_step_name(step) + PARTIAL)
    with _disk_errors(path):
        path.mkdir(parents=True, exist_ok=True)
    return path


def save_file(path: str | os.PathLike[str], state: dict) -> None:
    """Write `state` (a dict of nested dicts/lists/tuples of tensors and plain data) to `path` atomically.

    Tensors are saved as they are; move them to the CPU first if they should load without a GPU.
    """
    path = Path(path)
    if not isinstance(state, dict):
        raise TypeError(f"checkpoint state for {path} must be a dict, not {type(state).__name__}")
    _check_state(state, "state")
    with _disk_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: torch.save(state, f))


def load_file(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict:
    """Load a file written by `save_file`, refusing anything but tensors and plain data."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} does not exist")
    except Exception as e:
        # UnpicklingError for a refused global or opcode; RuntimeError, EOFError and others for damage.
        raise CheckpointError(f"checkpoint file {path} is corrupt or not plain data: {_reason(e)}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {path} holds a {type(state).__name__}, not a dict")
    return state


def commit(root: str | os.PathLike[str], step: int, meta: dict, keep: int | None = None) -> Path:
    """Make the staged step `step` a complete checkpoint and point `root/latest` at it.

    Call once (worker 0), after every process has finished saving into `staging_dir(root, step)`.
    `meta` must be plain JSON data; its "step", "time" and "files" are set here.
    With `keep`, the oldest complete checkpoints beyond `keep` are deleted (never this one), and so are
    staging folders of earlier steps, which no process can still be writing.
    """
    root = Path(root)
    name = _step_name(step)
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ValueError(f"commit keep={keep!r} must be None or an int >= 1")
    staging = root / (name + PARTIAL)
    if not staging.is_dir():
        raise CheckpointError(f"cannot commit step {step}: no staging folder {staging} (nothing was saved)")
    full_meta = {**meta, "step": step, "time": time.time(), "files": _staged_files(staging)}
    try:
        text = json.dumps(full_meta, indent=1, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"commit meta for step {step} is not plain JSON data: {e}")
    with _disk_errors(staging / META):
        atomic_write(staging / META, lambda f: f.write(text.encode()))
        _fsync_dir(staging)
    final = root / name
    _rename_over(staging, final)
    _fsync_dir(root)
    with _disk_errors(root / POINTER):  # the folder is complete: a reader finds it by its step
        atomic_write(root / POINTER, lambda f: f.write(f"{name}\n".encode()))
        _fsync_dir(root)
    _clean_debris(root)
    logger.info("checkpoint step %d committed at %s (%d files)", step, final, len(full_meta["files"]))
    if keep is not None:
        _prune(root, step, keep)
    return final


def latest(root: str | os.PathLike[str]) -> Checkpoint | None:
    """The checkpoint `root/latest` names, or else the highest complete one; None if there is none."""
    root = Path(root)
    if not root.is_dir():
        return None
    try:
        name = (root / POINTER).read_text().strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    if _STEP_DIR.fullmatch(name):
        found = _read_checkpoint(root / name)
        if found is not None:
            return found
        logger.debug("%s names %s, which is not a complete checkpoint; using the highest step", root, name)
    complete = list_checkpoints(root)
    return complete[-1] if complete else None


def list_checkpoints(root: str | os.PathLike[str]) -> list[Checkpoint]:
    """Every complete checkpoint under `root`, sorted by step (staging folders are left out)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if _STEP_DIR.fullmatch(child.name):
            checkpoint = _read_checkpoint(child)
            if checkpoint is not None:
                found.append(checkpoint)
    return sorted(found, key=lambda c: c.step)


def load(path: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint at `path`: a root (its latest) or one checkpoint folder."""
    path = Path(path)
    if path.name.endswith(PARTIAL):
        raise CheckpointError(f"{path} is a staging folder that was never committed")
    if (path / META).is_file():
        checkpoint = _read_checkpoint(path)
        if checkpoint is None:
            raise CheckpointError(f"{path / META} is unreadable or has no valid 'step'")
        return checkpoint
    checkpoint = latest(path)
    if checkpoint is None:
        raise CheckpointError(f"no complete checkpoint in {path}")
    return checkpoint


def _step_name(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint step={step!r} must be an int >= 0")
    return f"step-{step:08d}"


def _relative_name(name: str) -> PurePosixPath:
    rel = PurePosixPath(name)
    if not name or rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"checkpoint file name={name!r} must be a relative path inside the checkpoint")
    return rel


def _reason(error: BaseException) -> str:
    """The useful part of a torch.load error (torch wraps the unpickler's own in generic advice)."""
    if isinstance(error, pickle.UnpicklingError) and error.__context__ is not None:
        error = error.__context__
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


@contextlib.contextmanager
def _disk_errors(path: Path) -> Iterator[None]:
    """A full disk, a quota or a read-only file system while writing `path`, anywhere in the
    exception's chain (torch's writer raises its own error over the OSError), as one CheckpointError."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        cause: BaseException | None = exc
        while cause is not None and not (isinstance(cause, OSError) and cause.errno in _DISK_FULL):
            cause = cause.__cause__ or cause.__context__
        problem = _DISK_FULL.get(cause.errno) if isinstance(cause, OSError) and cause.errno else None
        if problem is None:
            raise
        match = next((m for part in path.parts if (m := _STEP_DIR.match(part))), None)
        what = f"checkpoint {int(match.group(1))}" if match else "checkpoint file"
        problem = f"{problem} {_device(path)}"
        raise CheckpointError(f"{what} not written: {problem} ({path})") from None


def _device(path: Path) -> str:
    """The file system holding `path`, as /proc/mounts names it ("/dev/sda1 at /data")."""
    try:
        mounts = [line.split()[:2] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "its device"
    target = os.path.realpath(path)
    under = [
        (point, device)
        for device, point in mounts
        if target == point or target.startswith(point.rstrip("/") + "/")
    ]
    if not under:
        return "its device"
    point, device = max(under, key=lambda pair: len(pair[0]))
    return f"{device} at {point}"


def _check_state(value: Any, where: str) -> None:
    """Raise TypeError naming the first value that `weights_only` loading would refuse."""
    kind = type(value)
    if kind in _DICT_TYPES:
        for key, item in value.items():
            _check_state(key, f"{where} key {key!r}")
            _check_state(item, f"{where}[{key!r}]")
    elif kind in _SEQ_TYPES:
        for i, item in enumerate(value):
            _check_state(item, f"{where}[{i}]")
    elif kind not in _LEAF_TYPES and kind not in _TENSOR_TYPES:
        raise TypeError(
            f"{where} is a {kind.__module__}.{kind.__qualname__}; a checkpoint holds only tensors, "
            "dicts, lists, tuples, numbers, strings, bytes and None"
        )


def _fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable (a no-op where folders cannot be opened, as on Windows)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _staged_files(staging: Path) -> list[str]:
    """The staged files as sorted '/'-separated relative names; leftover temporary files are removed."""
    files = []
    for path in staging.rglob("*"):
        if not path.is_file():
            continue
        if _TMP_FILE.fullmatch(path.name):
            logger.warning("removing %s: a save into this checkpoint did not finish", path)
            path.unlink(missing_ok=True)
            continue
        rel = path.relative_to(staging).as_posix()
        if rel != META:
            files.append(rel)
    return sorted(files)


def _clean_debris(root: Path) -> None:
    """Remove what a commit killed midway left in the root: a pointer's temporary file, a replaced
    or pruned folder moved aside. Only worker 0 commits, so no other writer can still own them."""
    for child in root.iterdir():
        if not _ROOT_DEBRIS.fullmatch(child.name):
            continue
        logger.warning("removing %s: a commit into %s did not finish", child, root)
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _rename_over(src: Path, dst: Path) -> None:
    """Rename folder `src` to `dst`; an existing `dst` is first moved aside, then deleted."""
    if not dst.exists():
        os.rename(src, dst)
        return
    aside = _move_aside(dst)
    os.rename(src, dst)
    logger.info("replaced existing checkpoint %s", dst)
    shutil.rmtree(aside, ignore_errors=True)


def _move_aside(path: Path) -> Path:
    """Rename `path` to a hidden name that no reader looks at, so it vanishes at once, not file by file."""
    aside = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(path, aside)
    return aside


def _read_checkpoint(path: Path) -> Checkpoint | None:
    """The checkpoint in folder `path`, or None when it has no readable meta.json with a valid step."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    step = meta.get("step") if isinstance(meta, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None
    return Checkpoint(path=path, step=step, meta=meta)


def _prune(root: Path, committed: int, keep: int) -> None:
    """Delete complete checkpoints beyond the newest `keep` (sparing `committed`), and stale staging."""
    others = [c for c in list_checkpoints(root) if c.step != committed]
    doomed = [c.path for c in others[: max(len(others) - (keep - 1), 0)]]
    for child in root.iterdir():
        match = _PARTIAL_DIR.fullmatch(child.name)
        if match and int(match.group(1)) < committed:
            doomed.append(child)
    for path in doomed:
        logger.info("pruning checkpoint folder %s", path)
        try:
            aside = _move_aside(path)
        except FileNotFoundError:
            continue
        shutil.rmtree(aside, ignore_errors=True)
