"""A Hugging Face transformers model, built from a config (nothing downloaded), trained with
`paratrain.prepare` under any strategy: the loop is the one you would write for one process.

    paratrain launch -w 2 -s 1 examples/hf_prepare.py --strategy dist_sync
    paratrain launch -w 2 -s 0 examples/hf_prepare.py --strategy collective
    python examples/hf_prepare.py

A 2-layer GPT-2 learns sequences that count up by a fixed step (mod the vocabulary); each worker
prints "loss FIRST LAST": the mean loss of its first and last few steps.
"""

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

import paratrain

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "--strategy", default=None, help="dist_sync, dist_async, collective, ... (default: the launch's)"
)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=16, help="per worker")
args = parser.parse_args()

ctx = paratrain.init()  # the scheduler and the servers serve in here and exit
# Imported after init: the scheduler and the servers never load transformers (seconds of CPU each).
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

torch.manual_seed(0)
VOCAB, LENGTH = 64, 16
config = GPT2Config(
    vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
)
model = GPT2LMHeadModel(config)
starts, steps = torch.randint(0, VOCAB, (512, 1)), torch.randint(1, 4, (512, 1))
tokens = (starts + steps * torch.arange(LENGTH)) % VOCAB
loader = DataLoader(TensorDataset(tokens), batch_size=args.batch_size, shuffle=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

model, optimizer, loader = paratrain.prepare(model, optimizer, loader, strategy=args.strategy, progress=False)
losses = []
for epoch in range(args.epochs):
    loader.set_epoch(epoch)
    for (batch,) in loader:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
print(f"loss {first:.4f} {last:.4f}", flush=True)
