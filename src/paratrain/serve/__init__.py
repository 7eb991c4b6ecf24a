"""Serving trained models: an HTTP endpoint with dynamic batching, hot reload, models split across
processes, and embedding tables read from a running job's servers.

    paratrain serve --model mypkg.nets:make_model ckpt/            # newest checkpoint, reloaded
    paratrain serve --model mypkg.nets:make_model --stages 2 ckpt/ # stage i in process i
    paratrain export ckpt/ model.safetensors                       # weights only, no code to run
    state = paratrain.serve.load("ckpt/")                          # or load(path, model=net)

Modules: api.py (ServeConfig, InputSpec, errors), weights.py (load, export), codec.py (the request
and response forms), oip.py (the Open Inference Protocol, KServe v2), batcher.py (dynamic
batching), app.py (Starlette routes and Prometheus metrics), http.py (uvicorn), model.py (factory
and hot reload), service.py (one process), stages.py (stages in processes), remote.py (read-only
tables of a running job), cli.py (commands).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BadRequest", "InputSpec", "ServeConfig", "ServeError", "export", "load"]


def __getattr__(name: str) -> Any:
    # Lazy: `paratrain --help` and `paratrain launch` import serve/cli.py, which must not import torch.
    if name in ("BadRequest", "InputSpec", "ServeConfig", "ServeError"):
        from paratrain.serve import api

        return getattr(api, name)
    if name in ("export", "load"):
        from paratrain.serve import weights

        return getattr(weights, name)
    raise AttributeError(f"module 'paratrain.serve' has no attribute {name!r}")
