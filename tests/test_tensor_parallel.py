"""Tensor parallelism (Strategy.tensor_parallel: torch's DTensor) inside fsdp, and its checkpoints."""

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from paratrain import checkpoint, serve
from paratrain.collective.tensor_parallel import default_plan, parallelize, resolve_plan
from paratrain.launch.api import check_strategy
from paratrain.testing import run_job
from paratrain.train import Strategy
from paratrain.train.fsdp import load_state
from paratrain.train.mesh import mesh_dims

JOBS = Path(__file__).parent / "jobs"


def test_tensor_parallel_fields_and_refusals():
    strategy = Strategy.parse("fsdp:tensor_parallel=2,tp_plan=body.*.0:colwise body.*.2:rowwise")
    assert (strategy.tensor_parallel, strategy.tp_plan) == (2, "body.*.0:colwise body.*.2:rowwise")
    as_dict = Strategy(architecture="fsdp", tensor_parallel=2, tp_plan={"up": "colwise", "down": "rowwise"})
    assert as_dict.tp_plan == "up:colwise down:rowwise"  # one canonical form, as checkpoints record it
    assert mesh_dims(strategy, 6) == {"dp": 3, "tp": 2}
    refusals = [
        ({"tensor_parallel": 2}, "Strategy.tensor_parallel=2 needs architecture='fsdp'"),
        ({"architecture": "fsdp", "tensor_parallel": 0}, "Strategy.tensor_parallel=0 must be an int >= 1"),
        ({"architecture": "fsdp", "tp_plan": "up:colwise"}, "tp_plan='up:colwise' needs tensor_parallel > 1"),
        ({"architecture": "fsdp", "tensor_parallel": 2, "tp_plan": "up:diagonal"}, "style 'diagonal'"),
        ({"architecture": "fsdp", "tensor_parallel": 2, "tp_plan": "up"}, "item 'up' is not pattern:style"),
        (
            {"architecture": "fsdp", "tensor_parallel": 2, "precision": "fp16"},
            "precision='fp16' with tensor_par",
        ),
    ]
    for fields, message in refusals:
        with pytest.raises(ValueError, match=message):
            Strategy(**fields)
    with pytest.raises(ValueError, match="tensor_parallel=4 does not divide the job's 6 worker"):
        check_strategy("fsdp:tensor_parallel=4", 0, 6)  # before any process starts


def _split_by_hand(model, mesh):
    model.split_over = mesh


def test_a_plan_may_be_a_function_that_splits_the_model_itself():
    strategy = Strategy(architecture="fsdp", tensor_parallel=2, tp_plan=_split_by_hand)
    assert strategy.as_dict()["tp_plan"] == f"{__name__}._split_by_hand"  # how a checkpoint names it
    model, mesh = nn.Linear(2, 2), object()
    assert parallelize(model, mesh, strategy.tp_plan) is model and model.split_over is mesh


def test_default_plan_splits_mlp_pairs_and_plans_are_checked():
    model = nn.Sequential(
        nn.Embedding(10, 8),
        nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 8)),
        nn.LayerNorm(8),
        nn.Linear(8, 6),
    )
    assert default_plan(model) == {"1.0": "colwise", "1.3": "rowwise"}
    assert default_plan(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))) == {}
    plan = {"0": "rowwise", "1.0": "colwise", "1.3": "rowwise", "3": "colwise_rep"}
    assert resolve_plan(model, plan, 2) == plan
    assert resolve_plan(model, {"*.0": "colwise"}, 4) == {"1.0": "colwise"}
    with pytest.raises(ValueError, match="tensor_parallel=4 does not divide '3''s out_features \\(6\\)"):
        resolve_plan(model, {"3": "colwise_rep"}, 4)
    with pytest.raises(ValueError, match="does not divide '0''s num_embeddings \\(10\\)"):
        resolve_plan(model, {"0": "rowwise"}, 4)
    with pytest.raises(ValueError, match="'2' colwise, but it is a LayerNorm"):
        resolve_plan(model, {"2": "colwise"}, 2)
    with pytest.raises(ValueError, match="pattern 'head' matches no module"):
        resolve_plan(model, {"head": "colwise"}, 2)


