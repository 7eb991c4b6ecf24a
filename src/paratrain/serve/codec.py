"""The wire forms of /predict: requests to named tensors, outputs to responses.

Requests (the Content-Type picks the form):
    application/json          {"inputs": [[...], ...]} (one input) or {"inputs": {"x": ..., "ids": ...}}
    application/x-safetensors a safetensors file: one tensor per input ("inputs" for the only one)
    application/octet-stream  the raw bytes of one input, with headers X-Dtype (float32, ...) and
                              X-Shape (comma-separated, rows first)
Every input is [rows, ...] with the same rows, of at most MAX_DIMS dimensions (the wire's limit:
a staged model sends them on). Answers are JSON ({"outputs", "shape", "dtype", "model_step"}) unless
the Accept header asks for application/x-safetensors ({"outputs": tensor}) or
application/octet-stream (raw bytes with X-Dtype and X-Shape). Whatever is wrong with a request
raises BadRequest naming it; nothing a client sends is executed or unpickled.

JSON is strict both ways: `NaN` and `Infinity` are not JSON, so a request holding them is refused
(400; send such values in a binary form), and an output's non-finite values are written as the
strings "NaN", "Infinity" and "-Infinity" (as protobuf's JSON mapping writes them), so every answer
parses with a strict parser.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from paratrain.serve.api import DTYPES, BadRequest, InputSpec, dtype_name
from paratrain.transport.tensors import MAX_DIMS

JSON = "application/json"
SAFETENSORS = "application/x-safetensors"
RAW = "application/octet-stream"
DEFAULT_NAME = "inputs"

Inputs = dict[str, torch.Tensor]


def decode(body: bytes, content_type: str, headers: Mapping[str, str], specs: Sequence[InputSpec]) -> Inputs:
    """The request's named tensors, checked against `specs` (when any)."""
    kind = content_type.split(";")[0].strip().lower()
    if kind in ("", JSON):
        inputs = _from_json(body, specs)
    elif kind == SAFETENSORS:
        inputs = _from_safetensors(body)
    elif kind == RAW:
        inputs = _from_raw(body, headers, specs)
    else:
        raise BadRequest(415, f"Content-Type {content_type!r} is not one of {JSON}, {SAFETENSORS}, {RAW}")
    check(inputs, specs)
    return inputs


def rows_of(inputs: Inputs) -> int:
    return next(iter(inputs.values())).shape[0]


def check(inputs: Inputs, specs: Sequence[InputSpec]) -> None:
    """Every input is [rows, ...] with the same rows; with specs, the names, dtypes and row shapes."""
    if not inputs:
        raise BadRequest(400, "the request carries no inputs")
    for name, tensor in inputs.items():
        if tensor.dim() > MAX_DIMS:
            raise BadRequest(422, f"input {name!r} has {tensor.dim()} dims; the limit is {MAX_DIMS}")
    rows = {name: t.shape[0] if t.dim() else None for name, t in inputs.items()}
    for name, n in rows.items():
        if not n:
            raise BadRequest(422, f"input {name!r} of shape {list(inputs[name].shape)} has no rows")
    if len(set(rows.values())) > 1:
        raise BadRequest(422, f"inputs have different numbers of rows: {rows}")
    if not specs:
        return
    wanted = {spec.name: spec for spec in specs}
    if set(inputs) != set(wanted):
        missing, extra = sorted(set(wanted) - set(inputs)), sorted(set(inputs) - set(wanted))
        raise BadRequest(
            422,
            f"inputs {sorted(inputs)} do not match the model's {sorted(wanted)}: missing {missing}, "
            f"unexpected {extra}",
        )
    for name, tensor in inputs.items():
        spec = wanted[name]
        if tensor.dtype != spec.torch_dtype:
            raise BadRequest(
                422, f"input {name!r} has dtype {dtype_name(tensor.dtype)}; the model takes {spec.dtype}"
            )
        if tuple(tensor.shape[1:]) != spec.shape:
            shape = list(tensor.shape)
            raise BadRequest(422, f"input {name!r} has shape {shape}; the model takes {spec.batch_shape}")


def _from_json(body: bytes, specs: Sequence[InputSpec]) -> Inputs:
    try:
        doc = json.loads(body, parse_constant=_not_json)
    except RecursionError:
        raise BadRequest(400, "the JSON body is nested too deep") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or "inputs" not in doc:
        raise BadRequest(400, 'a JSON request must be an object with "inputs"')
    value = doc["inputs"]
    named = value if isinstance(value, dict) else {_only_name(specs): value}
    dtypes = {spec.name: spec.torch_dtype for spec in specs}
    return {
        str(name): _tensor_from_list(str(name), data, dtypes.get(str(name))) for name, data in named.items()
    }


def _not_json(token: str) -> float:
    raise BadRequest(
        400, f"the body holds {token}, which is not JSON (send non-finite values in a binary form)"
    )


