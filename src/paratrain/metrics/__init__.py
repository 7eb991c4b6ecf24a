"""Metrics and progress: one small logging interface (null, JSON lines, TensorBoard, MLflow, Weights &
Biases) and the terminal progress display. Imports no other paratrain layer; each tracker's library
is imported only when its logger is made."""

from __future__ import annotations

from paratrain.metrics.api import (
    LOGGER_NAMES,
    MetricsLogger,
    MultiMetrics,
    NullMetrics,
    open_loggers,
    open_metrics,
)
from paratrain.metrics.jsonl import JsonLinesMetrics
from paratrain.metrics.mlflow import MLflowMetrics
from paratrain.metrics.progress import Progress
from paratrain.metrics.tensorboard import TensorBoardMetrics
from paratrain.metrics.wandb import WandbMetrics

__all__ = [
    "LOGGER_NAMES",
    "JsonLinesMetrics",
    "MLflowMetrics",
    "MetricsLogger",
    "MultiMetrics",
    "NullMetrics",
    "Progress",
    "TensorBoardMetrics",
    "WandbMetrics",
    "open_loggers",
    "open_metrics",
]
