"""The loop every real job runs: devices, mixed precision, loss scaling, clipping, sample counts.

Multi-process parity (collective, ps, pipelines against one process) is in test_train.py's table;
these are the process-free checks, and one job that shows a clip under ps is not lost silently.
"""

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from paratrain.cluster.context import Context, device_for
from paratrain.cluster.spec import spec_from_env, spec_to_env
from paratrain.data import ShardedLoader, to_device
from paratrain.testing import run_job
from paratrain.train import Strategy, Trainer, prepare
from paratrain.train.precision import LossScaler, to_fp32

ALONE = Context("worker", 0, 1, 0)
CPU = {"ctx": ALONE, "device": "cpu"}  # these tests compare with references on the CPU
SECRET = {"PARATRAIN_SECRET": "ab" * 16}
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")


def cuda(test):
    """A test that needs a GPU: marked `cuda` (benchmarks/gpu.py runs them all), skipped without one."""
    return pytest.mark.cuda(NO_CUDA(test))


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))


def _batches(count: int, rows: int = 8, poison: int = -1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(rows, 6, generator=g), torch.randn(rows, 2, generator=g)) for _ in range(count)]
    if 0 <= poison < count:
        batches[poison][0][0, 0] = float("inf")
    return batches


# -- the strategy's fields ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Strategy(precision="fp8"), "Strategy.precision='fp8' is not one of 32, bf16, fp16"),
        (lambda: Strategy(clip_grad_norm=0), "Strategy.clip_grad_norm=0 must be a number > 0"),
        (lambda: Strategy(clip_grad_norm="1"), "Strategy.clip_grad_norm='1' must be a number"),
        (
            lambda: Strategy.parse("dist_async:precision=fp16"),
            "Strategy.precision='fp16' with the optimizer on the servers needs consistency='sync'",
        ),
        (
            lambda: Strategy.parse("dist_async_device:precision=fp16"),
            "Strategy.precision='fp16' with the optimizer on the servers needs consistency='sync', not async",
        ),
        (
            lambda: Strategy(precision="fp16", compression="fp16"),
            "Strategy.precision='fp16' with compression",
        ),
        (
            lambda: Strategy(clip_grad_norm=1.0, compression="topk"),
            "Strategy.clip_grad_norm=1.0 with compression",
        ),
    ],
)
def test_bad_precision_and_clipping_name_the_field_and_value(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        make()


def test_precision_and_clipping_parse_and_a_pipeline_under_ps_steps_on_its_workers():
    strategy = Strategy.parse("ps:update_on=worker,precision=fp16,clip_grad_norm=0.5")
    assert (strategy.precision, strategy.clip_grad_norm) == ("fp16", 0.5)
    assert Strategy(precision=32).precision == "32"
    assert Strategy.parse("ps:pipeline_stages=2,clip_grad_norm=1").clip_grad_norm == 1.0
    assert Strategy.parse("dist_sync:precision=bf16").precision == "bf16"  # no loss scaling to agree on
    assert Strategy.parse("dist_sync:precision=fp16").precision == "fp16"  # the servers agree on skips
    # The servers clip each sync round (a host's leader asks for the norm); async workers their own.
    for name in ("dist_sync:", "dist_async:", "ps:consistency=bounded,", "dist_sync_device:"):
        assert Strategy.parse(f"{name}clip_grad_norm=1").clip_grad_norm == 1


# -- loss scaling, clipping and autocast in one process ---------------------------------------------
def test_loss_scaler_follows_grad_scaler_through_overflows_and_growth():
    ours = LossScaler(init_scale=8.0, growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    for step, bad in enumerate([False, True, False, False, False, True, True, False]):
        grad = torch.tensor([1.0, float("nan") if bad else -2.0, 3.0]) * (step + 1)
        p.grad = theirs.scale(grad.clone())
        theirs.unscale_(opt)
        mine = ours.scale_loss(grad.clone())
        found = ours.unscale_([mine])
        assert bool(found.item()) == bad
        if not bad:
            torch.testing.assert_close(mine, p.grad, rtol=0, atol=0)
        theirs.step(opt)
        theirs.update()
        ours.update(found)
        assert ours.scale == theirs.get_scale(), step


@pytest.mark.parametrize("clip", [None, 0.2])
def test_fp16_alone_skips_the_overflowing_step_as_grad_scaler_does(clip):
    model, reference = _model(), _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    trainer = Trainer(
        model, optimizer, strategy=Strategy(precision="fp16", clip_grad_norm=clip), progress=False, **CPU
    )
    for step, (x, y) in enumerate(_batches(5, poison=2)):
        before = copy.deepcopy(model.state_dict())
        trainer.step(nn.functional.mse_loss(trainer.model(x), y))
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = reference(x)
        scaler.scale(nn.functional.mse_loss(out.float(), y)).backward()
        scaler.unscale_(ref_opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        scaler.step(ref_opt)
        scaler.update()
        if step == 2:
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert trainer.gate.scaler.scale == scaler.get_scale()
    assert trainer.gate.skipped == 1 and trainer.gate.scaler.scale == 2.0**15
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_the_last_background_checkpoint_is_committed_when_the_epochs_end(tmp_path):
    # A script that ends its epoch loop without close() must not lose a checkpoint whose write was
    # still in flight (under fsdp, checkpoints are written in the background).
    from concurrent.futures import Future

    from paratrain.train.trainer import _Saving

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, optimizer, strategy="local", progress=False, **CPU)
    written, committed = Future(), []
    written.set_result(None)
    trainer._saving = _Saving(written, tmp_path, 3, lambda: committed.append(3) or tmp_path)
    for _epoch in trainer.epochs(2):
        assert trainer.checkpoint_in_flight == 3 and not committed
    assert committed == [3] and trainer.checkpoint_in_flight is None


def test_a_checkpoint_keeps_the_loss_scale(tmp_path):
    def trainer() -> Trainer:
        model = _model()
        strategy = Strategy(precision="fp16")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return Trainer(model, optimizer, strategy=strategy, checkpoint_dir=tmp_path, progress=False, **CPU)

    first = trainer()
    for x, y in _batches(2, poison=0):
        first.step(nn.functional.mse_loss(first.model(x), y))
    first.save_checkpoint()
    assert first.gate.scaler.scale == 2.0**15 and trainer().gate.scaler.scale == 2.0**15


def test_clipping_in_a_pipeline_alone_spans_every_stage():
    model, reference = _model(), _model()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        strategy="collective:pipeline_stages=2,micro_batches=2,clip_grad_norm=0.05",
        loss_fn=nn.functional.mse_loss,
        progress=False,
        **CPU,
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for x, y in _batches(3):
        trainer.train_step(x, y)
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        assert norm > 0.05  # the clip is reached, else the check proves nothing
        ref_opt.step()
        assert trainer.gate.last_norm == pytest.approx(float(norm), rel=1e-5)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_bf16_runs_the_forward_in_bf16_and_gives_fp32_outputs():
    model = _model()
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="collective:precision=bf16", **CPU
    )
    x, y = _batches(1)[0]
    out = trainer.model(x)
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    trainer.step(nn.functional.mse_loss(out, y))
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())  # stepped, zeroed
    assert torch.is_autocast_enabled("cpu") is False  # left after the forward


