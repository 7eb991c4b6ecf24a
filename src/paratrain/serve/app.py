"""The HTTP endpoint: a Starlette app on uvicorn in front of a Batcher.

    POST /predict   a request in any form of codec.py -> its output; 4xx naming what is wrong
    GET  /healthz   200 {"status": "ok", "model_step", "source"} once a model is loaded
    GET  /metrics   Prometheus text: requests by status, latency, batch sizes, model step, reloads

Why Starlette on uvicorn: a small, well-kept ASGI stack (FastAPI is built on it); an async handler
holds no thread while its request waits in the batcher, so thousands can wait at once. The handler
decodes and checks the request, submits it and awaits its future; the model runs on the batcher's
thread under `torch.inference_mode`. Each app has its own metrics registry, so several apps (tests,
a process serving stages) do not collide.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from paratrain.errors import ParatrainError
from paratrain.serve import codec
from paratrain.serve.api import BadRequest, ServeConfig
from paratrain.serve.batcher import Batcher, ModelInputError

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

    async def predict(request: Request) -> Response:
        start = time.perf_counter()
        try:
            response = await _predict(request, batcher, endpoint, config)
        except BadRequest as exc:
            response = JSONResponse({"error": str(exc)}, status_code=exc.status)
        except ModelInputError as exc:
            response = JSONResponse({"error": str(exc)}, status_code=422)
        except ParatrainError as exc:  # a server or stage process is gone: try again later
            response = JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=503)
        except Exception as exc:  # the server's fault: say so, keep serving
            logger.exception("/predict failed")
            response = JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)
        metrics.requests.labels(str(response.status_code)).inc()
        metrics.latency.observe(time.perf_counter() - start)
        return response

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
            Route("/predict", predict, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
            *routes,
        ],
        lifespan=lifespan,
    )
    app.state.metrics, app.state.batcher = metrics, batcher
    return app


async def _predict(request: Request, batcher: Batcher, endpoint: Endpoint, config: ServeConfig) -> Response:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
        raise BadRequest(413, f"the body is {length} bytes; the limit is {config.max_body_bytes}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > config.max_body_bytes:
            raise BadRequest(413, f"the body is over the limit of {config.max_body_bytes} bytes")
    inputs = codec.decode(
        bytes(body), request.headers.get("content-type", ""), request.headers, config.inputs
    )
    rows = codec.rows_of(inputs)
    if rows > config.max_request_rows:
        raise BadRequest(413, f"the request has {rows} rows; the limit is {config.max_request_rows}")
    output, step = await asyncio.wrap_future(batcher.submit(inputs))
    body_out, media_type, headers = codec.encode(output, request.headers.get("accept", ""), step)
    return Response(body_out, media_type=media_type, headers=headers)
