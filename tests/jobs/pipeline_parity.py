"""Pipeline parity job: trains the model of `pipeline_model()` a few SGD steps under each given
pipeline configuration and saves, per rank, its stage's parameters (named by global block index)
and the losses, for the test to compare with single-process training of the whole model.

argv: out_dir spec...   spec = tag:stages:schedule:micro_batches:engine:replica_sync:split
(split: "auto" to balance by measured time, or split points joined by "+", e.g. "2+3+4"). With W
workers, a spec of s stages runs W / s replicas of the pipeline.
"""

import sys
from pathlib import Path

import torch

import paratrain
from paratrain.pipeline import PipelineConfig, pipeline_for

STEPS, ROWS, LR = 3, 10, 0.1


def pipeline_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    dims = [6, 16, 16, 16, 16]
    blocks = [torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Tanh()) for a, b in zip(dims, dims[1:])]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(16, 3)).double()


def pipeline_batches(replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches of ROWS rows per replica."""
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(ROWS * replicas, 6, generator=gen, dtype=torch.float64),
            torch.randn(ROWS * replicas, 3, generator=gen, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def run(ctx, out_dir: Path, spec: str) -> None:  # noqa: ANN001
    tag, stages, schedule, micro_batches, engine, sync, split = spec.split(":")
    points = None if split == "auto" else [int(p) for p in split.split("+")]
    config = PipelineConfig(
        int(stages), int(micro_batches), schedule, points, engine=engine, replica_sync=sync
    )
    model = pipeline_model()
    pipe = pipeline_for(
        model, config, loss_fn=torch.nn.functional.mse_loss, sample_input=torch.randn(4, 6).double()
    )
    opt = torch.optim.SGD(pipe.module.parameters(), lr=LR)
    losses, bubbles = [], []
    for x, y in pipeline_batches(pipe.replicas):
        mine = slice(pipe.replica * ROWS, (pipe.replica + 1) * ROWS)
        opt.zero_grad()
        loss = pipe.step(x[mine], y[mine])
        opt.step()
        losses.append(None if loss is None else loss.item())
        bubbles.append(pipe.bubble_fraction)
    blocks = {id(m): str(i) for i, m in enumerate(model)}
    state = {
        f"{blocks[id(block)]}.{name}": value.detach().clone()
        for block in pipe.module
        for name, value in block.state_dict().items()
    }
    torch.save(
        {
            "state": state,
            "losses": losses,
            "bubbles": bubbles,
            "peak": pipe.last_stats.in_flight_peak,
            "stage": pipe.stage,
            "replica": pipe.replica,
        },
        out_dir / f"{tag}_rank{ctx.rank}.pt",
    )
    assert all(0.0 <= b < 1.0 for b in bubbles), bubbles
    print(
        f"{tag} stage {pipe.stage} replica {pipe.replica} bubble {bubbles[-1]:.3f} "
        f"peak {pipe.last_stats.in_flight_peak}",
        flush=True,
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    ctx = paratrain.init()
    out_dir = Path(sys.argv[1])
    for spec in sys.argv[2:]:
        run(ctx, out_dir, spec)
    print("done", flush=True)
