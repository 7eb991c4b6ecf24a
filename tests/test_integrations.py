"""Lightning and Hugging Face on paratrain.

In one process: ParatrainStrategy's optimizer path (the closure first, then paratrain's step) gives
exactly Lightning's own weights, and what it does not support is refused by name. As jobs: a
LightningModule trained under ps (dist_sync), dist_async and collective (DDP, called through
Lightning's forward redirection) reaches the test accuracy of Lightning's own single-process run
within 1 point (examples/lightning_digits.py); a transformers GPT-2 built from a config learns
under dist_sync with paratrain.prepare (examples/hf_prepare.py), and with the HF Trainer through
Accelerate under collective (examples/hf_trainer.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paratrain.cluster.context import Context
from paratrain.testing import run_job
from paratrain.train.ps import server_hyperparameters

pl = pytest.importorskip("lightning.pytorch")
from paratrain.integrations.lightning import ParatrainStrategy  # noqa: E402

EXAMPLES = Path(__file__).parents[1] / "examples"
LIGHTNING_ARGS = ["--epochs", "20", "--lr", "1e-2"]
ENV = {"OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.timeout(400)


class Tiny(pl.LightningModule):
    def __init__(self, optimizers: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)
        self.count = optimizers
        self.automatic_optimization = optimizers == 1  # Lightning's own rule for several

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> list:
        return [torch.optim.SGD(self.parameters(), lr=0.1) for _ in range(self.count)]


def _fit(module: pl.LightningModule, strategy: object, **options: object) -> None:
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )
    trainer.fit(module, DataLoader(data, batch_size=8))


def _alone() -> Context:
    return Context(role="worker", rank=0, num_workers=1, num_servers=0)


def test_one_process_steps_equal_lightnings_own() -> None:
    own, ours = Tiny(), Tiny()
    _fit(own, "auto")
    _fit(ours, ParatrainStrategy("local", ctx=_alone()))
    for a, b in zip(own.parameters(), ours.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(ours.net.weight, Tiny().net.weight)  # it trained


@pytest.mark.parametrize(
    ("module", "options", "words"),
    [
        (lambda: Tiny(optimizers=2), {}, "one optimizer; configure_optimizers gave 2"),
        (Tiny, {"accumulate_grad_batches": 2}, "accumulate_grad_batches=2"),
    ],
    ids=["two optimizers", "accumulation"],
)
def test_what_the_strategy_cannot_do_is_refused(module, options, words) -> None:
    with pytest.raises(ValueError, match=words):
        _fit(module(), ParatrainStrategy("local", ctx=_alone()), **options)


def test_servers_rebuild_adamw_from_its_hyperparameters() -> None:
    """torch's AdamW keeps Adam's decoupled_weight_decay in its groups; AdamW() refuses it."""
    params = [nn.Parameter(torch.zeros(2))]
    hyper = server_hyperparameters(torch.optim.AdamW(params, lr=3e-3))
    assert hyper["lr"] == 3e-3 and "decoupled_weight_decay" not in hyper
    torch.optim.AdamW(params, **hyper)


# -- jobs -------------------------------------------------------------------------------------------
def _last(lines: list[str], word: str) -> list[float]:
    return [float(v) for v in next(line for line in reversed(lines) if line.startswith(word)).split()[1:]]


@pytest.fixture(scope="module")
def lightning_alone() -> float:
    """Lightning's own single-process accuracy, with the global batch of 2 workers (2 x 32)."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "lightning_digits.py"), "--strategy", "lightning"]
        + LIGHTNING_ARGS
        + ["--batch-size", "64"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, **ENV},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return _last(done.stdout.splitlines(), "accuracy")[0]


@pytest.mark.parametrize(("strategy", "servers"), [("dist_sync", 1), ("dist_async", 1), ("collective", 0)])
def test_lightning_module_reaches_lightnings_own_accuracy(
    lightning_alone: float, strategy: str, servers: int
) -> None:
    outcome = run_job(
        EXAMPLES / "lightning_digits.py",
        workers=2,
        servers=servers,
        args=["--strategy", strategy, *LIGHTNING_ARGS],
        env=ENV,
        timeout_s=300,
    )
    accuracy = _last(outcome.lines("worker", 0, "stdout"), "accuracy")[0]
    assert lightning_alone > 0.95, lightning_alone
    assert abs(accuracy - lightning_alone) <= 0.01, (strategy, accuracy, lightning_alone)


@pytest.mark.parametrize(
    ("script", "strategy", "servers"),
    [("hf_prepare.py", "dist_sync", 1), ("hf_trainer.py", "collective", 0)],
    ids=["prepare dist_sync", "HF Trainer collective"],
)
def test_transformers_model_learns(tmp_path: Path, script: str, strategy: str, servers: int) -> None:
    args = ["--strategy", strategy] + (["--out", str(tmp_path)] if script == "hf_trainer.py" else [])
    outcome = run_job(EXAMPLES / script, workers=2, servers=servers, args=args, env=ENV, timeout_s=300)
    for rank in (0, 1):
        first, last = _last(outcome.lines("worker", rank, "stdout"), "loss")
        assert last < 0.6 * first, (rank, first, last)  # ln(64) = 4.16 at the start
