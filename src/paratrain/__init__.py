"""paratrain: one PyTorch training script on one process, many processes, or many machines.

import paratrain
ctx = paratrain.init()      # serves and exits on the scheduler and servers; returns on workers
model, optimizer, loader = paratrain.prepare(model, optimizer, loader)   # strategy from the launch
kv = paratrain.kvstore.create("dist_sync")   # the subpackages work after `import paratrain`
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from paratrain.cluster import context as _context
from paratrain.version import __version__

__all__ = [
    "Context",
    "ElasticConfig",
    "JobConfig",
    "StragglerConfig",
    "Strategy",
    "Trainer",
    "init",
    "prepare",
    "__version__",
]

SUBPACKAGES = (
    "checkpoint",
    "cluster",
    "collective",
    "data",
    "kvstore",
    "launch",
    "metrics",
    "pipeline",
    "train",
    "transport",
)

if TYPE_CHECKING:
    from paratrain.cluster.config import ElasticConfig, JobConfig, StragglerConfig
    from paratrain.node import Context, init
    from paratrain.train import Strategy, Trainer, prepare


def _init() -> Any:
    from paratrain.node import init

    return init()


# The layers below take a context; where a caller passes none, it is the one init() makes (here, at
# the top: no lower layer starts the job).
_context.provide(_init)


def __getattr__(name: str) -> Any:
    # Lazy, so that `paratrain launch` starts without importing torch.
    if name in ("init", "Context"):
        from paratrain import node

        return getattr(node, name)
    if name in ("Strategy", "Trainer", "prepare"):
        from paratrain import train

        return getattr(train, name)
    if name in ("JobConfig", "ElasticConfig", "StragglerConfig"):
        from paratrain.cluster import config

        return getattr(config, name)
    if name in SUBPACKAGES:  # `import paratrain` then `paratrain.kvstore.create(...)`, as mx.kv.create
        return importlib.import_module(f"paratrain.{name}")
    raise AttributeError(f"module 'paratrain' has no attribute {name!r}")
