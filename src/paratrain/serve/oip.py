"""The Open Inference Protocol (KServe v2, Triton's HTTP/REST API) beside /predict, on the same batcher.

    GET  /v2                                   server metadata (name, version, extensions)
    GET  /v2/health/live   /v2/health/ready    200 {"live": true} / {"ready": true}
    GET  /v2/models/{name}[/versions/{v}]      model metadata: versions, inputs, outputs
    GET  /v2/models/{name}[/versions/{v}]/ready
    POST /v2/models/{name}[/versions/{v}]/infer

An infer request is `{"id"?, "parameters"?, "inputs": [{"name", "shape", "datatype", "data"}],
"outputs"?: [{"name", "parameters"?}]}`; `data` is row-major, flat or nested. The answer is
`{"model_name", "model_version", "id", "outputs": [{"name": "outputs", "shape", "datatype",
"data"}]}`. Triton's binary tensor extension is spoken both ways: a body whose JSON part is
`Inference-Header-Content-Length` bytes long, followed by the inputs whose `parameters` give a
`binary_data_size`; outputs asked for with `"parameters": {"binary_data": true}` (or the request's
`binary_data_output`) come back the same way. The model's version is its training step; errors are
`{"error": "..."}` with a 4xx (400 malformed, 404 unknown model or version, 413 too large, 422 not
what the model takes), 503 when a server or stage process is gone. Nothing a client sends is
executed or unpickled; BYTES tensors (strings) are refused, the models served take numbers.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from paratrain.errors import ParatrainError
from paratrain.serve.api import BadRequest, ServeConfig, dtype_name
from paratrain.serve.batcher import Batcher, ModelInputError
from paratrain.serve.codec import DEFAULT_NAME, check, rows_of
from paratrain.version import __version__

logger = logging.getLogger(__name__)

DATATYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "BF16": torch.bfloat16,
    "FP32": torch.float32,
    "FP64": torch.float64,
}
"""The protocol's tensor datatypes that torch has."""
DATATYPE_OF = {dtype: name for name, dtype in DATATYPES.items()}
HEADER_LENGTH = "inference-header-content-length"
OUTPUT = "outputs"
"""The name of the one output tensor (the same word as /predict's answer)."""


def datatype(dtype: torch.dtype) -> str:
    if dtype not in DATATYPE_OF:
        raise BadRequest(422, f"the model's output dtype {dtype_name(dtype)} has no Open Inference datatype")
    return DATATYPE_OF[dtype]


