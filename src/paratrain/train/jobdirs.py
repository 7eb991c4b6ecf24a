"""Where a Trainer puts its checkpoints and metrics when the script does not say: under the job's
output directory, which the job platform (`paratrain submit`) gives every process as
PARATRAIN_OUTPUT_DIR, with the spec's checkpoint interval as PARATRAIN_CHECKPOINT_EVERY."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def job_defaults(
    checkpoint_dir: str | Path | None,
    metrics_dir: str | Path | None,
    checkpoint_every: int | None,
    env: Mapping[str, str] | None = None,
) -> tuple[Path | None, Path | None, int]:
    """(checkpoint_dir, metrics_dir, checkpoint_every): the given values, else OUTPUT_DIR/checkpoints,
    OUTPUT_DIR/metrics and the job's interval (0 outside a job)."""
    env = os.environ if env is None else env
    if env.get("PARATRAIN_TASK") == "evaluator":  # it would train a single copy into the job's checkpoints
        raise ValueError(
            "this process is the job's evaluator (PARATRAIN_TASK=evaluator): it scores the workers' "
            "checkpoints (paratrain.checkpoint.follow) and must not train; see examples/cifar10.py"
        )
    output = env.get("PARATRAIN_OUTPUT_DIR")
    if checkpoint_dir is None and output:
        checkpoint_dir = Path(output) / "checkpoints"
    if metrics_dir is None and output:
        metrics_dir = Path(output) / "metrics"
    if checkpoint_every is None:
        text = env.get("PARATRAIN_CHECKPOINT_EVERY", "0") or "0"
        if not text.isdigit():
            raise ValueError(f"PARATRAIN_CHECKPOINT_EVERY={text!r} must be an int >= 0")
        checkpoint_every = int(text)
    return (
        None if checkpoint_dir is None else Path(checkpoint_dir),
        None if metrics_dir is None else Path(metrics_dir),
        checkpoint_every,
    )