def test_to_fp32_keeps_containers_and_other_dtypes():
    half = torch.ones(2, dtype=torch.float16)
    out = to_fp32({"logits": half, "ids": torch.ones(2, dtype=torch.int64), "rest": (half, [half], "x")})
    assert out["logits"].dtype == torch.float32 and out["ids"].dtype == torch.int64
    assert out["rest"][0].dtype == out["rest"][1][0].dtype == torch.float32 and out["rest"][2] == "x"


# -- samples ---------------------------------------------------------------------------------------
class _KeywordModel(nn.Module):
    """A Hugging Face-style model: model(**batch) or model(batch_dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 2)

    def forward(self, batch: dict | None = None, *, inputs: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(inputs if batch is None else batch["inputs"])


@pytest.mark.parametrize("call", ["kwargs", "dict"])
def test_samples_are_counted_for_keyword_and_dict_batches(call):
    model = _KeywordModel()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), progress=False, **CPU)
    for x, y in _batches(3, rows=5):
        batch = {"inputs": x}
        out = trainer.model(**batch) if call == "kwargs" else trainer.model(batch)
        trainer.step(nn.functional.mse_loss(out, y))
    assert trainer.progress.samples == 15


# -- devices ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("local_rank", "local_world_size", "gpus_per_worker", "cuda_devices", "device"),
    [
        (3, 4, None, 0, "cpu"),  # no GPU
        (3, 4, 0, 8, "cpu"),  # the launcher gave this worker none
        (3, 4, 1, 1, "cuda:0"),  # the launcher made only this worker's GPU visible
        (3, 8, None, 8, "cuda:3"),  # torchrun's way: every GPU visible, one per local rank
        (0, 1, None, 1, "cuda:0"),  # alone
        (1, 4, None, 2, "cpu"),  # fewer GPUs than processes: NCCL takes no two ranks on one GPU
    ],
)
def test_a_worker_s_device_follows_its_local_rank_and_the_gpus_it_sees(
    local_rank, local_world_size, gpus_per_worker, cuda_devices, device
):
    assert device_for(local_rank, local_world_size, gpus_per_worker, cuda_devices) == device


def _env(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split())


GLOBAL = "MASTER_ADDR=127.0.0.1 MASTER_PORT=29500"


@pytest.mark.parametrize(
    ("env", "local_rank", "local_world_size"),
    [
        (f"RANK=5 WORLD_SIZE=8 {GLOBAL} LOCAL_RANK=1 LOCAL_WORLD_SIZE=4", 1, 4),
        (
            f"SLURM_PROCID=5 SLURM_NTASKS=8 {GLOBAL} SLURM_LOCALID=2 SLURM_NODEID=1 "
            "SLURM_STEP_TASKS_PER_NODE=3(x2),2",
            2,
            3,
        ),
        (
            f"OMPI_COMM_WORLD_RANK=5 OMPI_COMM_WORLD_SIZE=8 {GLOBAL} OMPI_COMM_WORLD_LOCAL_RANK=1 "
            "OMPI_COMM_WORLD_LOCAL_SIZE=4",
            1,
            4,
        ),
        (f"PMI_RANK=5 PMI_SIZE=8 {GLOBAL} MPI_LOCALRANKID=0 MPI_LOCALNRANKS=2", 0, 2),
        (f"RANK=5 WORLD_SIZE=8 {GLOBAL}", None, None),  # unknown: the Context takes the worker's rank
    ],
)  # fmt: skip
def test_the_local_place_is_read_from_each_launcher_s_variables(env, local_rank, local_world_size):
    spec = spec_from_env({**_env(env), **SECRET, "PARATRAIN_HOST": "127.0.0.1"})
    assert (spec.local_rank, spec.local_world_size) == (local_rank, local_world_size)
    ctx = Context("worker", spec.rank, spec.num_workers, 0, spec=spec)
    assert (ctx.local_rank, ctx.local_world_size) == (
        (local_rank, local_world_size) if local_rank is not None else (spec.rank, spec.num_workers)
    )


def test_the_local_place_round_trips_through_paratrain_s_variables_and_is_checked():
    env = (
        _env(
            "PARATRAIN_ROLE=worker PARATRAIN_RANK=2 PARATRAIN_NUM_WORKERS=4 PARATRAIN_NUM_SERVERS=0 "
            "PARATRAIN_SCHEDULER=127.0.0.1:5000 LOCAL_RANK=2 LOCAL_WORLD_SIZE=4 PARATRAIN_GPUS_PER_WORKER=1"
        )
        | SECRET
    )
    spec = spec_from_env(env)
    assert (spec.local_rank, spec.local_world_size, spec.gpus_per_worker) == (2, 4, 1)
    assert spec_from_env({**spec_to_env(spec), **SECRET}) == spec
    with pytest.raises(ValueError, match="LOCAL_RANK=4 is out of range for LOCAL_WORLD_SIZE=4"):
        spec_from_env({**env, "LOCAL_RANK": "4"})
    with pytest.raises(ValueError, match="PARATRAIN_GPUS_PER_WORKER=-1 must be >= 0"):
        spec_from_env({**env, "PARATRAIN_GPUS_PER_WORKER": "-1"})


def test_alone_the_context_is_local_rank_0_on_the_cpu_or_its_gpu():
    assert (ALONE.local_rank, ALONE.local_world_size) == (0, 1)
    assert ALONE.device == torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def test_batches_move_to_the_device_with_their_nesting():
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), [torch.ones(1)]), "name": "a"}
    moved = to_device(batch, "cpu")
    assert moved["name"] == "a" and isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list)
    loader = ShardedLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), 2, shuffle=False)
    loader.device = torch.device("meta")  # any device that is not the DataLoader's own
    assert all(t.device.type == "meta" for (t,) in loader)


@cuda
def test_the_trainer_moves_the_model_and_every_batch_to_the_gpu():
    model = _model()
    data = torch.utils.data.TensorDataset(torch.randn(16, 6), torch.randn(16, 2))
    model, optimizer, loader = prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.DataLoader(data, batch_size=4),
        strategy="collective:precision=bf16", ctx=ALONE,
    )  # fmt: skip
    assert next(model.parameters()).device.type == "cuda"
    for x, y in loader:
        assert x.device.type == y.device.type == "cuda"
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x.cpu()), y).backward()  # inputs left on the CPU move too
        optimizer.step()


# -- a clip under ps that the servers would never see -------------------------------------------------
USER_CLIP = """
import torch, paratrain
from torch import nn
ctx = paratrain.init()
torch.manual_seed(0)
model = nn.Linear(4, 2)
model, optimizer = paratrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="dist_sync")
for _ in range(2):
    nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 2)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
