"""Exact-value kvstore job, in the manner of MXNet's nightly dist_sync_kvstore test.

Every worker pushes known rank-dependent values to small keys (int and str), to a key sliced across
every server, and to lists of keys, for several rounds; after each round it checks the pulled value
exactly, also after pushing further ahead than the servers' shared round buffers reach. Then it sets
a server-side optimizer and checks each round against a local torch reference.
argv: kind [rounds] [shm | tcp | mixed] [frame_bytes]  (tcp: the same-host path off, every byte over
TCP; mixed: only worker 1 over TCP, so the servers add its payloads into the others' shared round
buffers; frame_bytes: small values cut each server's share of a call into many frames)
"""

import sys

import torch

import paratrain
import paratrain.kvstore
import paratrain.kvstore.worker.client
from paratrain.kvstore import KVStoreConfig, resolve_kind
from paratrain.transport.config import TransportConfig

path = sys.argv[3] if len(sys.argv) > 3 else "shm"
tcp_only = paratrain.JobConfig(transport=TransportConfig(shm_ring_bytes=0))
ctx = paratrain.init(tcp_only if path == "tcp" else None)
over_tcp = path == "tcp" or (path == "mixed" and ctx.rank == 1)
if over_tcp:  # worker 1 of a mixed job plays one on another host: no server shares its machine
    paratrain.kvstore.worker.client.same_host = lambda peer, mine: False
kind = resolve_kind(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
frame_bytes = int(sys.argv[4]) if len(sys.argv) > 4 else KVStoreConfig().frame_bytes
config = KVStoreConfig(
    consistency=kind.consistency, aggregation=kind.aggregation, slice_elements=1000, frame_bytes=frame_bytes
)
kv = paratrain.kvstore.create(config)
if kind.aggregation == "process":  # the path under test is the one in use
    assert all(c.same_host_path is not over_tcp for c in kv._clients)
W = ctx.num_workers
shapes = {3: (2, 3), "bias": (7,), 99: (10_007,)}  # 99 is sliced across every server
base = {
    key: torch.arange(torch.Size(s).numel(), dtype=torch.float32).reshape(s) + 1 for key, s in shapes.items()
}
keys = list(shapes)
kv.init(keys, [torch.zeros(s) for s in shapes.values()])
outs = [torch.empty(s) for s in shapes.values()]
triangle = W * (W + 1) / 2  # sum over ranks of (rank + 1)

# Without an optimizer: a pull after round r is the sum of round r's pushes.
for r in range(rounds):
    grads = [(ctx.rank + 1) * (r + 1) * base[k] for k in keys]
    if r % 2 == 0:
        kv.pushpull(keys, grads, out=outs)
    else:  # push handles, then a pull, key by key
        handles = [kv.push(k, g) for k, g in zip(keys, grads)]
        for h in handles:
            h.wait()
        for k, o in zip(keys, outs):
            kv.pull(k, out=o)
    for k, o in zip(keys, outs):
        expected = (r + 1) * triangle * base[k]
        assert torch.equal(o, expected), (k, r, o.flatten()[:5], expected.flatten()[:5])
    print(f"round {r} exact")
if kind.aggregation == "process":  # same-host workers map every slice of the servers' shared memory
    assert all(bool(kv._keys[k].regions) is not over_tcp for k in keys)

# Pushing further ahead than the shared round buffers reach: worker 0 pushes 4 rounds alone first
# (a push returns once it joined its round), so its last 2 rounds find no open buffer and come as
# payloads; the servers sum those rounds apart, then copy them into the shared value.
ahead = 4


def push_ahead():
    for r in range(ahead):
        kv.push(keys, [(ctx.rank + 1) * (r + 1) * base[k] for k in keys]).wait()


alone = kind.aggregation == "process"  # device mode reduces on the host first: all push together
if ctx.rank == 0 or not alone:
    push_ahead()
kv.barrier()
if ctx.rank != 0 and alone:
    push_ahead()
kv.pull(keys, out=outs)
for k, o in zip(keys, outs):
    assert torch.equal(o, ahead * triangle * base[k]), (k, o.flatten()[:5])
print("push-ahead exact")

# With an optimizer on the servers: one step per round on the round's sum.
kv.set_optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
reference = {k: torch.nn.Parameter(o.clone()) for k, o in zip(keys, outs)}
ref_opt = torch.optim.SGD(list(reference.values()), lr=0.05, momentum=0.9)
for r in range(rounds):
    grads = [(ctx.rank + 1) * (r + 1) * base[k] for k in keys]
    kv.pushpull(keys, grads, out=outs)
    for k in keys:
        reference[k].grad = (r + 1) * triangle * base[k]
    ref_opt.step()
    for k, o in zip(keys, outs):
        assert torch.allclose(o, reference[k].detach(), rtol=1e-6, atol=1e-6), (k, r)
    print(f"optimizer round {r} exact")
if kind.aggregation == "process":  # what the servers counted: every worker's every push
    stats = kv.stats()[99]
    pushes = (2 * rounds + ahead) * W
    assert stats["slices"] == len(ctx.servers), stats
    assert stats["pushes"] == pushes and stats["bytes_in"] == pushes * 10_007 * 4, stats
    assert stats["version"] == 2 * rounds + ahead and stats["open_rounds"] == 0, stats
print("all exact")
