"""The serving layer's configuration, input declarations and errors.

`ServeConfig` is what a user sets for one HTTP endpoint (batching, limits, reload); `InputSpec`
declares one named input of the model (dtype and the shape of one row), so that a request of the
wrong shape or dtype is refused before it reaches the model. `BadRequest` carries the HTTP status
and a message naming the problem; the app turns it into a 4xx answer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paratrain.errors import ParatrainError
from paratrain.transport.http_limits import HttpLimits

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""The dtypes a request may carry, by the name used in headers and JSON."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class ServeError(ParatrainError):
    """Serving failed: no model could be loaded, or a stage process broke off."""


class BadRequest(Exception):
    """A request the server refuses; `status` is the HTTP status (400, 413, 415, 422)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class InputSpec:
    """One named input of the served model."""

    name: str
    """The keyword the model's forward takes it as ("inputs": the only, positional input)."""
    dtype: str = "float32"
    """Its dtype (one of DTYPES); JSON numbers are converted to it."""
    shape: tuple[int, ...] = ()
    """The shape of one row (a request carries [rows, *shape])."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"InputSpec.name={self.name!r} must be a Python identifier")
        if self.dtype not in DTYPES:
            raise ValueError(f"InputSpec.dtype={self.dtype!r} is not one of {sorted(DTYPES)}")
        shape = tuple(self.shape)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
            raise ValueError(f"InputSpec.shape={self.shape!r} must be ints >= 1")
        object.__setattr__(self, "shape", shape)

    @classmethod
    def parse(cls, text: str) -> InputSpec:
        """`NAME:DTYPE:D1xD2x...` (e.g. "x:float32:3x32x32", "ids:int64:26", "t:float32:" for scalars)."""
        parts = text.split(":")
        if len(parts) != 3:
            raise ValueError(f"input {text!r} must be NAME:DTYPE:SHAPE, e.g. x:float32:3x32x32")
        name, dtype, dims = parts
        try:
            shape = tuple(int(d) for d in dims.split("x")) if dims else ()
        except ValueError:
            raise ValueError(f"input {text!r}: shape {dims!r} must be ints joined by 'x'") from None
        return cls(name, dtype, shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def batch_shape(self) -> str:
        """The shape a request carries, as text: "[rows, 3, 32, 32]"."""
        return "[" + ", ".join(["rows", *map(str, self.shape)]) + "]"


@dataclass(frozen=True)
class ServeConfig:
    """How one endpoint batches, limits and reloads."""

    max_batch: int = 32
    """Most rows run as one batch (1: batching off, every request runs alone). A request with more
    rows than this runs alone."""
    batch_wait_s: float = 0.005
    """How long the first request of a batch waits for others to join it."""
    max_body_bytes: int = 16 << 20
    """Largest request body accepted (413 beyond)."""
    max_request_rows: int = 1024
    """Most rows one request may carry (413 beyond)."""
    inputs: Sequence[InputSpec] = ()
    """The model's inputs, checked on every request; empty: any tensors, passed as they come (a
    request the model then fails on gets a 422 with the model's error)."""
    model_name: str = "model"
    """The model's name in the Open Inference Protocol's routes (/v2/models/{model_name}/infer)."""
    reload_interval_s: float = 2.0
    """How often an output folder is checked for a newer complete checkpoint (0: never)."""
    channels_last: bool = True
    """Run a model with 2-D convolutions channels-last (NHWC, oneDNN's fast path on CPU; see
    serve/model.py); False: as the factory built it."""
    max_pending_body_bytes: int = 256 << 20
    """Most bytes of request bodies held at once, over every request still arriving or being
    decoded (503 beyond): with `max_body_bytes` per body, what slow clients can make the server hold."""
    limits: HttpLimits = HttpLimits()
    """The connection policy (transport/http_limits.py); its `body_timeout_s` bounds a body's arrival."""

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_body_bytes", "max_request_rows", "max_pending_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ServeConfig.{name}={value!r} must be an int >= 1")
        for name in ("batch_wait_s", "reload_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"ServeConfig.{name}={value!r} must be a number >= 0")
        if not isinstance(self.model_name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.model_name):
            raise ValueError(
                f"ServeConfig.model_name={self.model_name!r} must be letters, digits, '_', '.', '-'"
            )
        if not isinstance(self.limits, HttpLimits):
            raise ValueError(f"ServeConfig.limits={self.limits!r} must be an HttpLimits")
        inputs = tuple(self.inputs)
        if not all(isinstance(spec, InputSpec) for spec in inputs):
            raise ValueError(f"ServeConfig.inputs={self.inputs!r} must be InputSpecs")
        names = [spec.name for spec in inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"ServeConfig.inputs names {names} repeat")
        object.__setattr__(self, "inputs", inputs)
