"""The CNN of examples/digits.py, seeded, for the test jobs and their one-process references (one
copy: a job's script directory is on its sys.path; tests import it the same way); and a small MLP
for jobs that must be quick."""

import torch
from torch import nn


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def sync_reference_accuracy(model: nn.Module, lr: float, epochs: int, workers: int) -> float:
    """Plain sync's test accuracy, in this process: dist_sync with the optimizer on the servers
    takes one Adam step per round on the mean of the workers' batch losses, each worker reading its
    shard (the Trainer's ShardedLoader, seed 0)."""
    from torch.utils.data import DataLoader

    from paratrain.data import ShardedLoader, digits

    torch.set_num_threads(1)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loader = DataLoader(digits(train=True), batch_size=32, shuffle=True)
    shards = [ShardedLoader.from_loader(loader, workers, rank, seed=0) for rank in range(workers)]
    for _epoch in range(epochs):
        for batches in zip(*shards, strict=True):
            optimizer.zero_grad()
            loss = sum(nn.functional.cross_entropy(model(x), y) for x, y in batches) / workers
            loss.backward()
            optimizer.step()
    test = digits(train=False)
    with torch.no_grad():
        return (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