def _only_name(specs: Sequence[InputSpec]) -> str:
    if len(specs) > 1:
        names = [spec.name for spec in specs]
        raise BadRequest(422, f"the model takes several inputs {names}: send them as an object by name")
    return specs[0].name if specs else DEFAULT_NAME


def _tensor_from_list(name: str, data: object, dtype: torch.dtype | None) -> torch.Tensor:
    if not isinstance(data, list):
        raise BadRequest(422, f"input {name!r} must be a list (rows first), not {type(data).__name__}")
    depth, inner = 0, data
    while isinstance(inner, list) and inner:  # before torch walks it: a list nested 900 deep
        inner, depth = inner[0], depth + 1
        if depth > MAX_DIMS:
            raise BadRequest(
                422, f"input {name!r} is nested over {MAX_DIMS} deep; the limit is {MAX_DIMS} dims"
            )
    try:
        tensor = torch.tensor(data)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise BadRequest(422, f"input {name!r} is not a rectangular array of numbers: {exc}") from None
    if dtype is None:
        return tensor
    if not dtype.is_floating_point and tensor.is_floating_point():
        raise BadRequest(422, f"input {name!r} holds fractional numbers; the model takes {dtype_name(dtype)}")
    return tensor.to(dtype)


def _from_safetensors(body: bytes) -> Inputs:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        inputs = load(body)
    except (SafetensorError, ValueError, OSError, RuntimeError) as exc:
        raise BadRequest(400, f"the body is not a valid safetensors file: {exc}") from None
    return {str(name): t for name, t in inputs.items()}


def _from_raw(body: bytes, headers: Mapping[str, str], specs: Sequence[InputSpec]) -> Inputs:
    dtype_text, shape_text = headers.get("x-dtype"), headers.get("x-shape")
    if dtype_text is None or shape_text is None:
        raise BadRequest(400, f"a {RAW} body needs headers X-Dtype and X-Shape")
    dtype = DTYPES.get(dtype_text.strip())
    if dtype is None:
        raise BadRequest(422, f"X-Dtype {dtype_text!r} is not one of {sorted(DTYPES)}")
    try:
        shape = [int(n) for n in shape_text.split(",")]
    except ValueError:
        raise BadRequest(422, f"X-Shape {shape_text!r} must be comma-separated ints") from None
    if any(n < 0 for n in shape):
        raise BadRequest(422, f"X-Shape {shape_text!r} has a negative size")
    if len(shape) > MAX_DIMS:
        raise BadRequest(422, f"X-Shape has {len(shape)} dims; the limit is {MAX_DIMS}")
    size = math.prod(shape) * dtype.itemsize
    if size != len(body):
        raise BadRequest(
            400, f"X-Shape {shape} of {dtype_name(dtype)} is {size} bytes; the body has {len(body)}"
        )
    if not size:
        tensor = torch.empty(shape, dtype=dtype)
    elif dtype == torch.bfloat16:  # numpy has no bfloat16
        tensor = torch.frombuffer(bytearray(body), dtype=dtype).reshape(shape)
    else:  # through numpy: its calls keep the GIL, where torch's let it go and wait for it back
        tensor = torch.from_numpy(np.frombuffer(bytearray(body), dtype=dtype_name(dtype)).reshape(shape))
    return {_only_name(specs): tensor}


def encode(output: torch.Tensor, accept: str, step: int | None) -> tuple[bytes, str, dict[str, str]]:
    """(body, media type, headers) of one request's output in the form `accept` asks for."""
    if output.requires_grad or not output.is_cpu or not output.is_contiguous():
        output = output.detach().to("cpu").contiguous()  # tested first: each call costs microseconds
    headers = {"X-Model-Step": str(step if step is not None else -1)}
    if SAFETENSORS in accept:
        from safetensors.torch import save

        return (
            save({"outputs": output}, metadata={"model_step": headers["X-Model-Step"]}),
            SAFETENSORS,
            headers,
        )
    if RAW in accept:
        headers |= {"X-Dtype": dtype_name(output.dtype), "X-Shape": ",".join(map(str, output.shape))}
        as_numpy = output.view(torch.int16) if output.dtype == torch.bfloat16 else output  # numpy has no bf16
        return as_numpy.numpy().tobytes(), RAW, headers
    doc: dict[str, object] = {"outputs": output.tolist(), "shape": list(output.shape)}
    doc["dtype"] = dtype_name(output.dtype)
    doc["model_step"] = step
    text = json.dumps(doc)
    if output.is_floating_point() and not bool(torch.isfinite(output).all()):
        text = _NON_FINITE.sub(r'"\1"', text)  # only numbers write these tokens: the doc holds no text
    return text.encode(), JSON, headers


_NON_FINITE = re.compile(r"(-?Infinity|NaN)")
