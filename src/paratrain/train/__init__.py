"""The user-facing layer: a Strategy says how the work is split; a Trainer (or `prepare`) binds a model,
its optimizer and its data to it. See trainer.py for how, strategy.py for the choices."""

from __future__ import annotations

from paratrain.train.strategy import NAMED, Strategy, kvstore_config, pipeline_config, resolve_strategy
from paratrain.train.trainer import Trainer, prepare, unwrap

__all__ = [
    "NAMED",
    "Strategy",
    "Trainer",
    "kvstore_config",
    "pipeline_config",
    "prepare",
    "resolve_strategy",
    "unwrap",
]
