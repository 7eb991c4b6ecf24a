"""The fsdp strategy's engine, and the Trainer's sharded checkpoints.

Under Strategy(architecture="fsdp") the model is sharded by torch's FSDP2 (collective/fsdp.py):
gradients are reduce-scattered (averaged over the workers) by fully_shard's own backward hooks, and
the optimizer steps each worker's shards. A checkpoint holds the model and optimizer state once,
sharded, in its `sharded/` folder (torch.distributed.checkpoint, checkpoint/sharded.py), beside each
worker's own file (steps, data position, random state). Such a checkpoint loads into any number of
fsdp workers, into DDP or into one process: DCP reshards on load, and the data position is carried
over in samples (`resharded_loader_state`). The sharded state is written in the background while
training goes on; the Trainer commits the checkpoint once the write is complete.
"""

from __future__ import annotations

import logging
import random
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from paratrain import checkpoint
from paratrain.checkpoint import sharded
from paratrain.train.precision import DTYPES
from paratrain.train.trainer import LocalEngine

if TYPE_CHECKING:
    from paratrain.train.strategy import Strategy
    from paratrain.train.trainer import Trainer

logger = logging.getLogger(__name__)

SHARDED = sharded.FOLDER
"""The folder of a checkpoint that holds the sharded model and optimizer state."""


class FSDPEngine(LocalEngine):
    """fully_shard's model; gradient sync is FSDP's (skipped on accumulation's non-final micro-steps)."""

    sharded_state = True
    """The Trainer saves no model.pt: this engine writes the model and optimizer sharded (`save`)."""
    handles_precision = True
    """Strategy.precision is FSDP's MixedPrecisionPolicy (collective/fsdp.py), not autocast."""
    shards_gradients = True

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy, ctx: Any
    ) -> None:
        from paratrain.cluster.rendezvous import init_torch_distributed
        from paratrain.collective import backend_for
        from paratrain.collective.fsdp import shard_model

        init_torch_distributed(ctx, backend_for(model))
        blocks = strategy.fsdp_blocks.split() if strategy.fsdp_blocks else ()
        param_dtype = DTYPES[strategy.precision]
        reduce_dtype = DTYPES[strategy.reduce_precision] or (torch.float32 if param_dtype else None)
        sharded_model = shard_model(
            model,
            optimizer,
            blocks=blocks,
            reshard_after_forward=strategy.reshard_after_forward,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
        )
        super().__init__(sharded_model)
        self.optimizer = optimizer
        self._checkpoint_group: Any = None
        """Gloo, for the background writes' collectives (sharded.save_async)."""

    def set_sync(self, sync: bool) -> None:
        cast(FSDPModule, self.model).set_requires_gradient_sync(sync)

    def save(self, folder: Path) -> Future:
        if self._checkpoint_group is None:  # every worker saves at the same step: a collective is safe
            self._checkpoint_group = dist.new_group(backend="gloo")
        return save_state(folder, self.model, self.optimizer, self._checkpoint_group)


def save_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, group: Any = None) -> Future:
    """Every worker writes its shards of the model's and the optimizer's state into folder/sharded,
    in the background (sharded.save_async, on the Gloo process group `group`): the future is done
    once they are written. An optimizer that has not stepped is left out: torch's get_state_dict
    would take a step (at lr 0) to create its state, which changes Adam's step count."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer.state:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
    else:
        state = {"model": get_model_state_dict(model)}
    return sharded.save_async(folder / SHARDED, state, group)


def load_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The model and optimizer (sharded or not, any number of workers) take the state in folder/sharded."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    saved = sharded.SafeReader(folder / SHARDED).read_metadata().state_dict_metadata
    if any(key.startswith("optimizer.") for key in saved):
        model_state, optimizer_state = get_state_dict(model, optimizer)
        _add_saved_group_keys(optimizer_state, saved)
        state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
        sharded.load(folder / SHARDED, state)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        state = {"model": get_model_state_dict(model)}  # saved before the optimizer's first step
        sharded.load(folder / SHARDED, state)
        set_model_state_dict(model, state["model"])


def _add_saved_group_keys(optimizer_state: dict[str, Any], saved: dict[str, Any]) -> None:
    """Parameter-group entries that the checkpoint holds and a fresh optimizer lacks (an LR
    scheduler's initial_lr) join the state to fill: DCP loads only the keys it is given."""
    groups = optimizer_state["param_groups"]
    for key in saved:
        path = key.split(".", 3)
        if path[:2] == ["optimizer", "param_groups"] and len(path) == 4 and int(path[2]) < len(groups):
            groups[int(path[2])].setdefault(path[3], None)


def is_sharded(found: checkpoint.Checkpoint) -> bool:
    return sharded.is_sharded(found.path / SHARDED)


def restore_worker(trainer: Trainer, found: checkpoint.Checkpoint) -> None:
    """A worker's own part of a sharded checkpoint: steps, data position, random state. Saved by
    another number of workers, it takes worker 0's, with the data position moved to this job's
    division of the same samples."""
    if trainer.pipelined or trainer.strategy.architecture in ("ps", "hybrid"):
        raise checkpoint.CheckpointError(
            f"checkpoint {found.path} is sharded (saved under fsdp); it loads under fsdp, collective "
            f"or local, not architecture={trainer.strategy.architecture!r} with "
            f"pipeline_stages={trainer.strategy.pipeline_stages}"
        )
    same = found.meta.get("num_workers") == trainer.num_workers
    worker = checkpoint.load_file(found.file(f"worker-{trainer.rank if same else 0}.pt"))
    trainer.steps = worker["steps"]
    if trainer.loader is not None and worker["loader"] is not None:
        trainer.loader.load_state_dict(resharded_loader_state(worker["loader"], trainer.loader.state_dict()))
    torch.set_rng_state(worker["rng"]["torch"])
    python = random.getstate()
    random.setstate((python[0], tuple(worker["rng"]["python"]), python[2]))


def resharded_loader_state(saved: dict, own: dict) -> dict:
    """`saved` (a ShardedLoader's state, maybe from another number of replicas) as this loader's.
    Replica r takes every R-th sample of one epoch order, so the samples the old replicas had read
    together are the first `batches x batch_size x num_replicas` of that order; the new replicas
    continue there when that count is a whole number of their global batches."""
    if saved.get("num_replicas") == own["num_replicas"]:
        return saved
    taken = saved["batches"] * saved["batch_size"] * saved["num_replicas"]
    global_batch = own["batch_size"] * own["num_replicas"]
    if taken % global_batch:
        raise checkpoint.CheckpointError(
            f"the checkpoint's data position ({saved['batches']} batches of {saved['batch_size']} on "
            f"{saved['num_replicas']} workers) is not a whole number of this job's global batches "
            f"({own['batch_size']} x {own['num_replicas']})"
        )
    logger.info("data position carried from %d to %d workers", saved["num_replicas"], own["num_replicas"])
    return {**own, "epoch": saved["epoch"], "batches": taken // global_batch}
