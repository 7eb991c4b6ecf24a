"""Atomic checkpoints: every process saves files into a staging folder, worker 0 commits it, and a
pointer names the latest complete one; readers load and follow them while training runs (reader.py).
Files, atomicity and the pointer only; no training logic."""

from __future__ import annotations

from paratrain.checkpoint.reader import follow, load_latest, model_state, write_evaluation
from paratrain.checkpoint.store import (
    Checkpoint,
    commit,
    latest,
    list_checkpoints,
    load,
    load_file,
    save_file,
    staging_dir,
)
from paratrain.errors import CheckpointError

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "commit",
    "follow",
    "latest",
    "list_checkpoints",
    "load",
    "load_file",
    "load_latest",
    "model_state",
    "save_file",
    "staging_dir",
    "write_evaluation",
]