# -- the request ----------------------------------------------------------------------------------
def decode_infer(body: bytes, header_length: str | None, config: ServeConfig) -> tuple[dict, dict]:
    """(the request's JSON document, its inputs as named tensors for the model)."""
    binary = b""
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise BadRequest(
                400, f"Inference-Header-Content-Length {header_length!r} is not a length in 0..{len(body)}"
            )
        body, binary = body[: int(header_length)], body[int(header_length) :]
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(400, f"the request is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list) or not doc["inputs"]:
        raise BadRequest(400, 'an infer request must be an object with a non-empty list "inputs"')
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for item in doc["inputs"]:
        name, tensor, used = _input(item, binary, offset)
        if name in tensors:
            raise BadRequest(400, f"input {name!r} is given twice")
        tensors[name], offset = tensor, offset + used
    if offset != len(binary):
        raise BadRequest(400, f"the inputs use {offset} bytes of binary data; the body has {len(binary)}")
    inputs = _named_for_model(tensors, config)
    check(inputs, config.inputs)
    return doc, inputs


def _input(item: Any, binary: bytes, offset: int) -> tuple[str, torch.Tensor, int]:
    """(name, tensor, binary bytes used) of one entry of "inputs"."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise BadRequest(400, f"an input must be an object with a string name, not {item!r:.80}")
    name, shape, kind = item["name"], item.get("shape"), item.get("datatype")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise BadRequest(400, f"input {name!r} shape={shape!r} must be a list of ints >= 0")
    if kind not in DATATYPES:
        raise BadRequest(422, f"input {name!r} datatype={kind!r} is not one of {sorted(DATATYPES)}")
    dtype, count = DATATYPES[kind], math.prod(shape)
    size = (item.get("parameters") or {}).get("binary_data_size")
    if size is not None:
        if size != count * dtype.itemsize or offset + size > len(binary):
            raise BadRequest(
                400, f"input {name!r}: binary_data_size={size!r} is not {count} x {kind} within the body"
            )
        raw = bytearray(binary[offset : offset + size])
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return name, flat.reshape(shape), size
    if "data" not in item:
        raise BadRequest(400, f"input {name!r} has neither data nor parameters.binary_data_size")
    return name, _from_data(name, item["data"], dtype, shape, count), 0


def _from_data(name: str, data: Any, dtype: torch.dtype, shape: list[int], count: int) -> torch.Tensor:
    try:
        array = np.asarray(data, dtype=np.float64 if dtype.is_floating_point else np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadRequest(422, f"input {name!r} data is not a rectangular array of numbers: {exc}") from None
    if array.size != count:
        raise BadRequest(400, f"input {name!r} has {array.size} values; shape {shape} needs {count}")
    return torch.from_numpy(array.reshape(shape)).to(dtype)


def _named_for_model(tensors: dict[str, torch.Tensor], config: ServeConfig) -> dict[str, torch.Tensor]:
    """A lone input goes to the model's lone input whatever the client called it ("input__0",
    "INPUT0"): v2 clients name tensors by their own conventions. Several are matched by name."""
    specs = config.inputs
    if len(tensors) == 1 and len(specs) <= 1:
        return {specs[0].name if specs else DEFAULT_NAME: next(iter(tensors.values()))}
    return tensors


def wanted_binary(doc: dict) -> bool:
    """Whether the client asked for the output as binary data, and only for known outputs."""
    asked = doc.get("outputs") or []
    if not isinstance(asked, list):
        raise BadRequest(400, f'"outputs" must be a list of {{"name": ...}}, not {asked!r:.80}')
    binary = bool((doc.get("parameters") or {}).get("binary_data_output", False))
    for item in asked:
        name = item.get("name") if isinstance(item, dict) else None
        if name != OUTPUT:
            raise BadRequest(400, f"output {name!r} is not one of the model's outputs ['{OUTPUT}']")
        binary = bool((item.get("parameters") or {}).get("binary_data", binary))
    return binary


def encode_infer(output: torch.Tensor, doc: dict, name: str, version: str, binary: bool) -> Response:
    output = output.detach().to("cpu").contiguous()
    tensor: dict[str, Any] = {"name": OUTPUT, "shape": list(output.shape), "datatype": datatype(output.dtype)}
    answer: dict[str, Any] = {"model_name": name, "model_version": version, "outputs": [tensor]}
    if "id" in doc:
        answer["id"] = doc["id"]
    if not binary:
        tensor["data"] = output.flatten().tolist()
        return JSONResponse(answer)
    raw = (output.view(torch.int16) if output.dtype == torch.bfloat16 else output).numpy().tobytes()
    tensor["parameters"] = {"binary_data_size": len(raw)}
    head = json.dumps(answer).encode()
    headers = {"Inference-Header-Content-Length": str(len(head))}
    return Response(head + raw, media_type="application/octet-stream", headers=headers)


# -- the routes -----------------------------------------------------------------------------------
class OpenInference:
    """The v2 routes of one served model, called `name`, whose version is the step it was trained to."""

    def __init__(
        self,
        batcher: Batcher,
        config: ServeConfig,
        step: Callable[[], int | None],
    ) -> None:
        self.batcher, self.config, self.step = batcher, config, step
        self.name = config.model_name
        self._outputs: tuple[int | None, list] | None = None

    def routes(self) -> list[BaseRoute]:
        model, version = "/v2/models/{name}", "/v2/models/{name}/versions/{version}"
        return [
            Route("/v2", self.server, methods=["GET"]),
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            *(Route(path, self.metadata, methods=["GET"]) for path in (model, version)),
            *(Route(path + "/ready", self.model_ready, methods=["GET"]) for path in (model, version)),
            *(Route(path + "/infer", self.infer, methods=["POST"]) for path in (model, version)),
        ]

    @property
    def version(self) -> str:
        step = self.step()
        return "" if step is None else str(step)

    def _check_model(self, request: Request) -> None:
        name, version = request.path_params["name"], request.path_params.get("version")
        if name != self.name:
            raise BadRequest(404, f"model {name!r} is not served here; this server serves {self.name!r}")
        if version is not None and version != self.version:
            raise BadRequest(
                404, f"model {name!r} version {version!r} is not served; it is at {self.version!r}"
            )

    async def server(self, request: Request) -> Response:
        return JSONResponse(
            {"name": "paratrain", "version": __version__, "extensions": ["binary_tensor_data"]}
        )

    async def live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(self, request: Request) -> Response:
        return JSONResponse({"ready": True})

    async def model_ready(self, request: Request) -> Response:
        return await self._guarded(request, lambda: JSONResponse({"name": self.name, "ready": True}))

    async def metadata(self, request: Request) -> Response:
        async def answer() -> Response:
            inputs = [
                {"name": s.name, "datatype": datatype(s.torch_dtype), "shape": [-1, *s.shape]}
                for s in self.config.inputs
            ]
            doc = {"name": self.name, "versions": [self.version], "platform": "pytorch", "inputs": inputs}
            return JSONResponse(doc | {"outputs": await self._output_metadata()})

        return await self._guarded(request, answer)

    async def _output_metadata(self) -> list:
        """The output's datatype and shape, from one row of zeros through the model (once per
        model version); unknown (empty) when the inputs are not declared."""
        if not self.config.inputs:
            return []
        step = self.step()
        if self._outputs is None or self._outputs[0] != step:
            sample = {s.name: torch.zeros(1, *s.shape, dtype=s.torch_dtype) for s in self.config.inputs}
            output, _ = await self.batcher.predict(sample)
            shape = [-1, *output.shape[1:]]
            self._outputs = (step, [{"name": OUTPUT, "datatype": datatype(output.dtype), "shape": shape}])
        return self._outputs[1]

    async def infer(self, request: Request) -> Response:
        async def answer() -> Response:
            body = await _read_body(request, self.config.max_body_bytes)
            doc, inputs = decode_infer(body, request.headers.get(HEADER_LENGTH), self.config)
            rows = rows_of(inputs)
            if rows > self.config.max_request_rows:
                raise BadRequest(
                    413, f"the request has {rows} rows; the limit is {self.config.max_request_rows}"
                )
            binary = wanted_binary(doc)
            output, step = await self.batcher.predict(inputs)
            version = "" if step is None else str(step)
            return encode_infer(output, doc, self.name, version, binary)

        return await self._guarded(request, answer)

    async def _guarded(self, request: Request, answer: Callable[[], Any]) -> Response:
        status, error = 200, ""
        try:
            self._check_model(request)
            response = answer()
            if not isinstance(response, Response):
                response = await response
        except BadRequest as exc:
            status, error = exc.status, str(exc)
        except ModelInputError as exc:
            status, error = 422, str(exc)
        except ParatrainError as exc:
            status, error = 503, f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            logger.exception("%s failed", request.url.path)
            status, error = 500, f"{type(exc).__name__}: {exc}"
        return response if status == 200 else JSONResponse({"error": error}, status_code=status)


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BadRequest(413, f"the body is {length} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
