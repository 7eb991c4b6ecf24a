"""Where a Trainer's steps go: the dashboard's figures and the timeline's ranges.

The Trainer calls `forward_begin`/`forward_end` (its model's hooks), `backward()` and `optimizer()`
(ranges) and `step_done` once per optimizer step. A step's time is split into compute (forward,
backward, the optimizer, and the loop's own work), data (the loop waiting on the ShardedLoader for
its next batch, measured there), communication (handing buckets to the kvstore: engines count it
in `communication_s`) and waiting (for a round's pulls: `waiting_s`; under DDP, the end of
backward blocked on the all-reduce, after its last bucket went); the figures are cumulative
counters read on the heartbeat (metrics/telemetry.py).

Why DDP's wait is its own phase: every rank's step takes the slowest rank's time (the others wait
for its buckets in the all-reduce), so a slow rank shows only in where the time goes. A comm hook
notes when the step's last bucket went to all-reduce; the rest of backward is waiting, for the
slowest rank's gradients mostly, so a fast rank's compute stays its own and the scheduler can
name the slow one (cluster/stragglers.py). Without a hook of ours (compression has its own) DDP's
wait counts as compute.
With a trace folder, every range also goes to this process's timeline (metrics/trace.py), on the
scheduler's clock; DDP's bucket all-reduces get ranges through the same comm hook.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from paratrain.metrics.telemetry import worker_telemetry
from paratrain.metrics.trace import open_tracer, tracer


class StepObserver:
    def __init__(
        self, ctx: Any, strategy: Any, trace_dir: str | Path | None = None, device: torch.device | None = None
    ) -> None:
        self.telemetry = worker_telemetry()
        self.telemetry.device = device  # where the heartbeat's peak memory is measured
        self.telemetry.strategy = _describe(strategy) if getattr(ctx, "distributed", False) else "local"
        if trace_dir is not None:
            link = getattr(ctx, "link", None)
            offset = link.clock_offset() if link is not None else 0.0
            open_tracer(trace_dir, role="worker", rank=ctx.rank, clock_offset_s=offset)
        self.tracer = tracer()
        self._step_start = time.perf_counter()
        self._forward_start = 0.0
        self._in_backward = False
        """Whether Trainer.step's own backward range is open (then the hooks add none)."""
        self._all_reduce = _AllReduceClock(self.tracer)
        self._all_reduce_wait_s = 0.0
        """Since the last step_done: the time backward was blocked on DDP's all-reduce."""

    def attach(self, model: nn.Module) -> None:
        """The all-reduce clock on a DDP model; while tracing, forward ranges from hooks too."""
        if isinstance(model, nn.parallel.DistributedDataParallel) and model._comm_hooks == []:
            model.register_comm_hook(self._all_reduce, _clocked_all_reduce)
        if not self.tracer.enabled:
            return
        model.register_forward_pre_hook(_Hook(self.forward_begin))
        model.register_forward_hook(_Hook(self.forward_end))

    def forward_begin(self, *_: Any) -> None:
        self._forward_start = self.tracer.begin()

    def forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._forward_start:
            self.tracer.add("forward", self._forward_start, self.tracer.begin() - self._forward_start)
        if module.training and torch.is_grad_enabled():
            self._watch_backward(output)

    def _watch_backward(self, output: Any) -> None:
        """A backward range for a loop that calls loss.backward() itself (`prepare`): from the
        first gradient reaching the model's output to the end of that backward pass (autograd
        runs a queued callback there)."""
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        began: list[float] = []

        def ended() -> None:
            self.tracer.add("backward", began[0], self.tracer.begin() - began[0])

        def begin(grad: torch.Tensor) -> None:
            if not began and not self._in_backward:
                began.append(self.tracer.begin())
                torch.autograd.Variable._execution_engine.queue_callback(ended)

        for tensor in tensors:
            tensor.register_hook(begin)

    @contextmanager
    def backward(self) -> Iterator[None]:
        self._in_backward = True
        self._all_reduce.launched = 0.0
        try:
            with self.tracer.range("backward"):
                yield
        finally:
            self._in_backward = False
            if self._all_reduce.launched:  # the rest of backward waited for the all-reduce
                self._all_reduce_wait_s += time.perf_counter() - self._all_reduce.launched

    def optimizer(self) -> AbstractContextManager[None]:
        return self.tracer.range("optimizer step")

    def step_done(self, samples: int, loss: float | None, engine: Any, data_s: float = 0.0) -> None:
        now = time.perf_counter()
        wall, self._step_start = now - self._step_start, now
        communication = getattr(engine, "communication_s", 0.0)
        waiting = getattr(engine, "waiting_s", 0.0)
        if communication or waiting:
            engine.communication_s = engine.waiting_s = 0.0
        waiting, self._all_reduce_wait_s = waiting + self._all_reduce_wait_s, 0.0
        self.telemetry.step_done(
            samples=samples,
            loss=loss,
            compute_s=wall - communication - waiting - data_s,
            communication_s=communication,
            waiting_s=waiting,
            data_s=data_s,
        )


class _Hook:
    """A model hook that survives copy.deepcopy of the model as itself (see trainer._BeforeForward)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> None:
        self.fn(*args)

    def __deepcopy__(self, memo: dict) -> _Hook:
        return self


class _AllReduceClock:
    """The comm hook's state: when this backward's last bucket went to all-reduce (perf_counter;
    0.0: none yet), and the tracer that gets each all-reduce's range while tracing."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self.launched = 0.0


def _clocked_all_reduce(state, bucket):  # noqa: ANN001, ANN201 (DDP checks real annotations, not strings)
    """DDP's default all-reduce (mean), noting when it went; while tracing, a range from its start
    to its completion."""
    import torch.distributed as dist

    state.launched = time.perf_counter()
    tracer = state.tracer
    start = tracer.begin() if tracer.enabled else 0.0
    tensor = bucket.buffer().div_(dist.get_world_size())
    future = dist.all_reduce(tensor, async_op=True).get_future()

    def done(fut: Any) -> Any:
        if tracer.enabled:
            size = {"bytes": tensor.numel() * tensor.element_size()}
            tracer.add("all_reduce", start, tracer.begin() - start, size)
        return fut.value()[0]

    return future.then(done)


def _describe(strategy: Any) -> str:
    if strategy is None:
        return "local"
    parts = [strategy.architecture, str(strategy.consistency)]
    if strategy.architecture == "ps":
        parts.append(f"update on {strategy.update_on}")
    return ", ".join(parts)
