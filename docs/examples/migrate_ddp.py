"""After: a torchrun + DistributedDataParallel script on paratrain (docs/migrating/torchrun.md).

paratrain launch -w 2 -s 0 docs/examples/migrate_ddp.py    # all-reduce, as DDP did
paratrain launch -w 2 -s 1 docs/examples/migrate_ddp.py    # the same script on a parameter server
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain

ctx = paratrain.init()  # was: dist.init_process_group("gloo"); rank = dist.get_rank()
torch.manual_seed(0)
x = torch.randn(2048, 16)
y = x @ torch.linspace(-1, 1, 16) + 0.5
data = TensorDataset(x, y)
loader = DataLoader(data, batch_size=32, shuffle=True)  # was: sampler=DistributedSampler(data)
model = nn.Linear(16, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer, loader = paratrain.prepare(model, optimizer, loader)  # was: model = DDP(model)

for epoch in range(3):  # was: sampler.set_epoch(epoch); the loader reshuffles each epoch itself
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(xb).squeeze(1), yb)
        loss.backward()
        optimizer.step()
    if ctx.rank == 0:
        print(f"epoch {epoch} loss {loss.item():.4f}")
with torch.no_grad():
    final = nn.functional.mse_loss(model(x).squeeze(1), y).item()
print(f"worker {ctx.rank}: final loss {final:.6f}")
