"""A dist_sync kvstore job whose worker 1 gets stuck in the user's code at round 5 (test_stacks.py).

Every worker pushes and pulls one key in rounds; worker 0's pulls then wait for worker 1 past
wait_warning_s (1 s), which asks every process of the job for its stacks. The test stops the job.
"""

import time

import torch

import paratrain
import paratrain.kvstore
from paratrain.kvstore import KVStoreConfig

ctx = paratrain.init()
kv = paratrain.kvstore.create(KVStoreConfig(consistency="sync", wait_warning_s=1.0))
kv.init("w", torch.zeros(4))
out = torch.zeros(4)


def stuck() -> None:
    time.sleep(3600)  # stuck here


for step in range(1000):
    if ctx.rank == 1 and step == 5:
        stuck()
    kv.pushpull("w", torch.ones(4), out)
