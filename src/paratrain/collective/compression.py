"""Compressed gradient averaging for DDP: communication hooks over paratrain.compression's codecs.

    register(ddp, CompressionConfig("2bit", threshold=0.5))

2bit and topk payloads cannot be summed as they travel, so every rank all-gathers the others'
payloads (W x n / 16 bytes for 2bit against 2 (W - 1) / W x 4n for a ring all-reduce of float32)
and decodes and sums them itself, in the same order everywhere; fp16 and bf16 are all-reduced in
that type. Each rank keeps the error feedback of its own gradients: a residual per bucket while it
trains, saved per parameter (bucket layouts change when DDP rebuilds them after the first step).
PowerSGD is torch's hook (PowerSGDState keeps its own error feedback and warm start; its state is
per bucket and is not saved: a resumed run starts it afresh).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from paratrain.checkpoint import load_file, save_file
from paratrain.compression import CompressionConfig, compressible, make_codec

ATTRIBUTE = "_paratrain_compression"
"""Where register() leaves the hook's state on the DDP module (for save / restore)."""


class CompressionHookState:
    """One rank's codec and residuals (per bucket in training, per parameter in a checkpoint)."""

    saves_residuals = True  # save() and restore() take it (PowerSGD's state is not saved)

    def __init__(self, config: CompressionConfig, module: torch.nn.Module) -> None:
        self.config = config
        self.codec = make_codec(config)
        params = list(module.parameters())
        self.index = {id(p): i for i, p in enumerate(params)}
        self.numels = [p.numel() for p in params]
        self.residuals: dict[int, torch.Tensor] = {}  # per bucket index
        self.bucket_params: dict[int, list[int]] = {}  # the parameters each bucket holds, in order
        self.loaded: dict[int, torch.Tensor] = {}  # per parameter, until its bucket first runs

    def residual(self, bucket: dist.GradBucket) -> torch.Tensor | None:
        """The bucket's residual; built from its parameters' pieces where the bucket is new (the
        first step, DDP's rebuilt buckets after it, a restored checkpoint)."""
        if not self.config.error_feedback:
            return None
        b, params = bucket.index(), [self.index[id(p)] for p in bucket.parameters()]
        if self.bucket_params.get(b) != params:
            pieces = self.per_parameter()
            self.loaded = {i: t for i, t in pieces.items() if i not in params}
            dtype = bucket.buffer().dtype
            parts = [pieces.get(i, torch.zeros(self.numels[i])).reshape(-1).to(dtype) for i in params]
            self.residuals[b], self.bucket_params[b] = torch.cat(parts), params
            for other in [o for o, ps in self.bucket_params.items() if o != b and set(ps) & set(params)]:
                del self.residuals[other], self.bucket_params[other]  # taken over by this bucket
        return self.residuals[b]

    def per_parameter(self) -> dict[int, torch.Tensor]:
        """Every residual, cut per parameter (parameter index -> flat tensor)."""
        found = dict(self.loaded)
        for b, params in self.bucket_params.items():
            offset = 0
            for i in params:
                found[i] = self.residuals[b][offset : offset + self.numels[i]]
                offset += self.numels[i]
        return found

    def state_dict(self) -> dict[str, Any]:
        pieces = self.per_parameter()
        return {
            "type": self.config.type,
            "params": list(pieces),
            "residuals": [t.clone() for t in pieces.values()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals, self.bucket_params = {}, {}
        self.loaded = dict(zip(state["params"], state["residuals"], strict=True))


def _gather_hook(state, bucket):  # noqa: ANN001, ANN201 (DDP checks real annotations, not strings)
    """2bit / topk: all-gather every rank's payload, decode and sum them, divide by the world."""
    buffer, codec = bucket.buffer(), state.codec
    if not compressible(buffer.dtype, buffer.numel(), state.config):
        return _mean(buffer)
    payload = codec.encode(buffer.clone(), state.residual(bucket))
    world = dist.get_world_size()
    gathered = [[torch.empty_like(t) for _ in range(world)] for t in payload]
    works = [dist.all_gather(out, t, async_op=True) for out, t in zip(gathered, payload, strict=True)]

    def decode(_: torch.futures.Future) -> torch.Tensor:
        for work in works[:-1]:
            work.wait()
        buffer.zero_()
        for rank in range(world):
            codec.decode([parts[rank] for parts in gathered], buffer, add=True)
        return buffer.div_(world)

    return works[-1].get_future().then(decode)


def _cast_hook(state, bucket):  # noqa: ANN001, ANN201 (DDP checks real annotations, not strings)
    """fp16 / bf16: the bucket / world travels in that type (with error feedback) and is summed so.
    torch ships such hooks, but its bf16 one refuses anything but NCCL; Gloo sums bf16 on the CPU."""
    buffer = bucket.buffer()
    if not compressible(buffer.dtype, buffer.numel(), state.config):
        return _mean(buffer)
    (sent,) = state.codec.encode(buffer / dist.get_world_size(), state.residual(bucket))
    future = dist.all_reduce(sent, async_op=True).get_future()

    def decode(done: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(done.value()[0])

    return future.then(decode)


def _mean(buffer: torch.Tensor) -> torch.futures.Future:
    world = dist.get_world_size()
    return dist.all_reduce(buffer.div_(world), async_op=True).get_future().then(lambda f: f.value()[0])


def register(ddp: DistributedDataParallel, config: CompressionConfig) -> None:
    """Compress `ddp`'s gradient averaging as `config` says."""
    if config.type == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=config.rank,
            start_powerSGD_iter=2,  # torch's least with error feedback: one plain step, then PowerSGD
            use_error_feedback=config.error_feedback,
            warm_start=config.error_feedback,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        setattr(ddp, ATTRIBUTE, state)
        return
    hook_state = CompressionHookState(config, ddp.module)
    ddp.register_comm_hook(hook_state, _cast_hook if config.type in ("fp16", "bf16") else _gather_hook)
    setattr(ddp, ATTRIBUTE, hook_state)


def state_path(folder: Path) -> Path:
    return Path(folder) / f"compression-worker-{dist.get_rank()}.pt"


def save(module: Any, folder: Path) -> None:
    """This rank's residuals into a checkpoint folder (nothing where `module` has no hook or
    updates.CompressedUpdates)."""
    state = getattr(module, ATTRIBUTE, None)
    if state is not None and getattr(state, "saves_residuals", False):  # or updates.CompressedUpdates
        save_file(state_path(folder), state.state_dict())


def restore(module: Any, folder: Path) -> None:
    state = getattr(module, ATTRIBUTE, None)
    path = state_path(folder)
    if state is not None and getattr(state, "saves_residuals", False) and path.exists():
        state.load_state_dict(load_file(path))
