"""The engine of fsdp with tensor parallelism (2-D parallelism), on the mesh of train/mesh.py.

The model is first split over the mesh's "tp" dimension (collective/tensor_parallel.py:
parallelize_module), then fully_shard'ed over "dp" (collective/fsdp.py); with as many workers as
tensor_parallel there is no "dp" to shard over and the model is only split. Checkpoints are fsdp's
(train/fsdp.py): DCP saves the DTensors, whatever their mesh, and loads them into any other layout.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paratrain.train.fsdp import FSDPEngine
from paratrain.train.mesh import mesh_dims
from paratrain.train.trainer import LocalEngine

if TYPE_CHECKING:
    from paratrain.train.strategy import Strategy

logger = logging.getLogger(__name__)


class MeshEngine(FSDPEngine):
    """fsdp over "dp" of a model split over "tp"; gradient sync is FSDP's (none where dp is 1:
    a tensor-parallel group computes its replicated parameters' gradients alike)."""

    handles_precision = False
    """Precision is autocast here: the split modules' DTensors and FSDP's policy are not combined yet."""
    shards_gradients = False
    """Clipping takes each mesh's DTensor norm made whole (train/gradients.py's total_norm): summing
    local shards over the workers would count the parameters a group holds whole once per worker."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy, ctx: Any
    ) -> None:
        from paratrain.cluster.rendezvous import init_torch_distributed
        from paratrain.collective import backend_for
        from paratrain.collective.fsdp import shard_model
        from paratrain.collective.tensor_parallel import align_random_state, device_mesh, parallelize

        init_torch_distributed(ctx, backend_for(model))
        dims = mesh_dims(strategy, ctx.num_workers)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.mesh = device_mesh(dims, device.type)
        align_random_state(self.mesh["tp"])
        blocks = strategy.fsdp_blocks.split() if strategy.fsdp_blocks else ()
        split = partial(parallelize, mesh=self.mesh["tp"], plan=strategy.tp_plan)
        sharded_model = shard_model(
            model,
            optimizer,
            blocks=blocks,
            reshard_after_forward=strategy.reshard_after_forward,
            mesh=self.mesh["dp"],
            split=split,
        )
        logger.info("mesh %s: tensor parallel inside, fsdp across", dims)
        LocalEngine.__init__(self, sharded_model)
        self.optimizer = optimizer
        self._checkpoint_group = None
        self.sharded_dp = dims["dp"] > 1

    def set_sync(self, sync: bool) -> None:
        if self.sharded_dp:
            super().set_sync(sync)
