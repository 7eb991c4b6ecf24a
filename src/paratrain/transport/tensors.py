"""Tensors as wire bytes: the dtype names of the wire, and zero-copy byte views of tensor memory."""

from __future__ import annotations

import numpy as np
import torch

# The dtypes a frame may carry, by wire name. A name not in this table is a malformed frame.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
# The lean header's dtype codes (frame.py): a dtype's position in DTYPES. They are on the wire:
# a new dtype goes at the end of DTYPES, and none is ever removed or moved.
BY_CODE: tuple[torch.dtype, ...] = tuple(DTYPES.values())
CODES: dict[torch.dtype, int] = {dtype: code for code, dtype in enumerate(BY_CODE)}
MAX_DIMS = 16


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be sent; supported: {', '.join(DTYPES)}") from None


ITEMSIZE: dict[torch.dtype, int] = {dtype: dtype.itemsize for dtype in DTYPES.values()}


def nbytes(dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> int:
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return n


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes, sharing its memory (no copy)."""
    if not tensor.is_cpu:  # not device.type: 30x the cost, on every frame
        raise ValueError(f"tensor on {tensor.device} must be copied to the CPU before it is sent")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous to be sent or received in place")
    if tensor.numel() == 0:
        return memoryview(b"")
    if tensor.dtype is torch.bfloat16:  # numpy has no bfloat16; the bytes are the same
        tensor = tensor.view(torch.int16)
    return tensor.numpy().data.cast("B")


def fitting_view(dest: torch.Tensor, dtype: torch.dtype, size: int) -> memoryview | None:
    """dest's bytes if it can take `size` bytes of `dtype` as they are (no copy), else None."""
    if dest.dtype is not dtype or not dest.is_cpu or not dest.is_contiguous() or dest.nbytes != size:
        return None
    if not size:
        return memoryview(b"")
    if dtype is torch.bfloat16:
        dest = dest.view(torch.int16)
    return dest.numpy().data.cast("B")


class ViewCache:
    """Byte views of small tensors, by (address, length): a tensor sent or received again, or
    another tensor over the same bytes (a slice of one buffer), skips `numpy()` and the cast,
    half the Python of a 1 KiB frame's views. Correct whatever tensor asks: a view is only the
    bytes at an address, and a live tensor owns the bytes at its address. Only tensors of at
    most `max_bytes` are kept (a view keeps its tensor's memory alive), at most `entries` of them."""

    __slots__ = ("_views", "max_bytes", "entries")

    def __init__(self, max_bytes: int = 64 << 10, entries: int = 16) -> None:
        self._views: dict[tuple[int, int], memoryview] = {}
        self.max_bytes, self.entries = max_bytes, entries

    def byte_view(self, tensor: torch.Tensor) -> memoryview:
        """tensors.byte_view(tensor), from the cache where it can be."""
        if not tensor.is_cpu or not tensor.is_contiguous():
            return byte_view(tensor)  # raises the error that says why
        return self._view(tensor, tensor.nbytes)

    def fitting_view(self, dest: torch.Tensor, dtype: torch.dtype, size: int) -> memoryview | None:
        """tensors.fitting_view(dest, dtype, size), from the cache where it can be."""
        if dest.dtype is not dtype or dest.nbytes != size:
            return None
        if not dest.is_cpu or not dest.is_contiguous():
            return None
        return self._view(dest, size)

    def _view(self, tensor: torch.Tensor, size: int) -> memoryview:
        """The view of a contiguous CPU tensor of `size` bytes (checked by the caller, once)."""
        if not size or size > self.max_bytes:
            return byte_view(tensor)
        key = (tensor.data_ptr(), size)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= self.entries:
                self._views.clear()
            view = self._views[key] = byte_view(tensor)
        return view

    def clear(self) -> None:
        self._views.clear()


BIG_COPY_BYTES = 1 << 20


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src. Big copies go through numpy, which releases the GIL while it copies (a
    memoryview assignment holds it, stalling every other thread of the process) and copies on the
    calling thread alone. Not torch's copy_: it splits a big copy over its OpenMP threads, and where
    the job's other processes keep the cores busy the copy waits for whichever of its threads the
    kernel let run last: a 4 MiB payload went into the same-host ring at 1.0-1.2 GB/s with torch's
    two threads on 2 cores, and at 6.5-11 GB/s on one thread (benchmarks/transport.py, shm)."""
    if len(src) >= BIG_COPY_BYTES:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
    else:
        dst[:] = src
