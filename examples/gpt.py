"""The standard recipe: a small decoder-only transformer learns Python's own standard library source.

    python examples/gpt.py                                                        # one process
    paratrain launch -w 2 -s 0 examples/gpt.py                                    # collective
    paratrain launch -w 2 -s 0 --strategy collective:pipeline_stages=2,micro_batches=4 examples/gpt.py
    paratrain launch -w 2 -s 1 --strategy ps:update_on=worker examples/gpt.py     # servers sum only
    paratrain launch -w 2 -s 2 --strategy dist_sync examples/gpt.py               # servers step
    paratrain launch -w 2 -s 0 --strategy fsdp examples/gpt.py                    # sharded
    paratrain launch -w 4 -s 0 --strategy fsdp:tensor_parallel=2 examples/gpt.py  # 2-D: tp x fsdp

The text needs no download: the standard library's .py files, read from this Python's own
installation (bytes as tokens, the last tenth of the text held out). The recipe is the usual one:
AdamW with two parameter groups (no weight decay on the 1-d parameters: biases and norms), a
linear warmup then a cosine decay (torch.optim.lr_scheduler),
the gradient clipped to norm 1.0 and the forward in bf16 (Strategy.clip_grad_norm and
Strategy.precision, which the Trainer applies to the aggregated gradient). Every worker that holds
the model's last stage prints the held-out perplexity at the end.

With the optimizer on the servers (dist_sync) the servers run each parameter group's
hyperparameters, take the schedule's lr with each round and clip each round's mean by its global
norm (docs/training.md). Under dist_async, which has no one mean per round, each worker clips its own
gradient before pushing it.
"""

import argparse
import math
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.train import resolve_strategy

FILES = ("argparse.py", "dataclasses.py", "difflib.py", "enum.py", "fractions.py", "functools.py",
         "heapq.py", "shlex.py", "textwrap.py", "typing.py")  # fmt: skip

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "--strategy", default=None, help="collective, ps:update_on=worker, ... (default: the launch's)"
)
parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
parser.add_argument("--batch-size", type=int, default=32, help="sequences per step, over all workers")
parser.add_argument("--context", type=int, default=64, help="tokens per sequence")
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--warmup", type=int, default=30, help="steps of linear warmup before the cosine decay")
parser.add_argument("--precision", default="bf16", help="32, bf16 or fp16")
parser.add_argument("--chars", type=int, default=400_000, help="bytes of text to read")
parser.add_argument("--seed", type=int, default=0)


def read_text(limit: int) -> bytes:
    """The standard library's source: FILES first, then the rest of its top-level .py files."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    paths = [folder / name for name in FILES] + sorted(folder.glob("*.py"))
    text, seen = b"", set()
    for path in paths:
        if path in seen or not path.is_file() or len(text) >= limit:
            continue
        seen.add(path)
        text += path.read_bytes()
    if len(text) < 10_000:
        raise SystemExit(f"found only {len(text)} bytes of Python source under {folder}")
    return text[:limit]


def windows(tokens: torch.Tensor, context: int) -> TensorDataset:
    """(input, next-token target) pairs of `context` tokens, starting every context // 2 tokens."""
    chunks = tokens.unfold(0, context + 1, context // 2)
    return TensorDataset(chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous())


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int, context: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each a residual branch. The forward counts heads
    from the projections' width (-1), so that under tensor parallelism (TP_PLAN) each worker
    attends with its own share of the heads."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_width = width // heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (
            proj(h).view(b, t, -1, self.head_width).transpose(1, 2) for proj in (self.q, self.k, self.v)
        )
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.norm2(x))


TP_PLAN = "*.q:colwise *.k:colwise *.v:colwise *.out:rowwise *.mlp.0:colwise *.mlp.2:rowwise"
"""Megatron's split of each block (Strategy.tp_plan): the heads' projections by columns and the
output projection by rows (one all-reduce per attention), and the MLP's pair likewise. The heads
must divide by Strategy.tensor_parallel."""


def gpt(vocab: int, width: int, layers: int, heads: int, context: int) -> nn.Sequential:
    """An nn.Sequential of blocks, so that a pipeline strategy can cut it between them."""
    head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab))
    return nn.Sequential(Embed(vocab, width, context), *(Block(width, heads) for _ in range(layers)), head)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    args = parser.parse_args()
    ctx = paratrain.init()
    strategy = resolve_strategy(args.strategy, ctx.num_servers, ctx.distributed)
    strategy = strategy.replace(precision=args.precision, clip_grad_norm=1.0)
    if strategy.tensor_parallel > 1 and strategy.tp_plan is None:
        strategy = strategy.replace(tp_plan=TP_PLAN)
    tokens = torch.tensor(list(read_text(args.chars)), dtype=torch.long)
    split = len(tokens) * 9 // 10
    train, held_out = windows(tokens[:split], args.context), windows(tokens[split:], args.context)

    torch.manual_seed(args.seed)
    model = gpt(256, args.width, args.layers, args.heads, args.context)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # biases and norms
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    per_replica = strategy.pipeline_stages * strategy.tensor_parallel  # workers that share batches
    replicas = (ctx.num_workers // per_replica) if ctx.distributed else 1
    loader = DataLoader(train, batch_size=args.batch_size // replicas, shuffle=True, drop_last=True)
    trainer = paratrain.Trainer(
        model, optimizer, loader, strategy=strategy, loss_fn=next_token_loss, seed=args.seed
    )
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, 0.01, 1.0, total_iters=args.warmup)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps - args.warmup, args.lr / 10)
    schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], [args.warmup])

    start = time.perf_counter()
    epochs = math.ceil(args.steps / len(trainer.loader))
    for _epoch in trainer.epochs(epochs):
        for inputs, targets in trainer.loader:
            if trainer.steps == args.steps:
                break
            trainer.train_step(inputs, targets)
            schedule.step()
    trainer.close()
    seconds = time.perf_counter() - start

    perplexity = held_out_perplexity(trainer, held_out)
    if perplexity is not None:
        print(
            f"worker {ctx.rank}: held-out perplexity {perplexity:.3f} after {trainer.steps} steps "
            f"in {seconds:.1f} s ({strategy.architecture}, {ctx.num_workers} workers, "
            f"{strategy.pipeline_stages} stages, precision {strategy.precision})"
        )


def held_out_perplexity(trainer: paratrain.Trainer, held_out: TensorDataset) -> float | None:
    """exp of the mean next-token loss over the held-out windows; None on a pipeline's other stages."""
    total, count = 0.0, 0
    for inputs, targets in DataLoader(held_out, batch_size=64, drop_last=True):
        logits = trainer.eval_step(inputs)  # every worker calls it: a pipeline's stages take part
        if logits is None:
            continue
        total += next_token_loss(logits.float(), targets.to(logits.device)).item() * len(targets)
        count += len(targets)
    return math.exp(total / count) if count else None


if __name__ == "__main__":
    main()
