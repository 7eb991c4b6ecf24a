"""Atomic checkpoints: every process saves files into a staging folder, worker 0 commits it, and a
pointer names the latest complete one. Files, atomicity and the pointer only; no training logic."""

from __future__ import annotations

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
    "latest",
    "list_checkpoints",
    "load",
    "load_file",
    "save_file",
    "staging_dir",
]
