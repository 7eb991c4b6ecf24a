"""A submitted job for tests/test_jobs.py. Workers train a linear model 4 steps with the Trainer,
which checkpoints where the job platform says (OUTPUT_DIR/checkpoints, every PARATRAIN_CHECKPOINT_EVERY
steps); worker 0 then stages step 5 halfway (a finished file and a half-written one) and every
worker waits to be stopped. As the evaluator (PARATRAIN_TASK=evaluator) it scores each checkpoint."""

import json
import os
import sys
import time

import torch

import paratrain
from paratrain import checkpoint


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=generator)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


if os.environ.get("PARATRAIN_TASK") == "evaluator":
    x, y = data()
    model = torch.nn.Linear(4, 1, bias=False)
    for found in checkpoint.follow(
        os.environ["PARATRAIN_OUTPUT_DIR"], os.environ["PARATRAIN_TRAINING_DONE"], 0.2
    ):
        model.load_state_dict(checkpoint.model_state(found))
        with torch.no_grad():
            mse = float(((model(x) - y) ** 2).mean())
        checkpoint.write_evaluation(found, {"mse": mse})
        print(f"scored step {found.step}", flush=True)
    sys.exit(0)

ctx = paratrain.init()
print(f"pid {os.getpid()}", flush=True)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1, bias=False)
trainer = paratrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), progress=False)
x, y = data()
for _ in range(4):
    trainer.step(((trainer.model(x) - y) ** 2).mean())
print("weights " + json.dumps(model.weight.detach().flatten().tolist()), flush=True)
if ctx.rank == 0:
    staging = checkpoint.staging_dir(trainer.checkpoint_dir, 5)
    checkpoint.save_file(staging / "model.pt", {"model": {"weight": torch.full((1, 4), 99.0)}})
    (staging / ".worker-0.pt.tmp-1").write_bytes(b"half a file")
print("staged", flush=True)
time.sleep(600)
