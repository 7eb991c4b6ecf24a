"""Elastic all-reduce: survivors of a dead worker re-form the group and go on from their last commit,
and a replacement joins (collective/elastic.py, cluster/rendezvous.py, train/elastic.py)."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from paratrain.cluster.rendezvous import rank_map
from paratrain.collective import elastic
from paratrain.data import ShardedLoader, digits
from paratrain.testing import run_job


def test_rank_map_orders_the_members_by_worker_rank():
    assert rank_map([3, 0, 2]) == {0: 0, 2: 1, 3: 2}
    assert rank_map([1, 1, 4]) == {1: 0, 4: 1}
    assert rank_map([]) == {}


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_restore_returns_model_and_optimizer_to_the_commit_and_keeps_it_intact():
    model, optimizer = _trained()
    saved = elastic.commit(model, optimizer, steps=2, extra={"loader": {"epoch": 1, "batches": 3}})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moment = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    for _ in range(2):  # the model and the optimizer move on; the commit does not
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    assert not torch.equal(model[0].weight, expected["0.weight"])
    for _ in range(2):  # restore twice: training after the first restore must not change the commit
        elastic.restore(saved, model, optimizer)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
        assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], moment)
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    assert saved.steps == 2 and saved.extra["loader"]["batches"] == 3


def test_a_commit_crosses_the_wire_without_pickle_and_loads_into_a_fresh_optimizer():
    model, optimizer = _trained()
    saved = elastic.commit(model, optimizer, steps=7, extra={"loader": {"epoch": 1}, "pair": (1, 2.5)})
    blob, tensors = elastic.encode(saved.as_tree())
    skeleton, empty = elastic.placeholders(blob)
    assert [(t.shape, t.dtype) for t in empty] == [(t.shape, t.dtype) for t in tensors]
    for target, source in zip(empty, tensors):  # what the broadcast does
        target.copy_(source)
    back = elastic.Commit.from_tree(elastic.decode(skeleton, empty))
    assert back.steps == 7 and back.extra == {"loader": {"epoch": 1}, "pair": (1, 2.5)}
    fresh, fresh_optimizer = _trained(seed=1)  # a replacement: other weights, its own Adam state
    elastic.restore(back, fresh, fresh_optimizer)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    mine, theirs = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    for index, moments in mine["state"].items():
        assert all(torch.equal(value, theirs["state"][index][name]) for name, value in moments.items())


def test_a_state_that_cannot_be_sent_is_refused_naming_where():
    with pytest.raises(TypeError, match="/extra/when is a object"):
        elastic.encode({"extra": {"when": object()}})
    with pytest.raises(TypeError, match="state key"):
        elastic.encode({("a", 1): 1})


def test_peer_failures_are_told_from_other_errors():
    import torch.distributed as dist

    assert elastic.is_peer_failure(RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer"))
    assert elastic.is_peer_failure(dist.DistBackendError("anything"))
    assert not elastic.is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not elastic.is_peer_failure(ValueError("Connection closed by peer"))


# -- a worker dies (and is replaced) in a running collective job --------------------------------------
JOB = Path(__file__).parent / "jobs" / "elastic_collective_digits.py"


@pytest.fixture(scope="module")
def reference_accuracy() -> float:
    """The job without failure, in one process: 4 workers' batches of 32 are one batch of 128."""
    sys.path.insert(0, str(JOB.parent))
    try:
        job = importlib.import_module(JOB.stem)
    finally:
        sys.path.remove(str(JOB.parent))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker trains (the launcher's OMP_NUM_THREADS)
    try:
        return _train_alone(job)
    finally:
        torch.set_num_threads(threads)


def _train_alone(job) -> float:
    model = job.make_model()
    optimizer = torch.optim.Adam(model.parameters())
    loader = ShardedLoader(digits(train=True), 128)
    for epoch in range(job.EPOCHS):
        for group in optimizer.param_groups:
            group["lr"] = job.learning_rate(epoch)
        for images, labels in loader:
            nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
    test = digits(train=False)
    with torch.no_grad():
        return (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()


def _finals(outcome, ranks) -> list[tuple[float, int, bool]]:
    """(accuracy, steps, joined) that each worker of `ranks` printed last."""
    finals = []
    for rank in ranks:
        lines = outcome.lines("worker", rank, "stdout")
        found = re.search(
            r"test accuracy ([0-9.]+) steps (\d+) joined (True|False)", lines[-1] if lines else ""
        )
        assert found, (rank, lines[-3:], outcome.stderr[-3000:])
        finals.append((float(found.group(1)), int(found.group(2)), found.group(3) == "True"))
    return finals


@pytest.mark.timeout(400)
def test_collective_job_survives_killed_workers_and_takes_in_a_replacement(reference_accuracy):
    """One job (two would cost twice the CI time): worker 2 dies in epoch 1 and its replacement joins
    mid-epoch; worker 1 dies in epoch 3 and, the one restart spent, is not replaced."""
    args = ["--kill", "2:1", "--kill", "1:3", "--await-replacement"]
    outcome = run_job(JOB, workers=4, args=args, timeout_s=300, elastic=True, max_restarts=1)
    assert "dropped worker 2" in outcome.stderr and "dropped worker 1" in outcome.stderr
    assert "joined at epoch 1, batch 9, reading shard 2 of 4" in outcome.stderr  # the dead one's
    finals = _finals(outcome, (0, 2, 3))
    accuracies = {accuracy for accuracy, _, _ in finals}
    assert len(accuracies) == 1, finals  # one model on every member: the group re-formed, in step
    assert len({steps for _, steps, _ in finals}) == 1, finals
    assert abs(accuracies.pop() - reference_accuracy) <= 0.01, (finals, reference_accuracy)
    assert [joined for _, _, joined in finals] == [False, True, False]
    assert not [line for line in outcome.lines("worker", 1, "stdout") if "accuracy" in line]