# -- jobs: parity with the single-process reference, and checkpoints loaded into other layouts -----
# Each run checks its parameters against one process on the same global batches (AdamW with two
# groups, a warmup, clipping over the split and sharded gradients, a LayerNorm left whole), saving
# a checkpoint every step; each resume takes that checkpoint into another layout and checks again.
@pytest.mark.parametrize(
    ("workers", "strategy", "resumes"),
    [
        (
            2,
            "fsdp:tensor_parallel=2,clip_grad_norm=0.5",
            [(2, "fsdp:clip_grad_norm=0.5"), (2, "ddp:clip_grad_norm=0.5")],
        ),
        (
            4,
            "fsdp:tensor_parallel=2,accumulation_steps=2,clip_grad_norm=0.5",
            [(4, "fsdp:clip_grad_norm=0.5")],
        ),
    ],
)
def test_tensor_parallel_matches_one_process_and_its_checkpoints_reshard(
    tmp_path, workers, strategy, resumes
):
    options = ("recipe", "rel", "tol=1e-5", "norm")
    ckpt = tmp_path / "ckpt"
    first = run_job(
        JOBS / "train_parity.py",
        workers=workers,
        args=(strategy, "3", *options, f"ckpt={ckpt}"),
        timeout_s=300,
    )
    for rank in range(workers):
        assert any(line.startswith("parity ok") for line in first.lines("worker", rank)), first.stdout
    found = checkpoint.latest(ckpt)
    assert found.step == 3 and checkpoint.latest(ckpt).meta["strategy"]["tensor_parallel"] == 2
    # In this process, with no process group: a plain model and optimizer take the split state whole.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3), nn.LayerNorm(3))
    start = {name: value.clone() for name, value in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    load_state(found.path, model, optimizer)
    assert optimizer.state_dict()["state"][0]["step"] == 3
    assert all(not torch.equal(start[name], value) for name, value in model.state_dict().items())
    weights = serve.load(serve.export(ckpt, tmp_path / "model.safetensors"))
    assert weights.keys() == start.keys()
    assert all(torch.equal(weights[name], value) for name, value in model.state_dict().items())
    for i, (resume_workers, resume_strategy) in enumerate(resumes):
        folder = tmp_path / f"resume-{i}"
        shutil.copytree(ckpt, folder)
        args = (resume_strategy, "5", *options, f"ckpt={folder}")
        second = run_job(JOBS / "train_parity.py", workers=resume_workers, args=args, timeout_s=300)
        for rank in range(resume_workers):
            lines = second.lines("worker", rank)
            assert "trained steps 3..5" in lines and any(line.startswith("parity ok") for line in lines), (
                lines
            )


SPLIT_JOB = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.train import Trainer


def build():
    return nn.Sequential(
        nn.Embedding(16, 8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Dropout(0.5), nn.LayerNorm(8),
        nn.Linear(8, 6),
    )


ctx = paratrain.init()
torch.manual_seed(ctx.rank)  # each worker's own random state and start, as a script seeding by rank has
model = build()
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randint(0, 16, (16, 5), generator=g), torch.randn(16, 5, 6, generator=g))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
strategy = "fsdp:tensor_parallel=2,tp_plan=0:rowwise 1:colwise 3:rowwise 6:colwise_rep"
trainer = Trainer(model, optimizer, DataLoader(data, batch_size=4), strategy=strategy, progress=False)
torch.manual_seed(0)
start = build().eval()  # worker 0's start, which every worker took
ids = data.tensors[0][:3]
assert (trainer.eval_step(ids) - start(ids)).abs().max() < 1e-5, "the split model computes otherwise"
for x, y in trainer.loader:
    trainer.step(nn.functional.mse_loss(trainer.model(x), y))
weights = [torch.empty(8), torch.empty(8)]
torch.distributed.all_gather(weights, trainer.model[5].weight.detach())
print("norm weights alike" if torch.equal(*weights) else f"norm weights differ: {weights}")
"""


def test_every_style_splits_alike_and_a_groups_workers_drop_alike_where_the_model_is_whole():
    outcome = run_job(SPLIT_JOB, workers=2, timeout_s=240)
    assert outcome.lines("worker", 0, "stdout") == ["norm weights alike"], outcome.stdout
