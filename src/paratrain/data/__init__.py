"""paratrain's data layer: each worker's disjoint shard of a data set, its batches split across local
devices, and the readers the examples use.

loader = ShardedLoader(dataset, batch_size, num_replicas=world_size, rank=rank)
for epoch in range(epochs):
    for batch in loader:             # resumable: loader.state_dict() / load_state_dict()
        parts = split_and_load(batch, local_devices())
"""

from __future__ import annotations

from paratrain.data.cifar10 import CIFAR10, write_cifar10_binary
from paratrain.data.criteo import read_criteo, write_synthetic_criteo, zipf_ranks
from paratrain.data.digits import digits
from paratrain.data.loader import ShardedLoader
from paratrain.data.sampler import ShardSampler
from paratrain.data.split import first_rows, local_devices, merge, split_and_load, to_device

__all__ = [
    "CIFAR10",
    "ShardSampler",
    "ShardedLoader",
    "digits",
    "first_rows",
    "local_devices",
    "merge",
    "read_criteo",
    "split_and_load",
    "to_device",
    "write_cifar10_binary",
    "write_synthetic_criteo",
    "zipf_ranks",
]
