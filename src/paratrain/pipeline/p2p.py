"""Point-to-point transfers between neighbour stages, on torch.distributed (Gloo on CPU).

A forward activation travels as a fixed-size int64 header (dtype code, number of dimensions, shape)
then the tensor, so the receiving stage learns each micro-batch's shape as it comes (micro-batches
of one batch may differ by a row, and middle stages never see the batch). A backward gradient has
the shape of the activation it answers, which the receiver holds, so it travels bare. Sends are
asynchronous and return the work to wait on; receives block (within the process group's timeout).
Messages between one pair of ranks arrive in the order they were sent, which the schedules rely on.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MAX_DIMS = 8
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)
ACTIVATION_TAG, GRADIENT_TAG = 1, 2

Pending = list[tuple[dist.Work | None, torch.Tensor]]
"""Sends in flight and their buffers (kept alive until sent); isend's work is None when this rank
is not in the group, which never happens between stages of one pipeline."""


def encode_header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in DTYPES:
        raise TypeError(f"a pipeline activation of dtype {tensor.dtype} cannot be sent (one of {DTYPES})")
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"a pipeline activation has {tensor.dim()} dimensions; at most {MAX_DIMS} are sent")
    header = torch.zeros(2 + MAX_DIMS, dtype=torch.int64)
    header[0], header[1] = DTYPES.index(tensor.dtype), tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> tuple[torch.dtype, list[int]]:
    dtype, ndim = DTYPES[int(header[0])], int(header[1])
    return dtype, [int(n) for n in header[2 : 2 + ndim]]


def send_activation(tensor: torch.Tensor, dst: int, pending: Pending) -> None:
    """Starts sending `tensor` (header first) to worker rank `dst`; appends the works to `pending`."""
    header = encode_header(tensor)
    payload = tensor.detach().to(_comm_device(tensor.device)).contiguous()
    pending.append((dist.isend(header, dst, tag=ACTIVATION_TAG), header))
    pending.append((dist.isend(payload, dst, tag=ACTIVATION_TAG), payload))


def recv_activation(src: int, device: torch.device) -> torch.Tensor:
    """The next activation worker rank `src` sent, on `device`."""
    header = torch.empty(2 + MAX_DIMS, dtype=torch.int64)
    dist.recv(header, src, tag=ACTIVATION_TAG)
    dtype, shape = decode_header(header)
    buffer = torch.empty(shape, dtype=dtype, device=_comm_device(device))
    dist.recv(buffer, src, tag=ACTIVATION_TAG)
    return buffer.to(device)


def send_gradient(tensor: torch.Tensor, dst: int, pending: Pending) -> None:
    payload = tensor.detach().to(_comm_device(tensor.device)).contiguous()
    pending.append((dist.isend(payload, dst, tag=GRADIENT_TAG), payload))


def recv_gradient(like: torch.Tensor, src: int) -> torch.Tensor:
    """The next gradient worker rank `src` sent for an activation shaped like `like`."""
    buffer = torch.empty(like.shape, dtype=like.dtype, device=_comm_device(like.device))
    dist.recv(buffer, src, tag=GRADIENT_TAG)
    return buffer.to(like.device)


def wait_all(pending: Pending) -> None:
    for work, _ in pending:
        if work is not None:
            work.wait()
    pending.clear()


def _comm_device(device: torch.device) -> torch.device:
    """Gloo moves CPU tensors only; NCCL moves tensors of the current CUDA device."""
    if dist.get_backend() == "nccl":
        return device
    return torch.device("cpu")
