"""The user-facing layer: a Strategy says how the work is split; a Trainer (or `prepare`) binds a model,
its optimizer and its data to it. See trainer.py for how, strategy.py for the choices."""

from __future__ import annotations

from paratrain.train.strategy import NAMED, Strategy, resolve_strategy
from paratrain.train.trainer import Trainer, prepare, unwrap

__all__ = ["NAMED", "Strategy", "Trainer", "prepare", "resolve_strategy", "unwrap"]
