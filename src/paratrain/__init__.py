"""paratrain: one PyTorch training script on one process, many processes, or many machines.

import paratrain
ctx = paratrain.init()      # serves and exits on the scheduler and servers; returns on workers
model, optimizer, loader = paratrain.prepare(model, optimizer, loader)   # strategy from the launch
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Context", "JobConfig", "Strategy", "Trainer", "init", "prepare", "__version__"]

if TYPE_CHECKING:
    from paratrain.cluster.config import JobConfig
    from paratrain.node import Context, init
    from paratrain.train import Strategy, Trainer, prepare


def __getattr__(name: str) -> Any:
    # Lazy, so that `paratrain launch` starts without importing torch.
    if name in ("init", "Context"):
        from paratrain import node

        return getattr(node, name)
    if name in ("Strategy", "Trainer", "prepare"):
        from paratrain import train

        return getattr(train, name)
    if name == "JobConfig":
        from paratrain.cluster.config import JobConfig

        return JobConfig
    raise AttributeError(f"module 'paratrain' has no attribute {name!r}")
