"""Train a small classifier with checkpoints, then serve it: the serving tutorial's model.

paratrain launch -w 2 -s 1 docs/examples/serving_model.py ckpt      # or: python ... ckpt
paratrain serve --model docs/examples/serving_model.py:make_model --input inputs:float32:20 ckpt
"""

import sys

import torch
from torch import nn


def make_model() -> nn.Module:
    """The factory `paratrain serve --model FILE.py:make_model` calls: the same network, untrained."""
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4096, 20, generator=torch.Generator().manual_seed(0))
    return x, (x[:, :10].sum(1) > 0).long()


if __name__ == "__main__":
    import paratrain

    ctx = paratrain.init()
    torch.manual_seed(0)
    x, y = data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    trainer = paratrain.Trainer(model, optimizer, loader, checkpoint_dir=sys.argv[1], checkpoint_every=20)
    for epoch in trainer.epochs(2):
        for xb, yb in trainer.loader:
            trainer.step(nn.functional.cross_entropy(trainer.model(xb), yb))
    trainer.save_checkpoint()  # the last step too, so the server gets the final weights
    print(f"worker {ctx.rank}: trained {trainer.steps} steps into {sys.argv[1]}")
