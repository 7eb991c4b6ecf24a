"""The Trainer: a model, its optimizer and its data, bound to a strategy.

    ctx = paratrain.init()
    model, optimizer, loader = paratrain.prepare(model, optimizer, loader)   # the loop is unchanged

or, for checkpoints that resume the same run and a progress line with the loss:

    trainer = paratrain.Trainer(model, optimizer, loader, checkpoint_dir="ckpt", checkpoint_every=100)
    for epoch in trainer.epochs(10):
        for x, y in trainer.loader:
            trainer.step(loss_fn(trainer.model(x), y))     # backward, optimizer step, zero_grad

How it works. The optimizer object is made distributed in place: its class becomes a subclass whose
`step()` counts micro-steps (gradient accumulation), lets the engine sync the gradients and then
steps (or, with the optimizer on the servers, copies the new weights in), and whose `zero_grad()`
keeps gradients between micro-steps. LR schedulers made afterwards wrap that step as usual. A forward
pre-hook on the model tells the engine whether this micro-step's backward must sync (the last one
does). Engines: LocalEngine (one process, or architecture "local"), CollectiveEngine (DDP or local
SGD; also the dense half of "hybrid"), PSEngine (train/ps.py), FSDPEngine (train/fsdp.py). Once
an engine has aggregated the gradient it calls the local step through GradientGate
(train/gradients.py: fp16's unscaling and overflow skip, clipping); the forward runs under the
strategy's autocast (train/precision.py), on the worker's device (docs/training.md).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader

from paratrain import checkpoint
from paratrain.checkpoint import sharded
from paratrain.cluster.context import current
from paratrain.data import ShardedLoader, first_rows, to_device
from paratrain.kvstore.consistency import Backup
from paratrain.metrics import MetricsLogger, NullMetrics, Progress, open_loggers
from paratrain.metrics.telemetry import peak_memory_bytes
from paratrain.train.api import Engine, EngineBase
from paratrain.train.gradients import GradientGate
from paratrain.train.jobdirs import job_defaults
from paratrain.train.observe import StepObserver
from paratrain.train.precision import DTYPES, Autocast, LossScaler
from paratrain.train.strategy import (
    Strategy,
    idle_servers_warning,
    kvstore_config,
    pipeline_config,
    resolve_strategy,
)

if TYPE_CHECKING:
    from paratrain.kvstore.worker.embedding import DistributedEmbedding

logger = logging.getLogger(__name__)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP and torch.compile wrappers (for state dicts)."""
    while True:
        inner = (
            getattr(model, "module", None) if isinstance(model, nn.parallel.DistributedDataParallel) else None
        )
        inner = inner or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def sparse_modules(model: nn.Module) -> list[DistributedEmbedding]:
    """Modules whose tables live on the servers and push their own gradients (kvstore.worker.embedding)."""
    found = [m for m in unwrap(model).modules() if getattr(m, "paratrain_sparse", False)]
    return cast("list[DistributedEmbedding]", found)


