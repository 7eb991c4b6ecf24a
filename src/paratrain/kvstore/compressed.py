"""Compressed pushes and pulls: the kvstore's side of paratrain.compression (the codecs).

Worker (`WorkerCompression`): each float slice of a push is encoded with its own error feedback (a
residual per key and slice, kept here and saved with the worker's checkpoint) and the frame's meta
carries the config (`compression`), so a server decodes with exactly what encoded. A pull that
asks for compressed values (`pull_compression`; only where the servers run no optimizer, so the
value pulled is a round's gradient sum) gets per slice a flag (`compressed`) and either the
payload, decoded here into the caller's `out`, or the plain value.

Server (`ServerCompression`): a compressed push is decoded into a pooled buffer of its shard before
it joins the round (the sum is taken in full precision). A compressed pull is encoded once per
version of the shard with the server's own error feedback, as BytePS does, and every worker gets
the same bytes, so the workers stay equal. A value at version 0 (what init set: weights, not a
sum) and any shard with an optimizer go plain. Compressed slices never use the same-host shared
memory: the bytes and the rounding are the same wherever the processes run.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint import load_file, save_file
from paratrain.compression import Codec, CompressionConfig, compressible, make_codec
from paratrain.kvstore.protocol import Slices

logger = logging.getLogger(__name__)

RESIDUAL = "compression.residual"
"""The name of a server shard's pull residual among its saved state tensors."""


@functools.lru_cache(maxsize=16)
def _codec(config: CompressionConfig) -> Codec:
    return make_codec(config)


def codec_of(wire: Any) -> tuple[Codec, CompressionConfig]:
    """The codec and config a frame's `compression` meta names; ValueError for anything else."""
    if not isinstance(wire, dict):
        raise ValueError(f"compression meta {wire!r} is not a dict")
    config = CompressionConfig.parse(wire)
    if config is None:
        raise ValueError("compression meta names no compression")
    return _codec(config), config


def residual_path(path: str | os.PathLike[str], rank: int) -> Path:
    """Where worker `rank` keeps its push residuals beside the servers' state file."""
    path = Path(path)
    return path.with_name(f"{path.stem}.compression-worker-{rank}.pt")


class WorkerCompression:
    """One worker's encoding of pushes (with error feedback per key and slice) and decoding of
    compressed pulls."""

    def __init__(self, config: CompressionConfig) -> None:
        self.config = config
        self.codec = make_codec(config)
        self.wire = config.to_wire()
        self.residuals: dict[tuple[Any, int], torch.Tensor] = {}

    def wire_bytes(self, dtype: torch.dtype, numel: int) -> int | None:
        """Bytes a whole key of this type and size takes on the wire; None where it is not compressed."""
        if not compressible(dtype, numel, self.config):
            return None
        return self.codec.wire_bytes(numel, dtype.itemsize)

    def encode(self, key: Any, start: int, piece: torch.Tensor, numel: int) -> list[torch.Tensor]:
        """The wire tensors of one slice of a key of `numel` elements (the slice itself where the
        key is not compressed: its type, or fewer than min_elements)."""
        if not compressible(piece.dtype, numel, self.config):
            return [piece]
        residual = None
        if self.config.error_feedback:
            residual = self.residuals.get((key, start))
            if residual is None:
                residual = self.residuals[(key, start)] = torch.zeros_like(piece)
        return self.codec.encode(piece, residual)

    def decode_reply(self, request: Slices, reply: Any, views: dict[Any, torch.Tensor]) -> None:
        """Copy one pull reply's slices into the flat outs (`views`), decoding compressed ones."""
        tensors = iter(reply.tensors)
        flags = reply.meta.get("compressed") or [False] * len(request.keys)
        for k, a, b, packed in zip(request.keys, request.starts, request.stops, flags, strict=True):
            if packed:
                self.codec.decode([next(tensors) for _ in range(self.codec.parts)], views[k][a:b])
            else:
                views[k][a:b].copy_(next(tensors))

    def save(self, path: str | os.PathLike[str], rank: int) -> None:
        keys = list(self.residuals)
        save_file(
            residual_path(path, rank),
            {
                "config": self.wire,
                "keys": [k for k, _ in keys],
                "starts": [s for _, s in keys],
                "residuals": [self.residuals[k] for k in keys],
            },
        )

    def load(self, path: str | os.PathLike[str], rank: int) -> None:
        """This worker's residuals from a checkpoint (none there: they start at zero)."""
        where = residual_path(path, rank)
        self.residuals = {}
        if not where.exists():
            logger.info("no compression residuals in %s: they start at zero", where)
            return
        state = load_file(where)
        for key, start, residual in zip(state["keys"], state["starts"], state["residuals"], strict=True):
            self.residuals[(key, start)] = residual


