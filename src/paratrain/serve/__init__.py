"""Serving trained models: an HTTP endpoint with dynamic batching, hot reload, models split across
processes, and embedding tables read from a running job's servers.

    paratrain serve --model mypkg.nets:make_model ckpt/            # newest checkpoint, reloaded
    paratrain serve --model mypkg.nets:make_model --stages 2 ckpt/ # stage i in process i
    paratrain export ckpt/ model.safetensors                       # weights only, no code to run
    state = paratrain.serve.load("ckpt/")                          # or load(path, model=net)

Modules: api.py (ServeConfig, InputSpec, errors), weights.py (load, export), codec.py (the request
and response forms), batcher.py (dynamic batching), app.py (Starlette routes and Prometheus
metrics), http.py (uvicorn), model.py (factory and hot reload), service.py (one process),
stages.py (stages in processes), remote.py (read-only tables of a running job), cli.py (commands).
"""

from __future__ import annotations

from paratrain.serve.api import BadRequest, InputSpec, ServeConfig, ServeError
from paratrain.serve.weights import export, load

__all__ = ["BadRequest", "InputSpec", "ServeConfig", "ServeError", "export", "load"]
