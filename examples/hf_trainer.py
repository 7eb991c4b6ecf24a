"""The Hugging Face Trainer (through Accelerate) on paratrain's workers and servers: the same tiny
GPT-2 as examples/hf_prepare.py, trained by `transformers.Trainer`.

    paratrain launch -w 2 -s 1 examples/hf_trainer.py --strategy dist_sync    # parameter servers
    paratrain launch -w 2 -s 0 examples/hf_trainer.py --strategy collective   # DDP, Accelerate's

Parameter servers: the HF Trainer runs as one process per worker (Accelerate sees no process
group) on the optimizer that `paratrain.prepare` made distributed, and on this worker's part of
the data; its gradient clipping is off (the gradients are pushed during backward, before it would
clip). Collective: paratrain's rendezvous makes the process group and Accelerate's DDP uses it.
Each worker prints "loss FIRST LAST" from the Trainer's log.
"""

import argparse
import os

import torch
from torch.utils.data import Dataset, Subset

import paratrain

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--strategy", default="dist_sync")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--out", default="hf-trainer-out")
args = parser.parse_args()

ctx = paratrain.init()
# Imported after init: the scheduler and the servers never load transformers (seconds of CPU each).
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

torch.manual_seed(0)
VOCAB, LENGTH = 64, 16
config = GPT2Config(
    vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
)
model = GPT2LMHeadModel(config)


class Counting(Dataset):
    def __init__(self, rows: int) -> None:
        starts, steps = torch.randint(0, VOCAB, (rows, 1)), torch.randint(1, 4, (rows, 1))
        self.tokens = (starts + steps * torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


data = Counting(512)
collective = paratrain.Strategy.parse(args.strategy).architecture in ("collective", "hybrid")
optimizers = (None, None)
if ctx.distributed and collective:
    from paratrain.cluster.rendezvous import init_torch_distributed

    init_torch_distributed(ctx)  # Accelerate finds the process group and wraps the model in DDP
    # Accelerate asks torchrun's variables whether it runs distributed; the group exists already,
    # so MASTER_ADDR/PORT are only read, never dialled.
    os.environ.update(
        RANK=str(ctx.rank),
        WORLD_SIZE=str(ctx.num_workers),
        LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"),
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
    )
elif ctx.distributed:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model, optimizer = paratrain.prepare(model, optimizer, strategy=args.strategy, progress=False)
    optimizers = (optimizer, None)
    data = Subset(data, range(ctx.rank, len(data), ctx.num_workers))  # this worker's part

training = TrainingArguments(
    output_dir=os.path.join(args.out, f"worker-{ctx.rank}"),
    per_device_train_batch_size=16,
    num_train_epochs=args.epochs,
    learning_rate=3e-3,
    weight_decay=0.0,
    lr_scheduler_type="constant",
    max_grad_norm=0.0 if optimizers[0] is not None else 1.0,
    logging_steps=5,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    seed=0,
)
trainer = Trainer(model=model, args=training, train_dataset=data, optimizers=optimizers)
trainer.train()
losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
print(f"loss {losses[0]:.4f} {losses[-1]:.4f}", flush=True)
