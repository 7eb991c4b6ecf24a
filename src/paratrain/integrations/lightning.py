"""A Lightning `Strategy` that trains a LightningModule with any paratrain strategy.

    ctx = paratrain.init()                       # servers and the scheduler serve in here
    trainer = lightning.pytorch.Trainer(strategy=ParatrainStrategy("dist_async"), max_epochs=5)
    trainer.fit(module, loader)                  # paratrain launch -w 4 -s 2 train.py

How it works: Lightning builds the module's optimizer (`configure_optimizers`), then `setup` hands
module and optimizer to a paratrain `Trainer` (train/trainer.py), which binds the engine as for any
script: parameter servers (ps, dist_sync, dist_async: gradients pushed during backward, weights
pulled), DDP (collective), or both (hybrid). Lightning's optimizer step runs its closure (the
training step and backward) first, then paratrain's step, which syncs and steps. Each worker reads
its own part of the data (Lightning's DistributedSampler with paratrain's ranks). Lightning's
barriers, broadcasts and reductions go through torch.distributed where the strategy has a process
group (collective, hybrid), else through the scheduler's barriers (small values: msgpack, never
pickle).

Not supported (refused with a message): several optimizers, Lightning's `accumulate_grad_batches`
(use Strategy(accumulation_steps=...) in a plain loop), pipeline stages.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor

from paratrain.cluster.context import Context, current
from paratrain.train import Strategy
from paratrain.train import Trainer as ParatrainTrainer

logger = logging.getLogger(__name__)

REDUCE_OPS: dict[str, Callable[[Tensor], Tensor]] = {
    "sum": lambda t: t.sum(0),
    "mean": lambda t: t.mean(0),
    "avg": lambda t: t.mean(0),
    "max": lambda t: t.max(0).values,
    "min": lambda t: t.min(0).values,
}


class ParatrainStrategy(ParallelStrategy):
    """Lightning's Strategy for a paratrain job. `strategy`: a paratrain Strategy or its name ("ps",
    "dist_sync", "dist_async", "collective", "hybrid", ...; None: the launch's, as for Trainer);
    `ctx`: the job's Context (None: `paratrain.init()`'s)."""

    strategy_name = "paratrain"

    def __init__(self, strategy: str | Strategy | None = None, *, ctx: Context | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.ctx = current(ctx)
        self.paratrain_strategy = strategy
        self.trainer_: ParatrainTrainer | None = None
        """The paratrain Trainer bound while fitting: its engine syncs the optimizer's steps."""
        self._calls = 0

    # -- who is where ---------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return self.ctx.rank

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return self.ctx.num_workers

    @property
    def is_distributed(self) -> bool:
        """Lightning gives every worker its own part of the data when this is true."""
        return self.ctx.distributed and self.ctx.num_workers > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def root_device(self) -> torch.device:
        if self.accelerator is not None and type(self.accelerator).__name__ == "CUDAAccelerator":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup_environment(self) -> None:
        # Lightning's own way to set who prints: an attribute its decorator reads (not typed).
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # Lightning's rank-0-only output
        super().setup_environment()

    # -- training -------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"ParatrainStrategy: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is "
                "not supported; every optimizer step syncs the workers"
            )
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if len(self.optimizers) != 1:
            raise ValueError(
                "ParatrainStrategy trains with one optimizer; configure_optimizers gave "
                f"{len(self.optimizers)}"
            )
        assert self.lightning_module is not None  # Lightning's setup connected it
        self.trainer_ = ParatrainTrainer(
            self.lightning_module,
            self.optimizers[0],
            strategy=self.paratrain_strategy,
            progress=False,
            ctx=self.ctx,
        )
        if self.trainer_.pipelined:
            raise ValueError("ParatrainStrategy does not cut a LightningModule into pipeline stages")
        self.model = self.trainer_.model  # DDP for collective and hybrid: Lightning calls through it
        logger.info(
            "Lightning trains under %s on worker %d of %d",
            self.trainer_.strategy,
            self.global_rank,
            self.world_size,
        )

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        # paratrain's optimizer syncs the gradients before it steps, so they must exist by then:
        # the closure (training step, backward) runs first, then the step without it.
        model = model or self.lightning_module
        return self.precision_plugin.optimizer_step(
            _ClosureFirst(optimizer, self), model=model, closure=closure, **kwargs
        )

    def teardown(self) -> None:
        if self.trainer_ is not None:
            self.trainer_.close()
            self.trainer_ = None
        super().teardown()

    # -- collectives ----------------------------------------------------------------------------
    def _process_group(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _exchange(self, what: str, data: Any) -> dict[int, Any]:
        """Every worker's `data` (msgpack-able), by rank, through the scheduler."""
        self._calls += 1
        return self.ctx.barrier(name=f"lightning-{what}-{self._calls}", data=data)

    def barrier(self, name: str | None = None) -> None:
        if self.is_distributed:
            self._exchange("barrier", None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.is_distributed:
            return obj
        sent = self._exchange("broadcast", obj if self.global_rank == src else None)
        return sent[src]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor) or not self.is_distributed:
            return tensor
        op = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
        if op not in REDUCE_OPS:
            raise ValueError(
                f"ParatrainStrategy.reduce: reduce_op={reduce_op!r} is not one of {sorted(REDUCE_OPS)}"
            )
        return REDUCE_OPS[op](self._gathered(tensor)).to(tensor.dtype)

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        if not self.is_distributed:
            return tensor.unsqueeze(0)
        return self._gathered(tensor)

    def _gathered(self, tensor: Tensor) -> Tensor:
        """Every worker's `tensor`, stacked in rank order (on this tensor's device)."""
        if self._process_group():
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(parts, tensor.contiguous())
            return torch.stack(parts)
        values = self._exchange("gather", tensor.detach().cpu().double().tolist())
        stacked = torch.tensor([values[rank] for rank in sorted(values)], dtype=torch.float64)
        return stacked.to(tensor.device)


class _ClosureFirst:
    """The optimizer as Lightning's precision plugin sees it: `step(closure)` runs the closure,
    notes its loss for paratrain's telemetry, then steps the paratrain optimizer."""

    def __init__(self, optimizer: Any, strategy: ParatrainStrategy) -> None:
        self._optimizer, self._strategy = optimizer, strategy

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        trainer = self._strategy.trainer_
        if trainer is not None and isinstance(result, Tensor) and result.numel() == 1:
            trainer.log(loss=result.detach())
        self._optimizer.step(**kwargs)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)
