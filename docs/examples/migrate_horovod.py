"""After: a Horovod script on paratrain (docs/migrating/horovod.md).

paratrain launch -w 2 -s 0 docs/examples/migrate_horovod.py    # was: horovodrun -np 2 python ...
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain

ctx = paratrain.init()  # was: hvd.init()
torch.manual_seed(0)
x = torch.randn(2048, 16)
y = (x[:, :8].sum(1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)  # was: a DistributedSampler
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
# was: lr=0.01 * hvd.size(), then hvd.DistributedOptimizer(optimizer, compression=hvd.Compression.fp16)
# and hvd.broadcast_parameters(model.state_dict(), root_rank=0): prepare starts every worker from
# worker 0's weights, and the strategy names the compression.
optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * ctx.num_workers)
trainer = paratrain.Trainer(model, optimizer, loader, strategy="collective:compression=fp16", progress=False)

for epoch in trainer.epochs(3):
    for xb, yb in trainer.loader:
        trainer.step(nn.functional.cross_entropy(trainer.model(xb), yb))
with torch.no_grad():
    accuracy = (trainer.model(x).argmax(1) == y).float().mean().item()
print(f"worker {ctx.rank}: accuracy {accuracy:.3f}")  # was: if hvd.rank() == 0: ...
