"""One model in this process behind the HTTP endpoint (the plain `paratrain serve`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from starlette.applications import Starlette
from torch import nn

from paratrain.serve.api import ServeConfig
from paratrain.serve.app import Endpoint, ServeMetrics, build_app
from paratrain.serve.codec import DEFAULT_NAME
from paratrain.serve.model import Factory, ModelHolder


def call_model(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """model(x) for the one unnamed input, else model(**inputs)."""
    if list(inputs) == [DEFAULT_NAME]:
        return model(inputs[DEFAULT_NAME])
    return model(**inputs)


def model_app(factory: Factory, source: str | Path, config: ServeConfig, kv: Any = None) -> Starlette:
    """An app serving `factory`'s model with the weights of `source`, reloaded as config says; with
    `kv` (remote.ReadOnlyStore) the factory's tables read from a running job, and POST /embeddings."""
    metrics = ServeMetrics(config.max_batch)
    holder = ModelHolder(
        factory,
        source,
        reload_interval_s=config.reload_interval_s,
        kv=kv,
        on_reload=lambda loaded: metrics.reloads.inc(),
        channels_last=config.channels_last,
    )

    def run_batch(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int | None]:
        return holder.run(lambda model: call_model(model, inputs))

    def close() -> None:
        holder.close()
        if hasattr(kv, "close"):
            kv.close()

    def info() -> dict:
        if kv is None:
            return {}
        return {"tables": sorted(map(str, kv.tables.tables)), "servers": len(kv.servers)} | kv.tables.counts

    endpoint = Endpoint(run_batch, lambda: holder.current.step, lambda: holder.current.source, close, info)
    routes = []
    if kv is not None:
        from paratrain.serve.remote import embeddings_route

        routes.append(embeddings_route(kv))
    app = build_app(endpoint, config, metrics, routes)
    app.state.holder = holder
    return app
