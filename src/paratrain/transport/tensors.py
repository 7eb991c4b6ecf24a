"""Tensors as wire bytes: the dtype names of the wire, and zero-copy byte views of tensor memory."""

from __future__ import annotations

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


BIG_COPY_BYTES = 1 << 20


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src; big copies go through torch, which releases the GIL while it copies (a
    memoryview assignment holds it, stalling every other thread of the process)."""
    if len(src) >= BIG_COPY_BYTES:
        torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))
    else:
        dst[:] = src
