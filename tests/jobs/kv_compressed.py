"""Compressed kvstore rounds against a reference computed here, in every worker.

Each worker pushes seeded random gradients (every worker can make every worker's), for each kind
(2bit, topk, fp16), to a key sliced across the servers and to a key too small to compress. The
reference encodes each worker's push slice by slice with that worker's error feedback, sums the
decoded pushes, and (no optimizer: BytePS's both ways) encodes the sum with the server's error
feedback; the pulled values must match it. A save_state / load_state in the middle must bring
every residual back (the rounds after it are the same again). Then, with SGD on the servers,
pushes go compressed and the weights come back in full. Then the same workers run
ddp_compressed.py (one job for both: a job's start costs more than its checks).
argv: state_dir
"""

import runpy
import sys
import zlib
from pathlib import Path

import torch

import paratrain
import paratrain.kvstore
from paratrain.compression import CompressionConfig, make_codec
from paratrain.kvstore import KVStoreConfig

ctx = paratrain.init()
kv = paratrain.kvstore.create(KVStoreConfig(slice_elements=1000))  # "w" is sliced across every server
W, ROUNDS = ctx.num_workers, 4
SHAPES = {"b": (3, 5), "w": (4001,)}
state_path = Path(sys.argv[1]) / "servers.pt"


def grad(rank: int, step: int, key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank} {step} {key}".encode()))
    return torch.randn(SHAPES[key.split("/")[1]], generator=g) * 0.3


class Reference:
    """Every worker's and every server shard's residuals, slice by slice, as compressed.py keeps them."""

    def __init__(self, config: CompressionConfig, keys: list) -> None:
        self.codec, self.config = make_codec(config), config
        self.slices = {k: [(s.start, s.stop) for s in kv._keys[k].slices] for k in keys}
        pieces = [(k, a, b) for k in keys for a, b in self.slices[k]]
        self.workers = {(r, k, a): torch.zeros(b - a) for r in range(W) for k, a, b in pieces}
        self.servers = {(k, a): torch.zeros(b - a) for k, a, b in pieces}

    def round(self, step: int, key: object, pulls_compressed: bool) -> torch.Tensor:
        shape = SHAPES[key.split("/")[1]]
        total = torch.zeros(shape).reshape(-1)
        if total.numel() < self.config.min_elements:  # sent as it is: the plain sum
            return sum(grad(r, step, key) for r in range(W))
        for a, b in self.slices[key]:
            for r in range(W):
                piece = grad(r, step, key).reshape(-1)[a:b].contiguous()
                payload = self.codec.encode(piece, self.workers[(r, key, a)])
                self.codec.decode(payload, total[a:b], add=True)
            if pulls_compressed:
                self.codec.decode(self.codec.encode(total[a:b].clone(), self.servers[(key, a)]), total[a:b])
        return total.reshape(shape)

    def copy(self) -> dict:
        return {n: {k: v.clone() for k, v in getattr(self, n).items()} for n in ("workers", "servers")}

    def restore(self, saved: dict) -> None:
        self.workers, self.servers = saved["workers"], saved["servers"]


def check(kind: str, pulled: list, expected: list, step: int) -> None:
    for keyed, (p, e) in enumerate(zip(pulled, expected)):
        assert torch.allclose(p, e, atol=1e-6), (kind, step, keyed, (p - e).abs().max())


for kind in ["2bit", "topk", "fp16"]:
    config = CompressionConfig(kind, threshold=0.25, ratio=0.05)
    kv.set_gradient_compression(config.to_wire())
    keys = [f"{kind}/{k}" for k in SHAPES]
    kv.init(keys, [torch.zeros(s) for s in SHAPES.values()])
    ref = Reference(config, keys)
    outs = [torch.empty(s) for s in SHAPES.values()]
    for step in range(ROUNDS):
        if kind == "2bit" and step == 2:  # the residuals of both sides go into the checkpoint
            kv.save_state(state_path)
            saved = ref.copy()
        grads = [grad(ctx.rank, step, k) for k in keys]
        if step % 2 == 0:
            kv.pushpull(keys, grads, out=outs)
        else:
            kv.push(keys, grads).wait()
            kv.pull(keys, out=outs)
        check(kind, outs, [ref.round(step, k, True) for k in keys], step)
    if kind == "2bit":  # back to the state before round 2: rounds 2 and 3 again give the same
        kv.load_state(state_path)
        ref.restore(saved)
        for step in (2, 3):
            grads = [grad(ctx.rank, step, k) for k in keys]
            kv.pushpull(keys, grads, out=outs)
            check("2bit after load_state", outs, [ref.round(step, k, True) for k in keys], step)

# The optimizer on the servers: pushes compressed, pulled weights in full.
config = CompressionConfig("2bit", threshold=0.25)
kv.set_gradient_compression(config.to_wire())
kv.set_optimizer(torch.optim.SGD, lr=0.5)
keys = [f"sgd/{k}" for k in SHAPES]
start = [torch.randn(s, generator=torch.Generator().manual_seed(7)) for s in SHAPES.values()]
kv.init(keys, start)
ref = Reference(config, keys)
weights = [s.clone() for s in start]
outs = [torch.empty(s) for s in SHAPES.values()]
for step in range(ROUNDS):
    grads = [grad(ctx.rank, step, k) for k in keys]
    kv.pushpull(keys, grads, out=outs)
    for w, k in zip(weights, keys):
        w -= 0.5 * ref.round(step, k, False)
    check("sgd", outs, weights, step)
    assert any(not torch.equal(o, o.half().float()) for o in outs)  # full precision came back
kv.close()
print("compressed rounds match the reference", flush=True)
runpy.run_path(str(Path(__file__).with_name("ddp_compressed.py")))  # the same workers: DDP's hooks
