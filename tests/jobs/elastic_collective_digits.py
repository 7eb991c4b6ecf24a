"""The digits job (examples/digits.py's model and loop) under `collective` in an elastic job
(JobConfig.elastic, min_workers 2): with `--kill RANK:EPOCH` (repeatable) that worker SIGKILLs itself
at batch 5 of that epoch, as a lost host would die; a replacement started by `--max-restarts` joins
the running job and does not. With `--await-replacement` the others wait for it at batch 8 of the
first death's epoch (this job's training is quicker than a new process's start), so it joins
mid-epoch and takes the dead worker's shard.
The learning rate drops for the last two epochs, so the final accuracy is stable from run to run.
Every worker prints its test accuracy, its steps and whether it joined."""

import argparse
import os
import signal
import time

import torch
from digits_cnn import make_model  # beside this script
from torch import nn
from torch.utils.data import DataLoader

import paratrain
from paratrain.data import digits

EPOCHS = 6


def learning_rate(epoch: int) -> float:
    """1e-2, then 2e-3 and 4e-4 for the last two epochs (the same on every worker)."""
    return 1e-2 * 0.2 ** max(0, epoch - EPOCHS + 3)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill", action="append", default=[], help="RANK:EPOCH (dies at batch 5)")
    parser.add_argument("--await-replacement", action="store_true")
    args = parser.parse_args()
    deaths = {tuple(int(n) for n in kill.split(":")) for kill in args.kill}
    first = min((epoch for _, epoch in deaths), default=None)
    config = paratrain.JobConfig(
        heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0, elastic=paratrain.ElasticConfig(min_workers=2)
    )
    ctx = paratrain.init(config)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate(0))
    loader = DataLoader(digits(train=True), batch_size=32, shuffle=True)
    trainer = paratrain.Trainer(model, optimizer, loader, strategy="collective", progress=False)
    for epoch in trainer.epochs(EPOCHS):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(epoch)
        for batch, (images, labels) in enumerate(trainer.loader):
            if batch == 5 and (ctx.rank, epoch) in deaths and not ctx.joined:
                os.kill(os.getpid(), signal.SIGKILL)
            if (epoch, batch) == (first, 8) and args.await_replacement and not ctx.joined:
                deadline = time.monotonic() + 120
                while len(ctx.members().workers) < 4 and time.monotonic() < deadline:
                    time.sleep(0.1)
            trainer.step(nn.functional.cross_entropy(trainer.model(images), labels))
    trainer.close()

    test = digits(train=False)
    with torch.no_grad():
        accuracy = (trainer.eval_step(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
    print(f"worker {ctx.rank}: test accuracy {accuracy:.4f} steps {trainer.steps} joined {ctx.joined}")