class LocalEngine(EngineBase):
    """No communication: one process, or workers that train independently (train/api.py: what
    an engine does)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model


class CollectiveEngine(LocalEngine):
    """All-reduce data parallel: DDP (gradients averaged in buckets during backward), local SGD, or
    top-k's compressed optimizer updates (collective/updates.py)."""

    local_sgd: Any = None
    updates: Any = None

    def __init__(self, model: nn.Module, strategy: Strategy, ctx: Any) -> None:
        from paratrain import collective
        from paratrain.cluster.rendezvous import init_torch_distributed

        init_torch_distributed(ctx, collective.backend_for(model))
        compression = strategy.compression_config
        if strategy.local_sgd_period:
            super().__init__(model)
            self.local_sgd = collective.LocalSGD(model, strategy.local_sgd_period)
        elif compression is not None and compression.sends_updates:
            from paratrain.collective.updates import CompressedUpdates

            super().__init__(model)  # no DDP: the optimizer's updates travel (collective/updates.py)
            self.updates = CompressedUpdates(model, compression)
        elif any(p.requires_grad for p in model.parameters()):
            super().__init__(
                collective.wrap_ddp(
                    model, bucket_mb=strategy.bucket_mb, compression=strategy.compression_config
                )
            )
        else:
            super().__init__(model)  # nothing dense to average (e.g. only sparse tables)

    def set_sync(self, sync: bool) -> None:
        if isinstance(self.model, nn.parallel.DistributedDataParallel):
            self.model.require_backward_grad_sync = sync

    def save(self, folder: Path) -> None:
        from paratrain.collective import compression

        compression.save(self.model, folder)  # this rank's error feedback, where compressed

    def restore(self, folder: Path) -> None:
        from paratrain.collective import compression

        compression.restore(self.model, folder)

    @property
    def per_worker_optimizer(self) -> bool:  # type: ignore[override]
        """Whether each rank's optimizer state is its own (then each saves it in a checkpoint)."""
        return self.local_sgd is not None or self.updates is not None

    def step(self, optimizer: torch.optim.Optimizer, local_step: Any) -> Any:
        if self.updates is not None:
            self.updates.before_step()
        result = local_step()
        if self.local_sgd is not None:
            self.local_sgd.after_step()
        if self.updates is not None:
            self.updates.after_step()
        return result


class _BeforeForward:
    """The model's forward pre-hook. It holds the trainer weakly and survives copy.deepcopy of the
    model (an EMA copy, say) as itself: the copy's forwards are not the trainer's and are ignored."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = weakref.ref(trainer)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        trainer = self.trainer()
        return None if trainer is None else trainer._before_forward(module, args, kwargs)

    def __deepcopy__(self, memo: dict) -> _BeforeForward:
        return self


def _make_distributed(optimizer: torch.optim.Optimizer, trainer: Trainer) -> None:
    """Swap `optimizer`'s class for a subclass whose step and zero_grad go through `trainer`."""
    base = type(optimizer)
    if getattr(base, "_paratrain_distributed", False):
        raise ValueError("this optimizer was already given to a paratrain Trainer")

    def step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
        return trainer._optimizer_step(lambda: base.step(self, closure))

    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        if trainer._micro == 0:  # keep the gradients accumulated over micro-steps
            base.zero_grad(self, set_to_none)

    optimizer.__class__ = type(
        base.__name__, (base,), {"step": step, "zero_grad": zero_grad, "_paratrain_distributed": True}
    )
    optimizer.trainer = trainer  # type: ignore[attr-defined]


