"""Metrics as JSON lines: one object per `log` call, appended and flushed at once, so another process
can follow the file while training runs.

A line is `{"step": 120, "time": 1718000000.123, "loss": 0.2345, ...}`: "step" (int), "time" (unix
seconds, float), then the scalars in the order given. JSON has no NaN or infinity, so a non-finite
value is written as `null`; every line is strict JSON that any parser reads. "step" and "time" are
reserved names.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from paratrain.metrics.api import MetricsLogger, as_floats, check_step

logger = logging.getLogger(__name__)

RESERVED = ("step", "time")


class JsonLinesMetrics(MetricsLogger):
    """Appends one JSON object per `log` call to `path` (parent folders are created)."""

    def __init__(self, path: str | Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 -- open until close()

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        check_step(step)
        values = as_floats(scalars)
        for name in RESERVED:
            if name in values:
                raise ValueError(f"metric name {name!r} is reserved in {self.path}")
        record: dict[str, float | int | None] = {"step": step, "time": self._clock()}
        record.update({name: value if math.isfinite(value) else None for name, value in values.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
