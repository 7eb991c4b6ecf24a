"""What the Trainer calls on its engine: the `Engine` protocol, and `EngineBase`, its defaults.

An engine is how one strategy moves gradients and state between workers (trainer.py's LocalEngine
and CollectiveEngine, ps.py's PSEngine, elastic.py's ElasticCollectiveEngine). The Trainer calls
every member below on whichever engine it made, and nothing else; an engine that has nothing to do
at a hook inherits EngineBase's no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from paratrain.train.trainer import Trainer


class Engine(Protocol):
    model: nn.Module
    """The model as the engine runs it (DDP-wrapped, for one): the Trainer's forward calls it."""

    # Read-only properties: an engine may answer with a class attribute, an instance attribute or
    # a property of its own.
    @property
    def scales_gradients(self) -> bool:
        """Whether the engine divides accumulated gradients by accumulation_steps itself."""
        ...

    @property
    def regroups_itself(self) -> bool:
        """Whether the engine follows an elastic job's membership itself (then the Trainer's epochs
        do not meet at the scheduler)."""
        ...

    @property
    def per_worker_optimizer(self) -> bool:
        """Whether each worker's optimizer state is its own (then each saves it in a checkpoint)."""
        ...

    @property
    def sharded_state(self) -> bool:
        """Whether the engine saves the model and optimizer itself, sharded (then the Trainer writes
        no model.pt)."""
        ...

    @property
    def handles_precision(self) -> bool:
        """Whether the engine runs the strategy's precision itself (FSDP's mixed precision policy):
        then the Trainer puts no autocast around the forward."""
        ...

    @property
    def shards_gradients(self) -> bool:
        """Whether each worker's `.grad` holds only its shard of the aggregated gradient: then the
        Trainer's overflow check and clipping norm are summed over the workers."""
        ...

    def set_sync(self, sync: bool) -> None:
        """Whether this micro-batch's backward sends gradients (the last of an accumulation)."""
        ...

    def step(self, optimizer: torch.optim.Optimizer, local_step: Callable[[], Any]) -> Any:
        """One optimizer step; `local_step` is the optimizer's own, which the engine runs."""
        ...

    def after_step(self, trainer: Trainer) -> None:
        """After every optimizer step (the elastic engine commits its state here)."""
        ...

    def before_epoch(self, trainer: Trainer) -> None:
        """Before every epoch of Trainer.epochs (the elastic engine re-divides the data here)."""
        ...

    def join(self) -> None:
        """This worker joined a running elastic job, while the others wait at a barrier."""
        ...

    def recover(self, trainer: Trainer, error: BaseException) -> bool:
        """Whether the engine recovered from `error`, raised in backward (then the step is skipped)."""
        ...

    def save(self, folder: Path) -> Future | None:
        """This worker's engine state into the staging checkpoint `folder`. A future where the
        write goes on in the background: the Trainer commits the checkpoint once it is done."""
        ...

    def restore(self, folder: Path) -> None: ...

    def close(self) -> None: ...


class EngineBase:
    """Engine's defaults: no hook does anything, no flag is set."""

    model: nn.Module
    scales_gradients = False
    regroups_itself = False
    per_worker_optimizer = False
    sharded_state = False
    handles_precision = False
    shards_gradients = False

    def set_sync(self, sync: bool) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer, local_step: Callable[[], Any]) -> Any:
        return local_step()

    def after_step(self, trainer: Trainer) -> None:
        pass

    def before_epoch(self, trainer: Trainer) -> None:
        pass

    def join(self) -> None:
        pass

    def recover(self, trainer: Trainer, error: BaseException) -> bool:
        return False

    def save(self, folder: Path) -> Future | None:
        return None

    def restore(self, folder: Path) -> None:
        pass

    def close(self) -> None:
        pass