class Trainer:
    """See the module docstring. `strategy`: a Strategy, its name (see Strategy.parse), or None for
    PARATRAIN_STRATEGY / the job's default. `loader`: a torch DataLoader (resharded for this worker)
    or a ShardedLoader. Checkpoints every `checkpoint_every` steps into `checkpoint_dir` (keeping the
    last `keep`); with `resume`, a run whose checkpoint_dir holds a checkpoint continues from it.
    Metrics (loss, samples/s, lr) go to `metrics_dir` as JSON lines and TensorBoard scalars, or to
    `loggers` (names: "jsonl", "tensorboard", "mlflow", "wandb", or MetricsLogger objects), from
    worker 0 (JSON lines stand in for a logger whose extra is missing), and a progress line there.
    In a submitted job (`paratrain submit`) checkpoint_dir and metrics_dir default to
    OUTPUT_DIR/checkpoints and OUTPUT_DIR/metrics, checkpoint_every to the spec's. With
    `trace_dir` (or `paratrain launch --trace DIR`), each worker writes a Chrome-trace timeline of
    its steps there (train/observe.py). `device`: where the model and every batch go (default: the
    worker's, ctx.device: its GPU where it has one, else the CPU). `async_checkpoints`: a sharded
    (fsdp) checkpoint's state is written in the background while training goes on, and committed
    once written (False: save_checkpoint waits for the write)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: DataLoader | ShardedLoader | None = None,
        *,
        strategy: str | Strategy | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int | None = None,
        keep: int = 3,
        resume: bool = True,
        metrics_dir: str | Path | None = None,
        loggers: Sequence[str | MetricsLogger] | None = None,
        log_every: int = 10,
        progress: bool = True,
        loss_fn: Any = None,
        seed: int = 0,
        ctx: Any = None,
        trace_dir: str | Path | None = None,
        device: str | torch.device | None = None,
        async_checkpoints: bool = True,
    ) -> None:
        self.ctx = current(ctx)
        self.strategy = resolve_strategy(strategy, self.ctx.num_servers, self.ctx.distributed)
        self.device = torch.device(device) if device is not None else self.ctx.device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL and the default CUDA stream follow it
        model.to(self.device)  # the same Parameter objects: the optimizer keeps them
        dtype = DTYPES[self.strategy.precision]
        self.autocast = Autocast(self.device.type, dtype) if dtype is not None else None
        scaler = LossScaler() if self.strategy.precision == "fp16" else None
        self.gate = GradientGate(scaler, self.strategy.clip_grad_norm)
        """Unscaling, the overflow check and clipping of the aggregated gradient (train/gradients.py)."""
        self.loss_fn = loss_fn
        self.pipelined = self.strategy.pipeline_stages > 1
        if self.pipelined and loss_fn is None:
            raise ValueError(
                f"Strategy.pipeline_stages={self.strategy.pipeline_stages} needs Trainer(loss_fn=...) and "
                "trainer.train_step(inputs, targets): the loss is computed on the last stage"
            )
        self.pipe: Any = None
        self._pending_optimizer_state: dict | None = None
        checkpoint_dir, metrics_dir, checkpoint_every = job_defaults(
            checkpoint_dir, metrics_dir, checkpoint_every
        )
        if checkpoint_every and checkpoint_dir is None:
            raise ValueError(f"checkpoint_every={checkpoint_every} needs a checkpoint_dir")
        self.rank, self.num_workers = self.ctx.rank, self.ctx.num_workers
        # Data parallel replicas: every worker, or in a pipeline the stages x replicas mesh's replicas
        # (rank q is stage q % stages of replica q // stages; a replica's stages read the same batches),
        # or under tensor parallelism the mesh's "dp" (a tensor-parallel group reads the same batches).
        stages = self.strategy.pipeline_stages if self.ctx.distributed else 1
        if self.num_workers % stages:
            raise ValueError(
                f"Strategy.pipeline_stages={stages} does not divide the job's {self.num_workers} workers"
            )
        group = stages
        if self.ctx.distributed and self.strategy.tensor_parallel > 1:
            from paratrain.train.mesh import mesh_dims

            group = mesh_dims(self.strategy, self.num_workers)["tp"]
        self.replicas, self.replica = self.num_workers // group, self.rank // group
        self.elastic = self.ctx.distributed and self.ctx.config.elastic is not None
        """Elastic workers (JobConfig.elastic): each epoch starts with the workers that are left."""
        if self.elastic and stages > 1:
            raise ValueError(f"Strategy.pipeline_stages={stages} cannot run with JobConfig.elastic")
        if isinstance(self.strategy.consistency, Backup) and (checkpoint_every or self.elastic):
            # Checkpoints and elastic epochs meet at a barrier after a number of steps; a worker
            # behind may first push to a round that the others, waiting there, never push.
            what = f"checkpoint_every={checkpoint_every}" if checkpoint_every else "JobConfig.elastic"
            raise ValueError(f"Strategy.consistency={self.strategy.consistency} cannot run with {what}")
        if self.ctx.joined and self.strategy.architecture == "ps" and self.strategy.update_on != "server":
            raise ValueError(
                f"Strategy.update_on={self.strategy.update_on!r}: a worker joining a running elastic job "
                "takes the weights from the servers, so they must run the optimizer (update_on='server')"
            )
        self.steps = 0
        """Optimizer steps taken (accumulation micro-steps count once)."""
        self._joined_in = False  # a joiner has met the others at an epoch's start
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every, self.keep, self.log_every = checkpoint_every, keep, log_every
        self.async_checkpoints = async_checkpoints
        self._saving: _Saving | None = None
        self._micro = 0
        self._samples = 0
        self._scalars: dict[str, float | torch.Tensor] = {}
        self.loader = self._shard(loader, seed)
        self.optimizer = optimizer
        found = checkpoint.latest(self.checkpoint_dir) if self.checkpoint_dir and resume else None
        if found is not None:  # first: DDP and the kvstore start from the restored values
            self._restore_local(found, model)
        self.engine = self._engine(model, optimizer)
        if found is not None:
            self.engine.restore(found.path)
            from paratrain.train import fsdp

            if fsdp.is_sharded(found):  # into the engine's model: fsdp's shards, or DDP's replica
                fsdp.load_state(found.path, self.engine.model, optimizer)
            self._log_resume(found.path)
        if self.engine.shards_gradients and self.gate.active:
            self.gate.agree = self._sum_over_workers
        self.observe = StepObserver(self.ctx, self.strategy, trace_dir, device=self.device)
        self._bind_model()
        _make_distributed(optimizer, self)
        self.sparse = sparse_modules(model)
        # Clipping takes the optimizer's parameters, as clip_grad_norm_(model.parameters()) does in
        # one process: a table's rows are no parameters (kvstore/worker/embedding.py), and its own
        # optimizer steps them unclipped, here as there.
        if self.sparse and self.gate.scaler is not None:
            raise ValueError(
                "Strategy.precision='fp16' with embedding tables on the servers: their rows' "
                "gradients are pushed and applied during backward, before the step's overflow check "
                "could skip them; use precision='bf16' (no loss scaling)"
            )
        if self.strategy.architecture == "hybrid":
            self._bind_tables()
        lead = self.rank == 0
        idle = idle_servers_warning(self.strategy, self.ctx.num_servers, len(self.sparse))
        if idle and lead and self.ctx.distributed:
            logger.warning(idle)
        wanted = lead and (metrics_dir is not None or loggers is not None)
        self.metrics = open_loggers(loggers, metrics_dir, rank=self.rank) if wanted else NullMetrics()
        if wanted:
            self.metrics.log_params({**self.strategy.as_dict(), "num_workers": self.num_workers})
        self.progress = Progress(enabled=progress and lead, initial=self.steps)

    def _bind_model(self) -> None:
        """Train the engine's model (again, when an elastic engine rebuilt it on a new group)."""
        self.model = self.engine.model
        self.model.register_forward_pre_hook(_BeforeForward(self), with_kwargs=True)
        # A pipeline's blocks get it instead; an fsdp engine casts with FSDP's own policy.
        if self.autocast is not None and not self.pipelined and not self.engine.handles_precision:
            self.autocast.attach(self.model)
        self.observe.attach(self.model)

    def _engine(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Engine:
        arch = self.strategy.architecture
        if not self.ctx.distributed or arch == "local" or self.pipelined:
            return LocalEngine(model)  # a pipeline syncs its stage replicas itself
        if arch == "fsdp":
            from paratrain.train import fsdp

            if self.elastic:
                raise ValueError("Strategy.architecture='fsdp' cannot run with JobConfig.elastic")
            if self.strategy.tensor_parallel > 1:
                from paratrain.train.tensor_parallel import MeshEngine

                return MeshEngine(model, optimizer, self.strategy, self.ctx)
            return fsdp.FSDPEngine(model, optimizer, self.strategy, self.ctx)
        if arch == "ps":
            from paratrain.train.ps import PSEngine

            return PSEngine(model, optimizer, self.strategy, self.ctx, scaler=self.gate.scaler)
        from paratrain.train.elastic import ElasticCollectiveEngine, elastic_enabled

        if elastic_enabled(self.ctx):
            return ElasticCollectiveEngine(model, self)
        return CollectiveEngine(model, self.strategy, self.ctx)  # collective, and hybrid's dense part

    def _bind_tables(self) -> None:
        """Hybrid: the embedding tables built without a kvstore of their own get one made with the
        strategy's consistency (train/strategy.py), before any forward needs it."""
        from paratrain.kvstore.worker.embedding import DistributedEmbedding, default_store

        config = kvstore_config(self.strategy)
        tables = [m for m in self.sparse if isinstance(m, DistributedEmbedding)]
        for module in tables:
            if not module.bound:
                module.bind(default_store(config, self.ctx))
            elif module.kv.config.policy != config.policy:
                logger.warning(
                    "table %r keeps its kvstore's consistency %r, not the strategy's %r (it was given "
                    "kv=, or ran a forward before the Trainer)",
                    module.key,
                    module.kv.config.consistency,
                    config.consistency,
                )

    def _shard(self, loader: Any, seed: int) -> ShardedLoader | None:
        if loader is None or isinstance(loader, ShardedLoader):
            return loader
        if isinstance(loader, DataLoader):
            loader = ShardedLoader.from_loader(
                loader, self.replicas, self.replica, seed, elastic=self.elastic
            )
        if isinstance(loader, ShardedLoader):
            loader.device = self.device
            return loader
        raise TypeError(f"loader must be a torch DataLoader or a ShardedLoader, not {type(loader).__name__}")

    # -- the training loop ------------------------------------------------------------------------
    def epochs(self, count: int) -> Iterator[int]:
        """The epochs left of `count` (all of them, unless the run resumed part-way). In an elastic
        job each epoch starts with the workers that are left (and those that joined)."""
        start = self.loader.epoch if self.loader is not None else 0
        if not self.elastic or self.engine.regroups_itself:
            for epoch in range(start, count):
                self.engine.before_epoch(self)
                yield epoch
        else:
            epoch = start
            while (epoch := self._start_epoch(epoch, count)) < count:
                yield epoch
                epoch += 1
        # The last checkpoint may still be written in the background: commit it here, so that a
        # script that ends without close() does not lose it.
        self._finish_save(wait=True)

    def _start_epoch(self, epoch: int, count: int) -> int:
        """Elastic: the live workers meet before each epoch (and once after the last), agree on it
        and divide its data among themselves (ShardedLoader.reshard). A joiner brings no epoch: it
        takes the others' (the job's end, where they are gone) and the servers' current weights."""
        joining = self.ctx.joined and not self._joined_in
        if joining and self.sparse:
            raise ValueError(
                "a worker cannot join a running job whose model has sparse tables yet (their rounds "
                "take no joiners); the job goes on without it"
            )
        arrived = self.ctx.barrier(name="elastic-epoch", data=None if joining else epoch)
        told = [value for value in arrived.values() if value is not None]
        if joining:
            self._joined_in = True
            epoch = max(told) if told else count
            logger.warning("worker %d joins the running job at epoch %d", self.rank, epoch)
            if epoch < count:
                self.engine.join()  # the others wait below: no round is in flight
        if len(told) < len(arrived) and told:
            self.ctx.barrier(name="elastic-joined")
        members = sorted(arrived)
        self.replicas, self.replica = len(members), members.index(self.rank)
        if self.loader is not None and epoch < count:
            self.loader.set_epoch(epoch)
            self.loader.reshard(self.replicas, self.replica)
        return epoch

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One training step on a batch with the Trainer's loss_fn, under any strategy: pipelined
        (the loss is returned on the last stage only, None elsewhere) or data parallel."""
        if self.loss_fn is None:
            raise ValueError("train_step needs Trainer(loss_fn=...)")
        if not self.pipelined:
            loss = self.loss_fn(self.model(inputs), to_device(targets, self.device))
            self.step(loss)
            return loss.detach()
        if self.pipe is None:
            self._build_pipeline(inputs)
        self._samples += inputs.shape[0]
        loss = self.pipe.step(inputs, targets)
        if loss is not None and self.gate.scaler is not None:
            loss = loss / self.gate.scaler.scale  # the pipeline's loss_fn scaled it for backward
        if loss is not None:
            self._scalars["loss"] = loss.detach()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    def eval_step(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The model's outputs for a batch, forward only (no autograd, the model in eval mode for
        the call), under any strategy. Pipelined, every worker calls it at the same point: the
        batch runs as micro-batches through the stages, and the outputs come back on the last
        stage (None on the others); the batch needs at least micro_batches rows."""
        if not self.pipelined:
            from paratrain.pipeline.stage import eval_mode

            with eval_mode(self.model), torch.no_grad():
                return self.model(inputs)
        if self.pipe is None:
            self._build_pipeline(inputs)
        return self.pipe.forward(inputs)

    def _build_pipeline(self, inputs: torch.Tensor) -> None:
        """Cut the model into stages (balanced on a micro-batch of the first batch) and keep only this
        stage's parameters in the optimizer (the same Parameter objects: the stage holds the blocks)."""
        from paratrain.pipeline import as_blocks, pipeline_for

        config = pipeline_config(self.strategy)
        sample = inputs[: max(1, inputs.shape[0] // config.micro_batches)]
        model = cast(nn.Sequential, unwrap(self.model))  # Strategy checked: a pipeline cuts a Sequential
        blocks = as_blocks(model)
        if self.autocast is not None:
            for i, block in enumerate(blocks):  # fp32 between blocks only where the loss is taken
                Autocast(self.autocast.device_type, self.autocast.dtype, i == len(blocks) - 1).attach(block)
        scaler = self.gate.scaler
        self.pipe = pipeline_for(
            model,
            config,
            loss_fn=self.loss_fn if scaler is None else scaler.scaled(self.loss_fn),
            sample_input=sample,
            ctx=self.ctx,
            device=self.device,
        )
        if self.ctx.num_workers > 1 and self.gate.active:
            self.gate.agree = self._agree_over_stages
        mine = {id(p) for p in self.pipe.module.parameters()}
        for group in self.optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in mine]
        if self._pending_optimizer_state is not None:
            self.optimizer.load_state_dict(self._pending_optimizer_state)
            self._pending_optimizer_state = None

    def _agree_over_stages(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over a pipeline's stages (all-reduced over every worker, divided by the
        replicas, which hold the same averaged gradients): GradientGate.agree."""
        return self._sum_over_workers(values) / self.replicas

    def _sum_over_workers(self, values: torch.Tensor) -> torch.Tensor:
        """`values` (a small CPU tensor) all-reduced over every worker (GradientGate.agree where
        each worker holds a shard of the gradient)."""
        import torch.distributed as dist

        comm = values.to(self.device) if dist.get_backend() == "nccl" else values.clone()
        dist.all_reduce(comm)
        return comm.cpu()

    def step(self, loss: torch.Tensor) -> None:
        """backward, optimizer step (every accumulation_steps calls) and zero_grad; logs the loss."""
        scaler = self.gate.scaler
        try:
            with self.observe.backward():
                (loss if scaler is None else scaler.scale_loss(loss)).backward()
        except Exception as error:
            if not self.engine.recover(self, error):
                raise
            return  # the step's gradients died with the old all-reduce group
        self._scalars["loss"] = loss.detach()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def log(self, **scalars: float | torch.Tensor) -> None:
        """Scalars for the progress line and the metrics of the next optimizer step."""
        self._scalars.update(scalars)

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if module is not self.model:
            return None
        if torch.is_grad_enabled() and module.training:
            self.engine.set_sync(self._micro == self.strategy.accumulation_steps - 1)
            # model(x), model(batch_dict) or model(**batch): the first tensor's rows are the samples
            self._samples += first_rows((args, kwargs)) or 0
        if self.device.type == "cpu":
            return None
        return to_device(args, self.device), to_device(kwargs, self.device)

    def _optimizer_step(self, local_step: Any) -> Any:
        k = self.strategy.accumulation_steps
        self._micro += 1
        if self._micro < k:
            return None
        self._micro = 0
        for module in self.sparse:
            module.flush()  # their gradients were pushed during backward
        if k > 1 and not self.engine.scales_gradients:
            with torch.no_grad():
                for group in self.optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.div_(k)
        if self.gate.active:
            base_step = local_step
            local_step = lambda: self.gate.step(self.optimizer, base_step)  # noqa: E731
        with self.observe.optimizer():
            result = self.engine.step(self.optimizer, local_step)
        self.steps += 1
        self.engine.after_step(self)
        self._after_step()
        return result

    def _after_step(self) -> None:
        self._scalars.update(self.gate.scalars())
        scalars = {k: float(v) for k, v in self._scalars.items()}
        samples, self._samples = self._samples * self.replicas, 0
        memory = peak_memory_bytes(self.device) if self.progress.enabled else None
        self.progress.update(steps=1, samples=samples, memory_bytes=memory, **scalars)
        data_s = self.loader.take_wait_s() if self.loader is not None else 0.0
        self.observe.step_done(samples // self.replicas, scalars.get("loss"), self.engine, data_s)
        if self.steps % self.log_every == 0:
            rate = self.progress.samples_per_s
            lr = self.optimizer.param_groups[0].get("lr")
            extra = {"samples_per_s": rate} if rate else {}
            self.metrics.log(
                self.steps, {**scalars, **extra, **({"lr": float(lr)} if lr is not None else {})}
            )
        if self._saving is not None:
            self._finish_save(wait=False)
        if self.checkpoint_every and self.steps % self.checkpoint_every == 0:
            self.save_checkpoint()

    # -- checkpoints ------------------------------------------------------------------------------
    def _per_worker_model(self) -> bool:
        """Whether workers' parameters may differ (then each saves its own)."""
        return self.strategy.architecture == "local" or bool(self.strategy.local_sgd_period) or self.pipelined

    def save_checkpoint(self) -> Path | None:
        """Every worker calls it (the Trainer does, every checkpoint_every steps); returns the
        checkpoint's folder on worker 0 once committed (None while a background write goes on:
        `checkpoint_in_flight`). Between micro-steps it refuses."""
        if self.checkpoint_dir is None:
            raise ValueError("save_checkpoint needs the Trainer's checkpoint_dir")
        if self._micro:
            raise ValueError("save_checkpoint between accumulation micro-steps would lose gradients")
        self._finish_save(wait=True)  # one background write at a time
        folder = checkpoint.staging_dir(self.checkpoint_dir, self.steps)
        written = self.engine.save(folder)
        worker: dict[str, Any] = {
            "steps": self.steps,
            "loader": self.loader.state_dict() if self.loader is not None else None,
            "rng": {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])},
        }
        if self.gate.scaler is not None:
            worker["loss_scale"] = self.gate.scaler.state_dict()
        own = self._per_worker_model()
        if not self.engine.sharded_state and (own or self.rank == 0):
            state = {"model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict()}
            if own:
                worker.update(state)
            else:
                checkpoint.save_file(folder / "model.pt", state)
        if not own and self.engine.per_worker_optimizer:
            worker["optimizer"] = self.optimizer.state_dict()  # top-k: each worker steps its own
        checkpoint.save_file(folder / f"worker-{self.rank}.pt", worker)
        self.ctx.barrier(name=f"checkpoint-{self.steps}")
        commit = None
        if self.rank == 0:
            meta = {"strategy": self.strategy.as_dict(), "num_workers": self.num_workers}
            meta["metrics"] = {name: float(value) for name, value in self._scalars.items()}
            root, step = self.checkpoint_dir, self.steps
            commit = functools.partial(checkpoint.commit, root, step, meta, keep=self.keep)
        if written is None:
            return commit() if commit is not None else None
        self._saving = _Saving(written, folder, self.steps, commit)
        return self._finish_save(wait=not self.async_checkpoints)

    @property
    def checkpoint_in_flight(self) -> int | None:
        """The step of a checkpoint whose state is still being written in the background, or None."""
        return self._saving.step if self._saving is not None else None

    def _finish_save(self, wait: bool) -> Path | None:
        """A background write that is done (waited for, with `wait`): worker 0 commits it. Worker 0's
        write is done once every worker's is (sharded.finished)."""
        saving = self._saving
        if saving is None or not (wait or saving.written.done()):
            return None
        self._saving = None
        sharded.finished(saving.written, saving.folder)
        return saving.commit() if saving.commit is not None else None

    def _restore_local(self, found: checkpoint.Checkpoint, model: nn.Module) -> None:
        from paratrain.train import fsdp

        if fsdp.is_sharded(found):  # the model and optimizer load once the engine has sharded them
            return fsdp.restore_worker(self, found)
        if found.meta.get("num_workers") != self.num_workers:
            raise checkpoint.CheckpointError(
                f"checkpoint {found.path} was taken with {found.meta.get('num_workers')} workers; this job "
                f"has {self.num_workers} (resuming the same run needs the same number)"
            )
        worker = checkpoint.load_file(found.file(f"worker-{self.rank}.pt"))
        state = worker if self._per_worker_model() else checkpoint.load_file(found.file("model.pt"))
        unwrap(model).load_state_dict(state["model"])
        optimizer = worker.get("optimizer", state["optimizer"])  # a worker's own, where it has one
        if self.pipelined:  # saved with this stage's parameters only: loaded once the stage is cut
            self._pending_optimizer_state = optimizer
        else:
            self.optimizer.load_state_dict(optimizer)
        self.steps = worker["steps"]
        if self.gate.scaler is not None and "loss_scale" in worker:
            self.gate.scaler.load_state_dict(worker["loss_scale"])
        if self.loader is not None and worker["loader"] is not None:
            self.loader.load_state_dict(worker["loader"])
        torch.set_rng_state(worker["rng"]["torch"])
        python = random.getstate()
        random.setstate((python[0], tuple(worker["rng"]["python"]), python[2]))

    def _log_resume(self, path: Path) -> None:
        """Say once per job (worker 0; a warning, which the default logging shows) that this run
        continues another: a stale checkpoint_dir would otherwise resume without a word."""
        where = f" (epoch {self.loader.epoch}, batch {self.loader.batches_done})" if self.loader else ""
        log = logger.warning if self.rank == 0 else logger.info
        log("resumed from checkpoint %s at step %d%s", path, self.steps, where)

    def close(self) -> None:
        """Commit a checkpoint still being written, stop the progress line, flush metrics, leave
        the servers' rounds."""
        self._finish_save(wait=True)
        self.progress.close()
        self.metrics.close()
        self.engine.close()


@dataclasses.dataclass(frozen=True)
class _Saving:
    """A checkpoint whose engine state is being written in the background."""

    written: Future
    folder: Path
    step: int
    commit: Callable[[], Path] | None
    """Worker 0's commit of the checkpoint, once written; None on the other workers."""


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader | ShardedLoader | None = None,
    **options: Any,
) -> tuple:
    """(model, optimizer, loader) ready for an unchanged training loop, or (model, optimizer) without a
    loader. `options` are the Trainer's (strategy=..., ...). A pipeline strategy is refused here,
    before anything starts: its stages need the loss and the step (Trainer.train_step)."""
    ctx = current(options.get("ctx"))
    stages = resolve_strategy(options.get("strategy"), ctx.num_servers, ctx.distributed).pipeline_stages
    if stages > 1:
        raise ValueError(
            f"Strategy.pipeline_stages={stages} cannot run under paratrain.prepare(): an unchanged loop "
            "calls the whole model; use Trainer(model, optimizer, loader, loss_fn=...) and "
            "trainer.train_step(inputs, targets)"
        )
    trainer = Trainer(model, optimizer, loader, **options)
    return (trainer.model, trainer.optimizer) + ((trainer.loader,) if loader is not None else ())
