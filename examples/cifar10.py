"""CIFAR-10: a ResNet-style CNN on the real CIFAR-10 binary files.

    paratrain submit examples/cifar10.yaml                                   # the job platform
    paratrain launch -w 2 -s 1 examples/cifar10.py --data_dir ~/data        # holds cifar-10-batches-bin/
    paratrain launch -w 4 -s 0 examples/cifar10.py --data_dir ~/data --strategy collective
    python examples/cifar10.py --synthetic 2000                             # no data: generated files

Reads the binary distribution (data_batch_1..5.bin, test_batch.bin) with paratrain.data.CIFAR10. With
--synthetic N it first writes N training images in that format to a temporary folder (class-coloured
stripes, for trying the pipeline end to end; accuracy on them says nothing about CIFAR-10).

The only thing the job platform asks of it is UAI Train's convention: --data_dir, --output_dir,
--work_dir, --log_dir and --num_gpus (also read from PARATRAIN_DATA_DIR, PARATRAIN_OUTPUT_DIR, ...).
Checkpoints go to OUTPUT_DIR/checkpoints and metrics to OUTPUT_DIR/metrics. Run as the job's
evaluator (PARATRAIN_TASK=evaluator), it scores each new checkpoint on the test split while the
workers train, and writes the accuracy next to it.
"""

import argparse
import os
import tempfile

import torch
from torch import nn
from torch.utils.data import DataLoader

import paratrain
from paratrain import checkpoint
from paratrain.data import CIFAR10, write_cifar10_binary


class Block(nn.Module):
    """The basic residual block of ResNet-18/34: two 3x3 convolutions and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.shortcut = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet(width: int = 32, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        Block(width, width, 1),
        Block(width, 2 * width, 2),
        Block(2 * width, 4 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, classes),
    )


def augment(images: torch.Tensor) -> torch.Tensor:
    """Random crop (pad 4) and horizontal flip, on the whole batch at once."""
    n = images.shape[0]
    padded = nn.functional.pad(images, (4, 4, 4, 4), mode="reflect")
    dx, dy = torch.randint(0, 9, (2,)).tolist()
    out = padded[:, :, dy : dy + 32, dx : dx + 32]
    flip = torch.rand(n) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(3), out)


def evaluate(model: nn.Module, test: CIFAR10) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for images, labels in DataLoader(test, batch_size=500):
            correct += (model(images).argmax(1) == labels).sum().item()
    return correct / len(test)


# --8<-- [start:evaluator]
def run_evaluator(args: argparse.Namespace, test: CIFAR10) -> None:
    """Scores each new checkpoint until training has ended (the job's evaluator role)."""
    model = resnet(args.width)
    done_file = os.environ.get("PARATRAIN_TRAINING_DONE")
    for found in checkpoint.follow(args.output_dir, done_file=done_file, poll_s=0.5):
        try:
            model.load_state_dict(checkpoint.model_state(found))
        except checkpoint.CheckpointError as exc:  # pruned while being read: the next one comes
            print(f"evaluator: skipped step {found.step}: {exc}")
            continue
        accuracy = evaluate(model, test)
        checkpoint.write_evaluation(found, {"accuracy": accuracy, "test_images": len(test)})
        print(f"evaluator: step {found.step}: test accuracy {accuracy:.3f}")


# --8<-- [end:evaluator]


def dir_arg(name: str, help: str) -> None:
    """--name_dir and --name-dir, defaulting to the job platform's PARATRAIN_NAME_DIR."""
    env = f"PARATRAIN_{name.upper()}_DIR"
    parser.add_argument(
        f"--{name}_dir", f"--{name}-dir", dest=f"{name}_dir", default=os.environ.get(env), help=help
    )


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
dir_arg("data", "folder holding cifar-10-batches-bin/ (or the .bin files)")
dir_arg("output", "checkpoints (OUTPUT_DIR/checkpoints) and metrics (OUTPUT_DIR/metrics) go here")
dir_arg("work", "the job's working folder (UAI's convention; unused)")
dir_arg("log", "the job's log folder (UAI's convention; unused: the platform keeps each process's output)")
parser.add_argument("--num_gpus", "--num-gpus", type=int, default=0, help="UAI's convention (unused: CPU)")
parser.add_argument("--synthetic", type=int, default=0, help="no data: write this many train images first")
parser.add_argument("--strategy", default=None, help="dist_sync, collective, ... (default: the launch's)")
parser.add_argument("--epochs", type=int, default=30)
parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
parser.add_argument("--batch-size", type=int, default=128, help="per worker")
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--width", type=int, default=32)
parser.add_argument("--checkpoint-dir", default=None, help="default: OUTPUT_DIR/checkpoints")
parser.add_argument(
    "--checkpoint-every", type=int, default=None, help="steps (default: the job's, else an epoch)"
)
parser.add_argument("--metrics-dir", default=None, help="default: OUTPUT_DIR/metrics")
args = parser.parse_args()
if not args.data_dir and not args.synthetic:
    parser.error("give --data_dir (the CIFAR-10 binary files) or --synthetic N")
if args.output_dir:
    args.checkpoint_dir = args.checkpoint_dir or os.path.join(args.output_dir, "checkpoints")
    args.metrics_dir = args.metrics_dir or os.path.join(args.output_dir, "metrics")
if os.environ.get("PARATRAIN_TASK") == "evaluator":
    if not args.output_dir or not args.data_dir:
        parser.error("the evaluator needs --output_dir (the checkpoints) and --data_dir (the test split)")
    run_evaluator(args, CIFAR10(args.data_dir, train=False))
    raise SystemExit(0)

ctx = paratrain.init()
with tempfile.TemporaryDirectory() as scratch:
    data_dir = args.data_dir
    if args.synthetic:  # every worker writes the same files (same seed) into its own folder
        data_dir = write_cifar10_binary(scratch, train_per_file=args.synthetic // 5, test=args.synthetic // 5)
    train, test = CIFAR10(data_dir, train=True), CIFAR10(data_dir, train=False)
    torch.manual_seed(0)
    model = resnet(args.width)
    steps_per_epoch = len(train) // (args.batch_size * ctx.num_workers)
    total = (
        args.epochs * steps_per_epoch
        if not args.max_steps
        else min(args.max_steps, args.epochs * steps_per_epoch)
    )
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True
    )
    every = args.checkpoint_every
    if every is None and not os.environ.get("PARATRAIN_CHECKPOINT_EVERY"):
        every = steps_per_epoch if args.checkpoint_dir else 0
    trainer = paratrain.Trainer(
        model,
        optimizer,
        DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True),
        strategy=args.strategy,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=every,
        metrics_dir=args.metrics_dir,
    )
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    for _epoch in trainer.epochs(args.epochs):
        for images, labels in trainer.loader:
            trainer.step(loss_fn(trainer.model(augment(images)), labels))
            if trainer.steps >= total:
                break
        if trainer.steps >= total:
            break
    trainer.close()

    accuracy = evaluate(trainer.model, test)
    print(f"worker {ctx.rank}: test accuracy {accuracy:.3f} on {len(test)} images, {trainer.steps} steps")
