# train.py: `python train.py` runs it in one process, `paratrain launch -w 2 -s 1 train.py` as a job
import torch
from torch import nn

import paratrain

ctx = paratrain.init()  # the scheduler and the servers serve inside this call, then exit
torch.manual_seed(0)  # every worker builds the same data and model
x = torch.randn(4096, 20)
y = (x[:, :10].sum(1) > 0).long()  # the rule the model learns
data = torch.utils.data.TensorDataset(x, y)
loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

model, optimizer, loader = paratrain.prepare(model, optimizer, loader)  # the one added line
for epoch in range(3):
    for xb, yb in loader:  # this worker's shard of the data
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()  # gradients synced as the strategy says
with torch.no_grad():
    print(f"worker {ctx.rank}: accuracy {(model(x).argmax(1) == y).float().mean():.3f}")
