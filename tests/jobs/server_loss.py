"""The job of tests/test_server_loss.py: a whole replicated kvstore life, checked exactly.

    server_loss.py ROUNDS DIR [REPLICATION]

With JobConfig.replication=2 (or REPLICATION): configure, init of three keys (one sliced over the
servers), a server SGD with momentum, a key's own learning rate (set_hyperparameters), ROUNDS sync
rounds of known pushes, a checkpoint (save_state) halfway, a last pull, and the end (the workers
leave the rounds).
A server may die at any of these moments (kvstore/server/faults.py). Each worker replays every
worker's pushes through the single-process ReferenceStore (the uninterrupted run) and checks the
checkpoint and the last pull against it exactly; it prints `exact ok`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import paratrain
from paratrain.cluster.config import JobConfig
from paratrain.kvstore import KVStoreConfig, create
from paratrain.kvstore.reference import ReferenceStore
from paratrain.kvstore.worker.state import read_state

rounds, folder = int(sys.argv[1]), Path(sys.argv[2])
ctx = paratrain.init(JobConfig(replication=int(sys.argv[3]) if len(sys.argv) > 3 else 2))
kv = create(KVStoreConfig(consistency="sync", slice_elements=64, frame_bytes=256), ctx)
sizes = {"a": 8, "b": 3, "big": 200}  # "big" is sliced over the servers
keys = list(sizes)
initial = [torch.arange(n, dtype=torch.float32) / 4 for n in sizes.values()]
optimizer, hyper, own = "torch.optim.SGD", {"lr": 0.5, "momentum": 0.5}, {"lr": 0.25}
kv.init(keys, initial)
kv.set_optimizer(optimizer, **hyper)
kv.set_hyperparameters(["b"], **own).wait()
workers = ctx.num_workers

reference = ReferenceStore("sync", workers=workers)
for key, value in zip(keys, initial, strict=True):
    reference.init(key, value)
reference.set_optimizer(optimizer, **hyper)
reference.keys["b"].optimizer.param_groups[0].update(own)  # type: ignore[union-attr]


def grad(rank: int, step: int, n: int) -> torch.Tensor:
    """Small dyadic values: every sum and step is exact, whatever the order."""
    return (torch.arange(n, dtype=torch.float32) % 4 - rank - step % 3) / 8


outs = [torch.zeros(n) for n in sizes.values()]
checkpoint = folder / "state.pt"
for step in range(rounds):
    kv.pushpull(keys, [grad(ctx.rank, step, n) for n in sizes.values()], out=outs)
    for rank in range(workers):
        for key, n in sizes.items():
            reference.push(rank, key, grad(rank, step, n))
    if step == rounds // 2:
        kv.save_state(checkpoint)
        saved = {key: value for key, value, _ in read_state(checkpoint)}
        for key in keys:
            expected = reference.keys[key].value
            assert torch.equal(saved[key], expected), f"checkpoint: key {key!r} {saved[key]} != {expected}"
kv.pull(keys, out=outs)
for key, out in zip(keys, outs, strict=True):
    expected = reference.keys[key].value
    assert torch.equal(out, expected), f"key {key!r} holds {out.tolist()}, expected {expected.tolist()}"
print("exact ok", flush=True)
