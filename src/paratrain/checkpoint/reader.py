"""Reading checkpoints while training writes them: from an evaluator, a server of predictions, a shell.

    found = load_latest(OUTPUT_DIR)        # (Checkpoint, its model's state dict) or None
    for found in follow(OUTPUT_DIR, done_file=...):   # each new complete checkpoint, oldest first
        write_evaluation(found, {"accuracy": 0.91})

A reader only ever sees complete checkpoints: a checkpoint folder is renamed into place after every
file and its meta.json are written (store.py), and the next step is staged under another name. The
one race a reader can lose is pruning (`keep`) deleting the folder it has just found; `load_latest`
then reads the newer one that caused the pruning.

OUTPUT_DIR is a job's output directory (its checkpoints are in OUTPUT_DIR/checkpoints, where the
Trainer puts them by default) or a checkpoint root itself.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from paratrain.checkpoint.store import Checkpoint, latest, list_checkpoints, load_file
from paratrain.errors import CheckpointError
from paratrain.system import atomic_write

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
"""The checkpoint root's name under a job's output directory."""
EVALUATION = "evaluation.json"
"""The evaluator's result, written into the checkpoint folder it scored."""
_RETRIES = 5


def checkpoint_root(path: str | os.PathLike[str]) -> Path:
    """`path/checkpoints` when `path` is an output directory that has one, else `path`."""
    path = Path(path)
    nested = path / CHECKPOINTS
    return nested if nested.is_dir() or not path.is_dir() else path


def load_latest(path: str | os.PathLike[str], map_location: Any = "cpu") -> tuple[Checkpoint, dict] | None:
    """The newest complete checkpoint under `path` and its model's state dict, or None when there
    is none yet. Never a half-written one, even while the next is being written."""
    root = checkpoint_root(path)
    for _ in range(_RETRIES):
        found = latest(root)
        if found is None:
            return None
        try:
            return found, model_state(found, map_location)
        except CheckpointError:
            if found.path.is_dir():
                raise  # damaged, not pruned: say so
            logger.info("checkpoint %s was pruned while being read; reading the newer one", found.path)
    raise CheckpointError(f"checkpoints under {root} were pruned {_RETRIES} times while being read")


def model_state(found: Checkpoint, map_location: Any = "cpu") -> dict:
    """The model's state dict in a Trainer's checkpoint: model.pt, or worker 0's own model where each
    worker saved its own (local SGD, pipelines, independent workers)."""
    if "model.pt" in found.meta.get("files", ()):
        return load_file(found.file("model.pt"), map_location)["model"]
    worker = load_file(found.file("worker-0.pt"), map_location)
    if "model" not in worker:
        raise CheckpointError(f"checkpoint {found.path} holds no model (no model.pt, none in worker-0.pt)")
    return worker["model"]


def follow(
    path: str | os.PathLike[str], done_file: str | os.PathLike[str] | None = None, poll_s: float = 1.0
) -> Iterator[Checkpoint]:
    """Each new complete checkpoint under `path` as it appears (skipping any that were superseded
    before it was seen), until `done_file` exists and the newest has been yielded. Without
    `done_file` it never ends."""
    seen = -1
    while True:
        finished = done_file is not None and os.path.exists(done_file)  # before looking: none missed
        newest = list_checkpoints(checkpoint_root(path))
        if newest and newest[-1].step > seen:
            seen = newest[-1].step
            yield newest[-1]
            continue
        if finished:
            return
        time.sleep(poll_s)


def write_evaluation(found: Checkpoint, results: dict) -> Path:
    """Writes `results` (plain JSON data) as evaluation.json into the checkpoint's folder, atomically."""
    text = json.dumps({**results, "time": time.time()}, indent=1, sort_keys=True, allow_nan=False)
    path = found.path / EVALUATION
    atomic_write(path, text)
    return path


def read_evaluation(found: Checkpoint) -> dict | None:
    try:
        data = json.loads((found.path / EVALUATION).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def folder_size(found: Checkpoint) -> int:
    """Bytes of the checkpoint's files."""
    total = 0
    for name in (*found.meta.get("files", ()), "meta.json"):
        try:
            total += (found.path / name).stat().st_size
        except OSError:
            pass
    return total
