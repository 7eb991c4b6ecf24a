"""A job for the Ray engine's tests: each process says where it runs, which GPUs it may use and
with how many threads, then argv[1] decides what the workers do.

    ok     every worker passes a barrier and exits 0
    exact  dist_sync rounds of pushpull on a key sliced across every server, each sum checked exactly
    raise  worker 1 raises once it joined; the others wait at a barrier until the job is aborted
    hang   every worker says "ready PID" and sleeps until it is stopped (kill and interrupt tests)
"""

import os
import sys
import time

import paratrain

role = os.environ["PARATRAIN_ROLE"]
env = os.environ
print(
    f"pid {os.getpid()} host {env['PARATRAIN_HOST']} gpus {env.get('CUDA_VISIBLE_DEVICES')!r} "
    f"threads {env.get('OMP_NUM_THREADS')}",
    flush=True,
)
mode = sys.argv[1]
ctx = paratrain.init()  # the scheduler and servers serve here until the job ends, then exit
if mode == "raise" and ctx.rank == 1:
    raise RuntimeError("worker 1 fails on purpose")
if mode == "exact":
    import torch

    print(f"place {ctx.local_rank} {ctx.local_world_size}", flush=True)  # among the workers on its node

    import paratrain.kvstore
    from paratrain.kvstore import KVStoreConfig

    kv = paratrain.kvstore.create(KVStoreConfig(consistency="sync", slice_elements=1000))
    base = {"big": torch.arange(10_007, dtype=torch.float32) + 1, "small": torch.arange(3.0) + 1}
    keys = list(base)
    kv.init(keys, [torch.zeros_like(v) for v in base.values()])
    triangle = ctx.num_workers * (ctx.num_workers + 1) / 2  # the sum over ranks of (rank + 1)
    for r in range(3):
        outs = [torch.empty_like(base[k]) for k in keys]
        kv.pushpull(keys, [(ctx.rank + 1) * (r + 1) * base[k] for k in keys], out=outs)
        for k, out in zip(keys, outs):
            assert torch.equal(out, (r + 1) * triangle * base[k]), (k, r, out[:5])
    assert kv.stats()["big"]["slices"] == len(ctx.servers), kv.stats()["big"]
    print("all exact", flush=True)
if mode == "hang":
    print(f"ready {os.getpid()}", flush=True)
    time.sleep(600)
ctx.barrier(timeout_s=60)
print("done", flush=True)
