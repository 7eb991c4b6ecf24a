"""DDP with compression hooks against a reference computed here, in every rank.

2bit: each rank's gradient, with its error feedback, becomes +-threshold or 0 per element, and the
averaged gradient DDP leaves in .grad is the mean of those over ranks (elementwise, so the bucket
layout does not matter); checked exactly for several steps, across DDP's bucket rebuild. The
residuals survive a state_dict round trip per parameter. topk, fp16 and powersgd: every rank ends
with the same parameters, and the averaged gradient is near the true mean. Then top-k's optimizer
updates (collective/updates.py, what the Trainer runs): the parameters every rank ends with are the
reference's (SGD's updates, top-k'd with error feedback per rank, averaged).
"""

import torch
import torch.distributed as dist
from torch import nn

import paratrain
from paratrain.cluster.rendezvous import init_torch_distributed
from paratrain.collective import compression as hooks
from paratrain.collective import wrap_ddp
from paratrain.collective.updates import CompressedUpdates
from paratrain.compression import CompressionConfig
from paratrain.compression import reference as topk_reference

ctx = paratrain.init()
init_torch_distributed(ctx, "gloo")
W, rank, T = ctx.num_workers, ctx.rank, 0.02


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(r: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def local_grads(net: nn.Module, r: int, step: int) -> list[torch.Tensor]:
    net.zero_grad()
    x, y = batch(r, step)
    nn.functional.mse_loss(net(x), y).backward()
    return [p.grad.clone() for p in net.parameters()]


def train(kind: str, steps: int = 4) -> tuple[nn.Module, list[list[torch.Tensor]]]:
    """`steps` of backward through DDP (no optimizer step: parameters stay, gradients change with
    the batches); returns the DDP module and each step's averaged gradients."""
    ddp = wrap_ddp(
        model(), bucket_mb=0.001, compression=CompressionConfig(kind, threshold=T, ratio=0.1, min_elements=0)
    )
    seen = []
    for step in range(steps):
        ddp.zero_grad()
        x, y = batch(rank, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        seen.append([p.grad.clone() for p in ddp.parameters()])
    return ddp, seen


ddp, seen = train("2bit")
reference, residuals = model(), {r: None for r in range(W)}
for step, grads in enumerate(seen):
    mean = [torch.zeros_like(g) for g in grads]
    for r in range(W):
        corrected = local_grads(reference, r, step)
        if residuals[r] is not None:
            corrected = [c + e for c, e in zip(corrected, residuals[r])]
        sent = [T * (c >= T).float() - T * (c <= -T).float() for c in corrected]
        residuals[r] = [c - s for c, s in zip(corrected, sent)]
        mean = [m + s / W for m, s in zip(mean, sent)]
    for got, want in zip(grads, mean):
        assert torch.allclose(got, want, atol=1e-7), (step, (got - want).abs().max())
state = getattr(ddp, hooks.ATTRIBUTE).state_dict()
mine = {i: t for i, t in zip(state["params"], state["residuals"])}
for i, want in enumerate(residuals[rank]):
    assert torch.allclose(mine[i].reshape(want.shape), want, atol=1e-6), i

for kind in ("topk", "fp16", "powersgd"):
    ddp, seen = train(kind, steps=3)
    for p in seen[-1]:
        everyone = [torch.empty_like(p) for _ in range(W)]
        dist.all_gather(everyone, p)
        assert all(torch.equal(e, p) for e in everyone), kind
    reference = model()
    true = [sum(gs) / W for gs in zip(*(local_grads(reference, r, 0) for r in range(W)))]
    got = torch.cat([g.reshape(-1) for g in seen[0]])
    want = torch.cat([g.reshape(-1) for g in true])
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.5, kind
# topk under the Trainer's collective strategy sends optimizer updates (collective/updates.py): SGD
# here, so that rank r's update is lr x its gradient and the reference needs no optimizer state.
config, LR = CompressionConfig("topk", ratio=0.1, min_elements=0), 0.1
net, reference = model(), model()
updates, optimizer = CompressedUpdates(net, config), torch.optim.SGD(net.parameters(), lr=LR)
residuals = {r: [[0.0] * p.numel() for p in reference.parameters()] for r in range(W)}
for step in range(4):
    local_grads(net, rank, step)
    updates.before_step()
    optimizer.step()
    updates.after_step()
    mean = [torch.zeros(p.numel()) for p in reference.parameters()]
    per_rank = [local_grads(reference, r, step) for r in range(W)]
    for r in range(W):
        for i, g in enumerate(per_rank[r]):
            k = -(-g.numel() // 10)
            sent, residuals[r][i] = topk_reference.encode_topk(
                (LR * g).reshape(-1).tolist(), residuals[r][i], k
            )
            mean[i] += torch.tensor(topk_reference.decode_topk(sent, g.numel())) / W
    with torch.no_grad():
        for p, m in zip(reference.parameters(), mean):
            p.sub_(m.view_as(p))
    for got, want in zip(net.parameters(), reference.parameters()):
        assert torch.allclose(got, want, atol=1e-6), (step, (got - want).abs().max())
print("compressed DDP matches the reference", flush=True)
