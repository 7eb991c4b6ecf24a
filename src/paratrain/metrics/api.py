"""The metrics interface: one `log(step, scalars)` call, a null default, fan-out, and `open_metrics`
/ `open_loggers` (the Trainer's loggers by name or as objects).

Implementations live one per file (`jsonl.py`, `tensorboard.py`, `mlflow.py`, `wandb.py`); each
process writes its own outputs, named by rank, so no two processes append to one file. Values are
plain floats (`float()` accepts Python numbers and one-element tensors); names are strings. A logger
whose library is an extra that is not installed is replaced by JSON lines, with one warning per
process: metrics never fail a job.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from paratrain.errors import MissingExtraError

logger = logging.getLogger(__name__)


class MetricsLogger(ABC):
    """Where scalar metrics go. Usable as a context manager that closes it."""

    @abstractmethod
    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record `scalars` (name -> value) at training step `step`."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release outputs; calling it twice is harmless."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Record the run's settings once (the strategy, the job's size); dropped by default (JSON
        lines and TensorBoard keep scalars only), kept by the experiment trackers."""
        return None  # noqa: B027 -- optional: most loggers have no place for settings

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

    def log_params(self, params: Mapping[str, Any]) -> None:
        for each in self.loggers:
            each.log_params(params)

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
        try:
            loggers.append(TensorBoardMetrics(root / "tb" / f"rank{rank}"))
        except MissingExtraError as missing:
            _without(missing)
            if not jsonl:
                loggers.append(JsonLinesMetrics(root / f"metrics-rank{rank}.jsonl"))
    logger.info("metrics of rank %d go to %s (jsonl=%s, tensorboard=%s)", rank, root, jsonl, tensorboard)
    return _combined(loggers)


LOGGER_NAMES = ("jsonl", "tensorboard", "mlflow", "wandb")
"""The loggers `open_loggers` opens by name."""

_warned: set[str] = set()


def _without(missing: MissingExtraError) -> None:
    """Say once per process that a logger's library is missing and JSON lines stand in."""
    if str(missing.name) not in _warned:
        _warned.add(str(missing.name))
        logger.warning("%s; its metrics go to JSON lines instead", missing)


def _combined(loggers: list[MetricsLogger]) -> MetricsLogger:
    if not loggers:
        return NullMetrics()
    return loggers[0] if len(loggers) == 1 else MultiMetrics(loggers)


def _named(name: str, root: Path | None, rank: int) -> Callable[[], MetricsLogger]:
    """A factory for the logger called `name`; the folder ones need `root`."""
    from paratrain.metrics.jsonl import JsonLinesMetrics
    from paratrain.metrics.mlflow import MLflowMetrics
    from paratrain.metrics.tensorboard import TensorBoardMetrics
    from paratrain.metrics.wandb import WandbMetrics

    if name in ("jsonl", "tensorboard") and root is None:
        raise ValueError(f"loggers={name!r} writes files and needs metrics_dir")
    factories: dict[str, Callable[[], MetricsLogger]] = {
        "jsonl": lambda: JsonLinesMetrics(Path(root or ".") / f"metrics-rank{rank}.jsonl"),
        "tensorboard": lambda: TensorBoardMetrics(Path(root or ".") / "tb" / f"rank{rank}"),
        "mlflow": MLflowMetrics,
        "wandb": lambda: WandbMetrics(dir=root),
    }
    return factories[name]


def open_loggers(
    loggers: Sequence[str | MetricsLogger] | None, metrics_dir: str | Path | None, *, rank: int
) -> MetricsLogger:
    """The Trainer's loggers: `None` is `open_metrics(metrics_dir)`; otherwise each item is a
    MetricsLogger, or one of LOGGER_NAMES opened with its defaults (MLflow from MLFLOW_TRACKING_URI,
    W&B from WANDB_* and into metrics_dir). A named logger whose extra is missing is replaced by
    JSON lines in metrics_dir (./metrics without one), with one warning."""
    if loggers is None:
        return open_metrics(metrics_dir, rank=rank)
    if isinstance(loggers, (str, MetricsLogger)):
        raise TypeError(f"loggers={loggers!r} must be a list (of names or MetricsLogger objects)")
    root = None if metrics_dir is None else Path(metrics_dir)
    opened: list[MetricsLogger] = []
    fallback = False
    for item in loggers:
        if isinstance(item, MetricsLogger):
            opened.append(item)
        elif item not in LOGGER_NAMES:
            raise ValueError(f"loggers item {item!r} must be a MetricsLogger or one of {LOGGER_NAMES}")
        else:
            try:
                opened.append(_named(item, root, rank)())
            except MissingExtraError as missing:
                _without(missing)
                fallback = fallback or "jsonl" not in loggers
    if fallback:
        opened.append(_named("jsonl", root or Path("metrics"), rank)())
    return _combined(opened)


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
