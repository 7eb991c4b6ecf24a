"""Models the serving tests build by factory (`paratrain serve --model tests/serve_models.py:NAME`)."""

from __future__ import annotations

import torch
from torch import nn


def mlp() -> nn.Module:
    """4 -> 3 features."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


class TwoInputs(nn.Module):
    """model(x=float rows, ids=int rows): x @ W + the sum of an embedding of the ids."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.emb = nn.Embedding(10, 2)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.emb(ids).sum(1)


def two_inputs() -> nn.Module:
    torch.manual_seed(1)
    return TwoInputs()


def deep() -> nn.Sequential:
    """Six blocks, 8 -> 4 features: the model served in stages."""
    torch.manual_seed(2)
    dims = [8, 64, 64, 64, 64, 64, 4]
    return nn.Sequential(*(nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(dims, dims[1:])))


class ViewsConv(nn.Module):
    """A conv whose output is flattened with `.view`, which channels-last strides refuse."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        return self.fc(y.view(y.shape[0], -1))


def views_conv() -> nn.Module:
    torch.manual_seed(3)
    return ViewsConv()


def small_cnn() -> nn.Module:
    """conv, pool, flatten, linear: runs channels-last."""
    torch.manual_seed(4)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(36, 3)
    )
