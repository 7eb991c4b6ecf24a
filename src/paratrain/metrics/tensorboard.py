"""Metrics as TensorBoard scalars: one `add_scalar` per value, tagged with its name, at its step.

Written with `torch.utils.tensorboard.SummaryWriter` into one logdir per process; TensorBoard pointed at
the parent folder shows every rank as its own run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from paratrain.errors import MissingExtraError
from paratrain.metrics.api import MetricsLogger, as_floats, check_step

logger = logging.getLogger(__name__)


class TensorBoardMetrics(MetricsLogger):
    """Writes scalars to an event file in `logdir`, flushed every `flush_s` seconds and on close."""

    def __init__(self, logdir: str | Path, *, flush_s: float = 10.0) -> None:
        if not flush_s > 0:
            raise ValueError(f"TensorBoardMetrics flush_s={flush_s!r} must be > 0")
        # Imported here: importing TensorBoard takes about a second, and most processes never need it.
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise MissingExtraError("tensorboard", "tensorboard", "TensorBoardMetrics (metrics_dir)") from exc

        self.logdir = Path(logdir)
        self._writer = SummaryWriter(log_dir=str(self.logdir), flush_secs=flush_s)
        self._closed = False

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        check_step(step)
        if self._closed:
            raise ValueError(f"TensorBoardMetrics for {self.logdir} is closed")
        for name, value in as_floats(scalars).items():
            self._writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.flush()
            self._writer.close()
