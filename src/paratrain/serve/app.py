"""The HTTP endpoint: a Starlette app on uvicorn in front of a Batcher.

    POST /predict   a request in any form of codec.py -> its output; 4xx naming what is wrong
    GET  /healthz   200 {"status": "ok", "model_step", "source"} once a model is loaded
    GET  /metrics   Prometheus text: requests by status, latency, batch sizes, model step, reloads
    /v2/...         the Open Inference Protocol (KServe v2, Triton's REST API): oip.py

Why Starlette on uvicorn: a small, well-kept ASGI stack (FastAPI is built on it); an async handler
holds no thread while its request waits in the batcher, so thousands can wait at once. The handler
decodes and checks the request, submits it and awaits its future; the model runs on the batcher's
thread under `torch.inference_mode`. Each app has its own metrics registry, so several apps (tests,
a process serving stages) do not collide.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import torch
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from paratrain.errors import ParatrainError
from paratrain.serve import codec
from paratrain.serve.api import BadRequest, ServeConfig
from paratrain.serve.batcher import Batcher, ModelInputError
from paratrain.serve.oip import OpenInference

logger = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    """The endpoint's Prometheus metrics, in a registry of their own."""

    def __init__(self, max_batch: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "paratrain_serve_requests", "Requests to /predict by HTTP status", ["status"], registry=r
        )
        self.latency = Histogram(
            "paratrain_serve_request_seconds",
            "Time from a /predict request's arrival to its answer",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        buckets = sorted({2**i for i in range(max(max_batch, 1).bit_length() + 1)} | {max_batch})
        self.batch_rows = Histogram(
            "paratrain_serve_batch_rows", "Rows per batch run", buckets=buckets, registry=r
        )
        self.batch_requests = Histogram(
            "paratrain_serve_batch_requests", "Requests per batch run", buckets=buckets, registry=r
        )
        self.model_step = Gauge("paratrain_serve_model_step", "Training step of the model served", registry=r)
        self.reloads = Counter(
            "paratrain_serve_reloads", "Newer checkpoints loaded while serving", registry=r
        )

    def batch(self, rows: int, requests: int) -> None:
        self.batch_rows.observe(rows)
        self.batch_requests.observe(requests)


@dataclass
class Endpoint:
    """What the app serves: `run_batch` (named tensors -> (output rows, step of the model that ran
    them)), the step of the model now served (`step()`) and its source for /healthz; `close` stops
    what it owns."""

    run_batch: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, int | None]]
    step: Callable[[], int | None]
    source: Callable[[], str]
    close: Callable[[], None] = lambda: None
    info: Callable[[], dict] = dict
    """More fields for /healthz (a staged model: its split and process ids)."""


def build_app(
    endpoint: Endpoint,
    config: ServeConfig,
    metrics: ServeMetrics | None = None,
    routes: Sequence[BaseRoute] = (),
) -> Starlette:
    """The Starlette app serving `endpoint` with `config`'s batching and limits (and `routes`)."""
    metrics = metrics or ServeMetrics(config.max_batch)

    def run(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int | None]:
        with torch.inference_mode():
            return endpoint.run_batch(inputs)

    batcher = Batcher(run, config.max_batch, config.batch_wait_s, on_batch=metrics.batch)

    async def healthz(request: Request) -> Response:
        doc = {"status": "ok", "model_step": endpoint.step(), "source": endpoint.source()}
        return JSONResponse(doc | endpoint.info())

    async def prometheus(request: Request) -> Response:
        step = endpoint.step()
        if step is not None:
            metrics.model_step.set(step)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        batcher.close()
        endpoint.close()

    app = Starlette(
        routes=[
            Route("/predict", Predict(batcher, config, metrics), methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
            *OpenInference(batcher, config, endpoint.step).routes(),
            *routes,
        ],
        lifespan=lifespan,
    )
    app.state.metrics, app.state.batcher = metrics, batcher
    return app


class Predict:
    """POST /predict as a plain ASGI app (Starlette routes to it as to any endpoint): the headers are
    read once into a dict and the answer goes out as two ASGI messages. Starlette's Request and
    Response objects and the request/response wrapper around the same work held the GIL about as
    long as the handler itself, beside a model that costs almost nothing (py-spy)."""

    def __init__(self, batcher: Batcher, config: ServeConfig, metrics: ServeMetrics) -> None:
        self.batcher, self.config, self.metrics = batcher, config, metrics
        self._ok = metrics.requests.labels("200")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = time.perf_counter()
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        status, error = 200, ""
        try:
            body, media_type, extra = await self._answer(headers, receive)
        except ClientGone:
            return
        except BadRequest as exc:
            status, error = exc.status, str(exc)
        except ModelInputError as exc:
            status, error = 422, str(exc)
        except ParatrainError as exc:  # a server or stage process is gone: try again later
            status, error = 503, f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # the server's fault: say so, keep serving
            logger.exception("/predict failed")
            status, error = 500, f"{type(exc).__name__}: {exc}"
        if status != 200:
            body, media_type, extra = json.dumps({"error": error}).encode(), codec.JSON, {}
        head = [(b"content-type", media_type.encode()), (b"content-length", b"%d" % len(body))]
        head += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in extra.items()]
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": body})
        (self._ok if status == 200 else self.metrics.requests.labels(str(status))).inc()
        self.metrics.latency.observe(time.perf_counter() - start)

    async def _answer(self, headers: dict[str, str], receive: Receive) -> tuple[bytes, str, dict[str, str]]:
        limit = self.config.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise BadRequest(413, f"the body is {length} bytes; the limit is {limit}")
        body = await _read_body(receive, limit)
        inputs = codec.decode(body, headers.get("content-type", ""), headers, self.config.inputs)
        rows = codec.rows_of(inputs)
        if rows > self.config.max_request_rows:
            raise BadRequest(413, f"the request has {rows} rows; the limit is {self.config.max_request_rows}")
        output, step = await self.batcher.predict(inputs)
        return codec.encode(output, headers.get("accept", ""), step)


class ClientGone(Exception):
    """The client closed its connection before its request's body arrived: nobody to answer."""


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if not chunks and not message.get("more_body", False):
            return chunk  # the whole body in one piece: no copy
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, f"the body is over the limit of {limit} bytes")
        if not message.get("more_body", False):
            return b"".join(chunks)
