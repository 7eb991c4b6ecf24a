"""Pipeline fault job: 2 stages train a few steps; the stage `stage` fails in its forward of
micro-batch 1 at step `step`, by `mode`: raise (an exception), exit (os._exit(3)) or kill (SIGKILL).
Its peer is then blocked waiting for it; the job must end with a report naming the failed worker.

argv: mode stage step
"""

import os
import signal
import sys

import torch

import paratrain
from paratrain.pipeline import PipelineConfig, pipeline_for

STEPS = 5


def fail(mode: str) -> None:
    if mode == "raise":
        raise RuntimeError("injected fault")
    if mode == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    torch.set_num_threads(1)
    ctx = paratrain.init()
    mode, stage, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    config = PipelineConfig(stages=2, micro_batches=3, schedule="1f1b", split_points=(2,))
    pipe = pipeline_for(model, config, loss_fn=torch.nn.functional.mse_loss)
    forwards = 0

    def hook(module, inputs) -> None:  # noqa: ANN001
        global forwards
        if forwards == step * config.micro_batches + 1:
            fail(mode)
        forwards += 1

    if pipe.stage == stage:
        pipe.module.register_forward_pre_hook(hook)
    opt = torch.optim.SGD(pipe.module.parameters(), lr=0.1)
    for _ in range(STEPS):
        opt.zero_grad()
        pipe.step(torch.randn(6, 4), torch.randn(6, 2))
        opt.step()
    print("done", flush=True)
