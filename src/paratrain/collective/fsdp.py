"""Sharded data parallel: torch's FSDP2 (`torch.distributed.fsdp.fully_shard`), not a sharding of our
own. Every rank keeps 1/N of each parameter, its gradient and its optimizer state; a block's full
parameters are all-gathered for its forward and backward and its gradients reduce-scattered after.

Blocks are the units that are gathered at once: the children of an nn.Sequential, the repeated
blocks of a transformer (the modules of every nn.ModuleList), or the submodules the user names.
Each block is sharded, then the root (which takes the parameters no block holds).

Mixed precision is FSDP's own `MixedPrecisionPolicy`, not autocast: the sharded parameters stay
fp32 (the optimizer steps them), each block's all-gather casts them to `param_dtype` (so the gathered
copy, the forward and backward are low precision: the memory and bytes saved), and gradients are
reduce-scattered in `reduce_dtype` (fp32 by default: a sum over many workers keeps its low bits).
The root's output comes back as fp32, as the Trainer's autocast gives it, so a loss computed after
the forward is fp32.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)


def find_blocks(model: nn.Module, names: Sequence[str] = ()) -> list[nn.Module]:
    """The modules of `model` to shard one by one: those named (dotted names, as named_modules gives
    them), else a Sequential's children, else every ModuleList's modules; only those with parameters."""
    if names:
        modules = dict(model.named_modules())
        missing = [name for name in names if name not in modules or not name]
        if missing:
            raise ValueError(
                f"Strategy.fsdp_blocks names {', '.join(map(repr, missing))}, which the model "
                f"({type(model).__name__}) has no submodule called"
            )
        blocks = [modules[name] for name in names]
    elif isinstance(model, nn.Sequential):
        blocks = list(model.children())
    else:
        blocks = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    return [block for block in blocks if any(True for _ in block.parameters())]


def shard_model(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    blocks: Sequence[str] = (),
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    mesh: DeviceMesh | None = None,
    split: Callable[[nn.Module], Any] | None = None,
) -> nn.Module:
    """`model` sharded in place over the default process group, or over the 1-d `mesh` (not at all
    on a mesh of one); every rank starts from rank 0's parameters. `split`, where given, runs
    between that start and the sharding (tensor parallelism's parallelize_module). `optimizer`'s
    parameters become the sharded ones. fully_shard replaces each
    Parameter with a DTensor one, so an optimizer built before it would step tensors no longer in
    the model: its parameter groups are rebuilt by parameter name, which needs an optimizer that
    has not stepped yet (its state would be full tensors). `param_dtype`, `reduce_dtype`: the
    mixed precision (see the module docstring); None keeps the parameters' own dtype."""
    if optimizer is not None and optimizer.state:
        raise ValueError(
            "Strategy.architecture='fsdp' needs an optimizer that has not stepped yet (its state would "
            "be unsharded); resume through the Trainer's sharded checkpoints instead"
        )
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    names = {id(p): name for name, p in model.named_parameters()}
    with torch.no_grad():  # fully_shard keeps each rank's own slice of its own values
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, 0)  # one by one: no flat copy of a model meant to be large
    if split is not None:
        split(model)
    if mesh is None or mesh.size() > 1:
        chosen = find_blocks(model, blocks)
        inner = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        # Between blocks the activations stay low precision; only what the root gives back is fp32.
        outer = MixedPrecisionPolicy(
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            output_dtype=torch.float32 if param_dtype is not None else None,
        )
        for block in chosen:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=inner)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=outer)
        logger.debug("fully_shard: %d blocks and the root of %s", len(chosen), type(model).__name__)
    if optimizer is not None:
        sharded = dict(model.named_parameters())
        for group in optimizer.param_groups:
            unknown = [p for p in group["params"] if id(p) not in names]
            if unknown:
                raise ValueError(
                    f"the optimizer holds {len(unknown)} tensor(s) that are not parameters of the model: "
                    "under Strategy.architecture='fsdp' it may hold only the model's parameters"
                )
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return model


def full_state_dict(model: nn.Module) -> dict[str, Any]:
    """The whole model's state dict as plain tensors on every rank (a collective under FSDP: every
    rank calls it); a plain model's own state dict otherwise."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
