"""The metrics interface: one `log(step, scalars)` call, a null default, fan-out, and `open_metrics`.

Implementations live one per file (`jsonl.py`, `tensorboard.py`); each process writes its own outputs,
named by rank, so no two processes append to one file. Values are plain floats (`float()` accepts
Python numbers and one-element tensors); names are strings.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path

logger = logging.getLogger(__name__)


class MetricsLogger(ABC):
    """Where scalar metrics go. Usable as a context manager that closes it."""

    @abstractmethod
    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record `scalars` (name -> value) at training step `step`."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release outputs; calling it twice is harmless."""

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullMetrics(MetricsLogger):
    """Drops everything: the default when no metrics folder is configured."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class MultiMetrics(MetricsLogger):
    """Sends every call to each of several loggers, in order."""

    def __init__(self, loggers: Iterable[MetricsLogger]) -> None:
        self.loggers = list(loggers)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for each in self.loggers:
            each.log(step, scalars)

    def close(self) -> None:
        # Close every logger even if one fails, then raise the first failure.
        first: BaseException | None = None
        for each in self.loggers:
            try:
                each.close()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first


def open_metrics(
    metrics_dir: str | Path | None, *, rank: int, tensorboard: bool = True, jsonl: bool = True
) -> MetricsLogger:
    """The loggers for process `rank`: `metrics_dir/metrics-rank{rank}.jsonl` and the TensorBoard
    logdir `metrics_dir/tb/rank{rank}`; `NullMetrics` when `metrics_dir` is None or both are off."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"open_metrics rank={rank!r} must be an int >= 0")
    if metrics_dir is None:
        return NullMetrics()
    root = Path(metrics_dir)
    loggers: list[MetricsLogger] = []
    # Imported here: the implementations import this module.
    from paratrain.metrics.jsonl import JsonLinesMetrics
    from paratrain.metrics.tensorboard import TensorBoardMetrics

    if jsonl:
        loggers.append(JsonLinesMetrics(root / f"metrics-rank{rank}.jsonl"))
    if tensorboard:
        loggers.append(TensorBoardMetrics(root / "tb" / f"rank{rank}"))
    logger.info("metrics of rank %d go to %s (jsonl=%s, tensorboard=%s)", rank, root, jsonl, tensorboard)
    if not loggers:
        return NullMetrics()
    return loggers[0] if len(loggers) == 1 else MultiMetrics(loggers)


def check_step(step: int) -> None:
    """Raise ValueError unless `step` is an int >= 0 (shared by the implementations)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"metrics step={step!r} must be an int >= 0")


def as_floats(scalars: Mapping[str, float]) -> dict[str, float]:
    """`scalars` with every value converted by `float()`; names must be non-empty strings."""
    out = {}
    for name, value in scalars.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"metric name={name!r} must be a non-empty string")
        try:
            out[name] = float(value)
        except (TypeError, ValueError, RuntimeError) as e:  # RuntimeError: a tensor of many elements
            raise TypeError(f"metric {name!r}={value!r} is not a number: {e}")
    return out
