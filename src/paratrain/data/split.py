"""Splitting one worker's batch across its local devices, and merging per-device outputs back.

`split_and_load` is MXNet's `gluon.utils.split_and_load` for PyTorch: a batch (a tensor, or nested
tuples / lists / dicts of tensors) is cut along `dim` into near-equal parts, one per device, and each
part is copied to its device. `merge` is the inverse, for outputs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

Device = torch.device | str


def local_devices() -> list[torch.device]:
    """Every CUDA device of this process if there is one, else [cpu]."""
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def split_and_load(batch: Any, devices: Sequence[Device], *, dim: int = 0) -> list[Any]:
    """One part of `batch` per device, parts differing in size along `dim` by at most one row.

    Every tensor of `batch` must have the same size along `dim`; each part keeps the batch's nesting.
    0-dim tensors are copied whole to every device; other leaves (str, int, ...) go to every part as
    they are. ValueError if `devices` is empty or the batch has fewer rows than devices.
    """
    targets = [torch.device(d) for d in devices]
    if not targets:
        raise ValueError("devices is empty; pass at least one device (see local_devices())")
    rows = _rows(batch, dim)
    if rows < len(targets):
        raise ValueError(f"batch has {rows} rows along dim {dim}, fewer than the {len(targets)} devices")
    return [
        _map(batch, functools.partial(_part, index=i, device=d, count=len(targets), dim=dim))
        for i, d in enumerate(targets)
    ]


def to_device(batch: Any, device: Device) -> Any:
    """`batch` (a tensor, or nested tuples / lists / dicts of tensors) with every tensor on `device`;
    other leaves as they are. Copies from pinned memory to a GPU do not block."""
    target = torch.device(device)
    return _map(batch, lambda t: t.to(target, non_blocking=True))


def first_rows(batch: Any) -> int | None:
    """The size along dim 0 of the first tensor in `batch` that has a dim 0 (its batch size, by
    the usual convention), or None where it holds none."""
    for tensor in _tensors(batch):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    return None


def merge(parts: Sequence[Any], dim: int = 0) -> Any:
    """The inverse of split_and_load: tensors concatenated along `dim` on the first part's device.

    0-dim tensors (say, one loss per device) are stacked into one value per part; other leaves are
    taken from the first part. ValueError if `parts` is empty or the parts are nested differently.
    """
    if not parts:
        raise ValueError("parts is empty; nothing to merge")
    return _merge(list(parts), dim, _first_device(parts[0]))


def _part(tensor: torch.Tensor, index: int, device: torch.device, count: int, dim: int) -> torch.Tensor:
    if tensor.dim() == 0:
        return tensor.to(device, non_blocking=True)
    return torch.tensor_split(tensor, count, dim=dim)[index].to(device, non_blocking=True)


def _map(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`batch` with every tensor replaced by fn(tensor), containers rebuilt as they were."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)((key, _map(value, fn)) for key, value in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_map(value, fn) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_map(value, fn) for value in batch)
    return batch


def _tensors(batch: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map(batch, lambda t: found.append(t))
    return found


def _rows(batch: Any, dim: int) -> int:
    """The common size along `dim` of the batch's tensors (0-dim ones aside)."""
    tensors = [t for t in _tensors(batch) if t.dim() > 0]
    if not tensors:
        raise ValueError(f"batch holds no tensor to split (got {type(batch).__name__})")
    try:
        sizes = {t.shape[dim] for t in tensors}
    except IndexError:
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(f"dim {dim} is out of range for the batch's tensors (shapes {shapes})")
    if len(sizes) != 1:
        raise ValueError(f"the batch's tensors differ in size along dim {dim}: {sorted(sizes)}")
    return sizes.pop()


def _first_device(part: Any) -> torch.device:
    tensors = _tensors(part)
    if not tensors:
        raise ValueError(f"parts hold no tensor to merge (got {type(part).__name__})")
    return tensors[0].device


def _merge(parts: list[Any], dim: int, device: torch.device) -> Any:
    first = parts[0]
    if any(type(p) is not type(first) for p in parts):
        raise ValueError(f"parts differ in type: {sorted({type(p).__name__ for p in parts})}")
    if isinstance(first, torch.Tensor):
        moved = [p.to(device, non_blocking=True) for p in parts]
        return torch.stack(moved) if first.dim() == 0 else torch.cat(moved, dim=dim)
    if isinstance(first, dict):
        if any(p.keys() != first.keys() for p in parts):
            raise ValueError(f"parts differ in keys: {[sorted(p) for p in parts]}")
        return type(first)((key, _merge([p[key] for p in parts], dim, device)) for key in first)
    if isinstance(first, (tuple, list)):
        if any(len(p) != len(first) for p in parts):
            raise ValueError(f"parts differ in length: {[len(p) for p in parts]}")
        merged = [_merge([p[i] for p in parts], dim, device) for i in range(len(first))]
        return type(first)(*merged) if hasattr(first, "_fields") else type(first)(merged)
    return first
