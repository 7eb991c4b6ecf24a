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

What a client can make the server hold is bounded: a body is read in pieces under its size cap
(`max_body_bytes`), its deadline (`limits.body_timeout_s`: 408) and a budget for every body held
at once (`max_pending_body_bytes`: 503), and one larger than OFF_LOOP_BYTES is decoded on a thread,
so a 16 MB JSON body (seconds of CPU) does not stall every other client's answers on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

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

T = TypeVar("T")
OFF_LOOP_BYTES = 64 << 10
"""Bodies larger than this are decoded on a thread; a smaller one decodes in less time than the
hand-off would cost."""
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

    predict = Predict(batcher, config, metrics)
    app = ServeApp(
        predict,
        routes=[
            Route("/predict", predict, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
            *OpenInference(batcher, config, endpoint.step).routes(),
            *routes,
        ],
        lifespan=lifespan,
    )
    app.state.metrics, app.state.batcher = metrics, batcher
    return app


class ServeApp(Starlette):
    """Starlette, with `POST /predict` handed to its handler before Starlette's middleware and
    router: they took about as much of the event loop's time per request as the handler itself
    (py-spy, 32 clients), and the handler answers every error itself (a 4xx or 500 naming it), which
    is what the middleware would add. Every other request goes the usual way."""

    def __init__(self, predict: Predict, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._predict = predict

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/predict" and scope["method"] == "POST":
            scope["app"] = self
            await self._predict(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


class Predict:
    """POST /predict as a plain ASGI app (Starlette routes to it as to any endpoint): the headers are
    read once into a dict and the answer goes out as two ASGI messages. Starlette's Request and
    Response objects and the request/response wrapper around the same work held the GIL about as
    long as the handler itself, beside a model that costs almost nothing (py-spy)."""

    def __init__(self, batcher: Batcher, config: ServeConfig, metrics: ServeMetrics) -> None:
        self.batcher, self.config, self.metrics = batcher, config, metrics
        self._ok = metrics.requests.labels("200")
        self.budget = BodyBudget(config.max_pending_body_bytes)

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
            if status in (408, 413, 503):  # the body may be partly unread: the connection cannot go on
                extra = {"connection": "close"}
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
        declared = int(length) if length is not None and length.isdigit() else 0
        with self.budget.holding(declared) as held:
            timeout_s = self.config.limits.body_timeout_s
            try:
                body = await within(_read_body(receive, limit, held), timeout_s)
            except asyncio.TimeoutError:
                raise BadRequest(408, f"the body did not arrive within {timeout_s} s") from None
            inputs = await self._decode(body, headers)
        rows = codec.rows_of(inputs)
        if rows > self.config.max_request_rows:
            raise BadRequest(413, f"the request has {rows} rows; the limit is {self.config.max_request_rows}")
        output, step = await self.batcher.predict(inputs)
        return codec.encode(output, headers.get("accept", ""), step)

    async def _decode(self, body: bytes, headers: dict[str, str]) -> dict[str, torch.Tensor]:
        args = (body, headers.get("content-type", ""), headers, self.config.inputs)
        if len(body) <= OFF_LOOP_BYTES:
            return codec.decode(*args)
        return await asyncio.get_running_loop().run_in_executor(None, codec.decode, *args)


class BodyBudget:
    """Bytes of request bodies held at once (ServeConfig.max_pending_body_bytes); used on the event
    loop only, so it needs no lock. Bodies up to OFF_LOOP_BYTES are not counted: the connection cap
    bounds what they hold, and slow large bodies filling the budget must not turn away the small
    requests of everyone else."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0

    @contextlib.contextmanager
    def holding(self, size: int) -> Iterator[Callable[[int], None]]:
        """Holds `size` bytes (the declared length) until the block ends; the block calls what it
        yields with a body's size so far, to hold more as an undeclared body grows."""
        taken = 0

        def grow(total: int) -> None:
            nonlocal taken
            if total > max(taken, OFF_LOOP_BYTES):
                self._take(total - taken)
                taken = total

        try:
            grow(size)
            yield grow
        finally:
            self.held -= taken

    def _take(self, size: int) -> None:
        if self.held + size > self.limit:
            raise BadRequest(
                503, f"the server holds {self.held} bytes of request bodies (limit {self.limit}): try again"
            )
        self.held += size


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """`asyncio.wait_for`, without the task it makes per call on Python 3.11 and later (a tenth of
    the event loop's time per request at 32 clients): there the deadline is on the running task."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout_s)  # pragma: no cover (3.10)


class ClientGone(Exception):
    """The client closed its connection before its request's body arrived: nobody to answer."""


async def _read_body(receive: Receive, limit: int, held: Callable[[int], None]) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if not chunks and not message.get("more_body", False):
            held(len(chunk))
            return chunk  # the whole body in one piece: no copy
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, f"the body is over the limit of {limit} bytes")
        held(size)
        if not message.get("more_body", False):
            return b"".join(chunks)
