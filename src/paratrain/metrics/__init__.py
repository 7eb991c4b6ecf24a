"""Metrics and progress: one small logging interface (null, JSON lines, TensorBoard) and the
terminal progress display. Imports no other paratrain layer; TensorBoard is imported only when a
`TensorBoardMetrics` is made."""

from __future__ import annotations

from paratrain.metrics.api import MetricsLogger, MultiMetrics, NullMetrics, open_metrics
from paratrain.metrics.jsonl import JsonLinesMetrics
from paratrain.metrics.progress import Progress
from paratrain.metrics.tensorboard import TensorBoardMetrics

__all__ = [
    "JsonLinesMetrics",
    "MetricsLogger",
    "MultiMetrics",
    "NullMetrics",
    "Progress",
    "TensorBoardMetrics",
    "open_metrics",
]
