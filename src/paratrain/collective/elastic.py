"""Elastic all-reduce state: Horovod Elastic's commit, restore and sync, on torch.distributed.

torch.distributed cannot shrink or grow a process group. When a peer dies, Gloo raises on every
survivor (the peer's connection closes, or the group's timeout expires); the survivors re-form a new
group from the scheduler's membership (cluster/rendezvous.reform_torch_distributed), roll back to
their last commit (an in-memory copy taken after an optimizer step), and the member with the most
recent commit broadcasts it to the others. Survivors that broke at different points and a
replacement that has just started thus go on from one state.

The state crosses the group as a msgpack skeleton plus raw tensors, never as pickle: a tensor in the
tree becomes {"__tensor__": i, "dtype": name, "shape": [...]}, a tuple {"__tuple__": [...]}.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from torch import nn

from paratrain.transport.tensors import DTYPES, dtype_name

# What Gloo (and the store) say when a peer is gone; a collective error without one of these is a bug,
# not a failure to recover from.
_PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "socket",
    "gloo",
    "connection refused",
    "no route to host",
)


def is_peer_failure(error: BaseException) -> bool:
    """Whether `error`, raised by a collective, can mean that a member of the group died."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(marker in text for marker in _PEER_GONE)


# -- commit and restore --------------------------------------------------------------------------------
@dataclass
class Commit:
    """One member's state after an optimizer step, kept in memory (deep copies, not references)."""

    steps: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    """Small msgpack-able values that go with it (the data loader's position, say)."""

    def as_tree(self) -> dict[str, Any]:
        return {"steps": self.steps, "model": self.model, "optimizer": self.optimizer, "extra": self.extra}

    @classmethod
    def from_tree(cls, tree: dict[str, Any]) -> Commit:
        return cls(tree["steps"], tree["model"], tree["optimizer"], tree.get("extra", {}))


def commit(
    module: nn.Module, optimizer: torch.optim.Optimizer, steps: int, extra: dict[str, Any] | None = None
) -> Commit:
    """A copy of `module`'s and `optimizer`'s state now (later steps do not change it)."""
    model = {name: t.detach().clone() for name, t in module.state_dict().items()}
    return Commit(steps, model, copy.deepcopy(optimizer.state_dict()), dict(extra or {}))


def restore(state: Commit, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """`module` and `optimizer` back to `state`; the commit stays intact for a later restore (the
    optimizer would otherwise update the committed tensors in place)."""
    module.load_state_dict(state.model)
    optimizer.load_state_dict(copy.deepcopy(state.optimizer))


# -- the state on the wire -----------------------------------------------------------------------------
def encode(tree: Any) -> tuple[bytes, list[torch.Tensor]]:
    """`tree` (dicts, lists, tuples, numbers, strings, None, tensors) as a msgpack skeleton and its
    tensors, in order. TypeError naming the path of anything else."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach().cpu().contiguous())
            return {
                "__tensor__": len(tensors) - 1,
                "dtype": dtype_name(value.dtype),
                "shape": list(value.shape),
            }
        if isinstance(value, dict):
            for key in value:
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise TypeError(f"state key {key!r} at {path or 'the root'} must be a str or an int")
            return {key: walk(item, f"{path}/{key}") for key, item in value.items()}
        if isinstance(value, tuple):
            return {"__tuple__": [walk(item, f"{path}/{i}") for i, item in enumerate(value)]}
        if isinstance(value, list):
            return [walk(item, f"{path}/{i}") for i, item in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"state value at {path or 'the root'} is a {type(value).__name__}: it cannot be sent")

    skeleton = walk(tree, "")
    return msgpack.packb(skeleton, use_bin_type=True), tensors


def placeholders(blob: bytes) -> tuple[Any, list[torch.Tensor]]:
    """The skeleton of `blob` and an empty tensor for each of its tensors, to receive into."""
    skeleton = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    found: dict[int, torch.Tensor] = {}

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if "__tensor__" in value:
                found[value["__tensor__"]] = torch.empty(value["shape"], dtype=DTYPES[value["dtype"]])
                return
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(skeleton)
    return skeleton, [found[i] for i in range(len(found))]


def decode(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The tree that `encode` took apart, from its skeleton and tensors."""
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__tuple__" in skeleton:
            return tuple(decode(item, tensors) for item in skeleton["__tuple__"])
        return {key: decode(item, tensors) for key, item in skeleton.items()}
    if isinstance(skeleton, list):
        return [decode(item, tensors) for item in skeleton]
    return skeleton


def broadcast_state(tree: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """Every member gets group rank `src`'s `tree` (the others pass anything, None say): its
    skeleton's length, the skeleton, then each tensor."""
    sending = dist.get_rank(group) == src
    if sending:
        blob, tensors = encode(tree)
        length = torch.tensor([len(blob)], dtype=torch.int64)
        dist.broadcast(length, src, group=group)
        dist.broadcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8), src, group=group)
    else:
        length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, src, group=group)
        raw = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(raw, src, group=group)
        skeleton, tensors = placeholders(raw.numpy().tobytes())
    for tensor in tensors:
        if tensor.numel():
            dist.broadcast(tensor, src, group=group)
    return tree if sending else decode(skeleton, tensors)