"""


def test_a_users_clip_between_backward_and_step_under_ps_is_an_error_naming_the_strategy_field():
    outcome = run_job(USER_CLIP, workers=1, servers=1, expect="failure", timeout_s=120)
    assert "set Strategy.clip_grad_norm instead of clipping in the loop" in outcome.stderr, outcome.stderr


# -- the standard recipe as an example ----------------------------------------------------------------
GPT = Path(__file__).parent.parent / "examples" / "gpt.py"
GPT_ARGS = ("--steps", "30", "--width", "32", "--context", "32", "--chars", "40000", "--warmup", "5")


def _perplexities(lines: list[str]) -> list[float]:
    return [
        float(re.search(r"held-out perplexity ([0-9.]+)", line)[1]) for line in lines if "perplexity" in line
    ]


def test_the_gpt_recipe_learns_alone_under_fsdp_and_tensor_parallel_alike():
    alone = subprocess.run(
        [sys.executable, str(GPT), *GPT_ARGS],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # one torch thread, as each job process has here
    )
    [reference] = _perplexities(alone.stdout.splitlines())
    assert reference < 64, reference  # 256 equally likely bytes: 256
    # fsdp computes in bf16 through FSDP's policy rather than autocast: other roundings, same recipe;
    # tensor_parallel=2 splits the heads over the two workers. (collective runs the recipe in
    # tests/test_train.py's parity table.)
    for strategy in ("fsdp", "fsdp:tensor_parallel=2"):
        outcome = run_job(GPT, workers=2, servers=0, args=(*GPT_ARGS, "--strategy", strategy), timeout_s=300)
        found = _perplexities(outcome.stdout.splitlines())
        assert len(found) == 2, (strategy, found)
        assert all(abs(p - reference) <= 0.02 * reference for p in found), (strategy, reference, found)
