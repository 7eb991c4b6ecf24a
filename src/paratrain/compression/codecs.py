"""The codecs: a flat tensor to a few wire tensors and back, with error feedback.

    payload = codec.encode(x, residual)   # residual None: no error feedback; else updated in place
    codec.decode(payload, out)            # out = what was sent (out += with add=True)

Every payload is a list of plain tensors (the wire carries them as they are): 2bit one uint8 tensor
of ceil(n / 4) bytes; topk the values and their int32 / int64 indices; fp16 / bf16 one tensor of
that type. `encode` never changes x. Only float32 and float64 tensors of at least the config's
min_elements are compressed (`compressible`); others travel as they are.
"""

from __future__ import annotations

import math

import torch

from paratrain.compression.api import CompressionConfig

COMPRESSIBLE = (torch.float32, torch.float64)


def compressible(
    dtype: torch.dtype, numel: int | None = None, config: CompressionConfig | None = None
) -> bool:
    """Whether a tensor of this type (and, given a config, of `numel` elements) is compressed."""
    if dtype not in COMPRESSIBLE:
        return False
    return config is None or numel is None or numel >= config.min_elements


class Codec:
    """One kind of compression; `parts` tensors per encoded tensor."""

    parts = 1

    def encode(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> list[torch.Tensor]:
        raise NotImplementedError

    def decode(self, payload: list[torch.Tensor], out: torch.Tensor, add: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def wire_bytes(self, numel: int, itemsize: int = 4) -> int:
        """Bytes on the wire for a tensor of numel elements."""
        raise NotImplementedError


class TwoBit(Codec):
    def __init__(self, threshold: float) -> None:
        # Imported here: numba costs a process ~0.4 CPU-s to import, and most jobs never pack 2 bits.
        from paratrain.compression import kernels

        self.threshold = float(threshold)
        self._kernels = kernels

    def encode(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> list[torch.Tensor]:
        out = torch.empty((x.numel() + 3) // 4, dtype=torch.uint8)
        self._kernels.encode_2bit(
            x.numpy(),
            (x if residual is None else residual).numpy(),
            self.threshold,
            residual is not None,
            out.numpy(),
        )
        return [out]

    def decode(self, payload: list[torch.Tensor], out: torch.Tensor, add: bool = False) -> torch.Tensor:
        (codes,) = payload
        if codes.dtype != torch.uint8 or codes.numel() != (out.numel() + 3) // 4:
            raise ValueError(
                f"2bit payload of {codes.dtype}[{codes.numel()}] is not for {out.numel()} elements"
            )
        self._kernels.decode_2bit(codes.numpy(), self.threshold, add, out.numpy())
        return out

    def wire_bytes(self, numel: int, itemsize: int = 4) -> int:
        return (numel + 3) // 4


class TopK(Codec):
    parts = 2

    def __init__(self, ratio: float) -> None:
        self.ratio = float(ratio)

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def encode(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> list[torch.Tensor]:
        corrected = x if residual is None else residual.add_(x)
        index = torch.topk(corrected.abs(), self.k(x.numel()), sorted=False).indices
        values = corrected[index]
        if residual is not None:
            residual[index] = 0  # the rest stays for the next round
        index_type = torch.int32 if x.numel() < 2**31 else torch.int64
        return [values, index.to(index_type)]

    def decode(self, payload: list[torch.Tensor], out: torch.Tensor, add: bool = False) -> torch.Tensor:
        values, index = payload
        k = self.k(out.numel())
        if values.numel() != k or index.numel() != k or values.dtype != out.dtype:
            raise ValueError(f"topk payload of {values.numel()} values is not for {out.numel()} elements")
        if index.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk indices of type {index.dtype}")
        index = index.long()
        if k and not 0 <= int(index.min()) <= int(index.max()) < out.numel():
            raise ValueError(f"topk index out of range [0, {out.numel()})")
        if not add:
            out.zero_()
        return out.index_add_(0, index, values)

    def wire_bytes(self, numel: int, itemsize: int = 4) -> int:
        return self.k(numel) * (itemsize + (4 if numel < 2**31 else 8))


class Cast(Codec):
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def encode(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> list[torch.Tensor]:
        if residual is None:
            return [x.to(self.dtype)]
        residual.add_(x)
        sent = residual.to(self.dtype)
        residual.sub_(sent)
        return [sent]

    def decode(self, payload: list[torch.Tensor], out: torch.Tensor, add: bool = False) -> torch.Tensor:
        (sent,) = payload
        if sent.dtype != self.dtype or sent.numel() != out.numel():
            raise ValueError(
                f"{self.dtype} payload {sent.dtype}[{sent.numel()}] is not for {out.numel()} elements"
            )
        return out.add_(sent) if add else out.copy_(sent)

    def wire_bytes(self, numel: int, itemsize: int = 4) -> int:
        return numel * self.dtype.itemsize


def make_codec(config: CompressionConfig) -> Codec:
    """The codec of `config`'s kind; PowerSGD is not elementwise (the collective's hook)."""
    if config.type == "2bit":
        return TwoBit(config.threshold)
    if config.type == "topk":
        return TopK(config.ratio)
    if config.type in ("fp16", "bf16"):
        return Cast(torch.float16 if config.type == "fp16" else torch.bfloat16)
    raise ValueError(
        f"compression type={config.type!r} has no elementwise codec: it needs architecture='collective'"
    )
