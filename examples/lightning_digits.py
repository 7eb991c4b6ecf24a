"""A LightningModule learns scikit-learn's digits under any paratrain strategy (Lightning's Trainer
and loop, paratrain's workers and servers).

    paratrain launch -w 2 -s 1 examples/lightning_digits.py --strategy dist_sync
    paratrain launch -w 2 -s 1 examples/lightning_digits.py --strategy dist_async
    paratrain launch -w 2 -s 0 examples/lightning_digits.py --strategy collective
    python examples/lightning_digits.py --strategy lightning     # Lightning's own single process

Every worker prints "accuracy A" on the test split at the end.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader

import paratrain
from paratrain.data import digits

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "--strategy", default=None, help="a paratrain strategy, or 'lightning' for Lightning's own"
)
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=32, help="per worker")
parser.add_argument("--lr", type=float, default=3e-3)
args = parser.parse_args()

ctx = paratrain.init()  # the scheduler and the servers serve in here and exit
# Imported after init: the scheduler and the servers never load Lightning (seconds of CPU each).
import lightning.pytorch as pl  # noqa: E402


class DigitsModule(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


pl.seed_everything(0, verbose=False)
module = DigitsModule(args.lr)
loader = DataLoader(digits(train=True), batch_size=args.batch_size, shuffle=True)
if args.strategy == "lightning":
    strategy = "auto"
else:
    from paratrain.integrations.lightning import ParatrainStrategy

    strategy = ParatrainStrategy(args.strategy)
trainer = pl.Trainer(
    strategy=strategy,
    accelerator="cpu",
    devices=1,
    max_epochs=args.epochs,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(module, loader)

test = digits(train=False)
with torch.no_grad():
    accuracy = (module(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
print(f"accuracy {accuracy:.4f}", flush=True)