@dataclass
class _ShardPull:
    """A shard's compressed pulls: the residual and the payload of the version last encoded."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    residual: torch.Tensor | None = None
    version: int = -1
    payload: list[torch.Tensor] = field(default_factory=list)


class ServerCompression:
    """One server's decoding of compressed pushes and encoding of compressed pulls."""

    def __init__(self) -> None:
        self._pulls: dict[tuple[Any, int], _ShardPull] = {}
        self._lock = threading.Lock()

    def decode_push(
        self, meta: dict, tensors: list[torch.Tensor], shard_of: Callable[[int], Any], owned: bool
    ) -> list[torch.Tensor]:
        """Full-precision gradients, one per slice of the frame, each in a pooled buffer of its
        shard (or the tensor received, where it is `owned` and not compressed)."""
        codec, config = codec_of(meta["compression"])
        if any(meta.get("added") or ()):
            raise ValueError("a compressed push cannot add slices in shared memory")
        received, grads = iter(tensors), []
        try:
            for i in range(len(meta["keys"])):
                shard = shard_of(i)
                if compressible(shard.value.dtype, shard.numel, config):
                    payload = [next(received) for _ in range(codec.parts)]
                    grads.append(codec.decode(payload, shard.buffer()))
                else:
                    tensor = next(received)
                    grads.append(tensor if owned else shard.buffer().copy_(tensor))
        except StopIteration:
            raise ValueError(
                f"a compressed push of {len(meta['keys'])} slices carried too few tensors"
            ) from None
        if next(received, None) is not None:
            raise ValueError(f"a compressed push of {len(meta['keys'])} slices carried too many tensors")
        return grads

    def encode_pull(self, meta: dict, shards: list, values: list[torch.Tensor]) -> tuple[dict, list]:
        """(reply meta, tensors) for a pull's shards whose `values` are being sent (readers hold
        them). Plain where the pull did not ask, at version 0, or with an optimizer."""
        wire = meta.get("pull_compression")
        if wire is None:
            return {}, values
        codec, config = codec_of(wire)
        flags, tensors = [], []
        for shard, value in zip(shards, values, strict=True):
            packed = shard.optimizer is None and shard.version >= 1
            packed = packed and compressible(value.dtype, shard.numel, config)
            flags.append(packed)
            tensors += self._payload(shard, value, codec, config.error_feedback) if packed else [value]
        return {"compressed": flags}, tensors

    def _pull_state(self, shard: Any) -> _ShardPull:
        with self._lock:
            return self._pulls.setdefault((shard.key, shard.start), _ShardPull())

    def _payload(self, shard: Any, value: torch.Tensor, codec: Codec, feedback: bool) -> list[torch.Tensor]:
        """The shard's value encoded once per version: every worker's pull of it gets these."""
        state = self._pull_state(shard)
        with state.lock:
            if state.version != shard.version:
                if feedback and state.residual is None:
                    state.residual = torch.zeros_like(value)
                state.payload = codec.encode(value, state.residual if feedback else None)
                state.version = shard.version
            return state.payload

    def state_tensors(self, shard: Any) -> dict[str, torch.Tensor]:
        """The shard's pull residual, saved with its value (cut and joined like the value)."""
        state = self._pulls.get((shard.key, shard.start))
        if state is None or state.residual is None:
            return {}
        return {RESIDUAL: state.residual.clone()}

    def load_state(self, shard: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take the shard's residual out of its loaded state (zero where absent) and forget the
        payload encoded last (versions count from 0 again); returns the rest of the state."""
        rest = dict(state)
        residual = rest.pop(RESIDUAL, None)
        pull = self._pull_state(shard)
        with pull.lock:
            pull.version, pull.payload = -1, []
            pull.residual = None if residual is None else residual.reshape(-1).clone()
        return rest


def compression_config(spec: Any) -> CompressionConfig | None:
    """A kvstore's compression from MXNet's dict, a kind name, a config or None; PowerSGD is refused
    (a pair of all-reduces per matrix: the collective's)."""
    config = CompressionConfig.parse(spec)
    if config is not None and config.type == "powersgd":
        raise ValueError("compression type='powersgd' needs architecture='collective' (torch's DDP hook)")
    return config
