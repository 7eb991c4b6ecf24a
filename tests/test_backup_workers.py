"""Backup workers (consistency.Backup): sync rounds that apply once all but b workers pushed.

The server's shard state (server/shard.py) is driven through every interleaving a seed gives and
compared, step by step, with the reference store (kvstore/reference.py); one real job with a slowed
worker learns as plain sync does.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import pytest
import torch

from paratrain.kvstore import KVStoreConfig
from paratrain.kvstore.api import KVError
from paratrain.kvstore.consistency import Backup, Sync, from_wire, parse
from paratrain.kvstore.reference import ReferenceStore, WouldWait
from paratrain.kvstore.server.rules import Push, Rules
from paratrain.kvstore.server.shard import ShardState
from paratrain.testing import run_job
from paratrain.train.strategy import Strategy

JOBS = Path(__file__).parent / "jobs"


class Worker:
    """One worker of a key, as the client counts: its clock is how many times it pushed."""

    def __init__(self, rank: int) -> None:
        self.rank, self.clock = rank, 0


def push(state: ShardState, worker: Worker, grad: list[float]) -> None:
    """What the server does with one push frame (server.py, _push): admit, check, push."""
    p = state.admit(Push(worker.rank, worker.clock, torch.tensor(grad)))
    worker.clock += 1
    state.check(p)
    state.push(p)


def pull(state: ShardState, worker: Worker) -> torch.Tensor | None:
    """What the server does with one pull (server.py, pulls.py): None while it would wait."""
    need = state.pull_version(worker.rank, state.rules.policy.min_version(worker.clock))
    if not state.ready(need):
        return None
    state.served(worker.rank)
    return state.value.clone()


def shard(policy, workers: int, average: bool = True) -> ShardState:  # noqa: ANN001
    rules = Rules(policy, frozenset(range(workers)), average=average)
    return ShardState("w", 0, 2, 2, [2], "float32", torch.zeros(2), rules)


def test_a_round_applies_with_all_but_b_and_a_late_push_is_dropped_not_carried():
    state = shard(Backup(1), workers=3)
    ref = ReferenceStore(Backup(1), workers=3, average=True)
    ref.init("w", torch.zeros(2))
    w = [Worker(r) for r in range(3)]
    for rank, grad in ((0, [2.0, 4.0]), (1, [4.0, 0.0])):  # two of three: round 0 applies
        push(state, w[rank], grad)
        ref.push(rank, "w", torch.tensor(grad))
    assert state.version == 1 and state.value.tolist() == [3.0, 2.0] == ref.pull(0, "w").tolist()
    assert pull(state, w[0]).tolist() == pull(state, w[1]).tolist() == [3.0, 2.0]
    push(state, w[2], [100.0, 100.0])  # worker 2's gradient of round 0 comes late: dropped
    ref.push(2, "w", torch.tensor([100.0, 100.0]))
    assert state.counts["late"] == ref.late == 1 and state.version == 1 and state.rounds == {}
    assert pull(state, w[2]).tolist() == [3.0, 2.0]  # it goes on from the newest value
    ref.pull(2, "w")
    for rank, grad in ((2, [1.0, 1.0]), (0, [3.0, 3.0])):  # its next push joins round 1, not 0
        push(state, w[rank], grad)
        ref.push(rank, "w", torch.tensor(grad))
    assert state.version == 2 and state.value.tolist() == [2.0, 2.0] == ref.pull(0, "w").tolist()


def test_a_worker_that_pulled_a_newer_value_pushes_into_that_round():
    state = shard(Backup(1), workers=3, average=False)
    w = [Worker(r) for r in range(3)]
    for _ in range(3):  # workers 0 and 1 apply rounds 0, 1 and 2 without worker 2
        for rank in (0, 1):
            push(state, w[rank], [1.0, 1.0])
        pull(state, w[0]), pull(state, w[1])
    assert state.version == 3 and pull(state, w[2]) is not None  # clock 0, version 3
    push(state, w[2], [5.0, 5.0])  # computed on version 3: joins round 3
    assert state.rounds[3].pushed == {2} and state.caught_up == {2: 3} and state.counts["late"] == 0
    assert state.pull_version(2, 1) == 4  # its pull waits for its round
    push(state, w[0], [1.0, 1.0])
    assert state.version == 4 and state.value.tolist() == [6.0, 6.0]


def _interleave(seed: int, policy, workers: int, optimizer: bool) -> None:  # noqa: ANN001
    """Workers push then pull, in the order a seed picks among those that can act (a pull the
    store holds back waits); the shard and the reference must agree after every call."""
    rng = random.Random(seed)
    state = shard(policy, workers)
    ref = ReferenceStore(policy, workers=workers, average=True)
    ref.init("w", torch.zeros(2))
    if optimizer:
        state.attach_optimizer("torch.optim.SGD", {"lr": 0.5, "momentum": 0.9})
        ref.set_optimizer("torch.optim.SGD", lr=0.5, momentum=0.9)
    w = [Worker(r) for r in range(workers)]
    pulling = [False] * workers
    slow = rng.randrange(workers)
    for _ in range(150):
        weights = [1 if r == slow else 4 for r in range(workers)]  # one worker acts less often
        rank = rng.choices(range(workers), weights)[0]
        if not pulling[rank]:
            grad = [rng.uniform(-1, 1), rng.uniform(-1, 1)]
            push(state, w[rank], grad)
            ref.push(rank, "w", torch.tensor(grad))
            pulling[rank] = True
            continue
        got = pull(state, w[rank])
        try:
            expected = ref.pull(rank, "w")
        except WouldWait:
            expected = None
        assert (got is None) == (expected is None), (seed, rank)
        if got is not None:
            torch.testing.assert_close(got, expected)
            pulling[rank] = False
        assert state.version == ref.version("w") and state.counts["late"] == ref.late


@pytest.mark.parametrize("seed", range(6))
def test_the_shard_computes_what_the_reference_does_in_any_order(seed):
    _interleave(seed, Backup(1 + seed % 2), workers=4, optimizer=seed % 3 == 0)


def test_sync_is_the_same_interleaving_with_no_backup():
    _interleave(7, Sync(), workers=3, optimizer=True)


def test_sync_still_refuses_a_push_to_an_applied_round():
    state = shard(Sync(), workers=1)
    push(state, Worker(0), [1.0, 1.0])
    with pytest.raises(KVError, match="already applied"):
        state.check(Push(0, 0, torch.zeros(2)))


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: Backup(0), r"Backup\.backup_workers=0 must be an int >= 1"),
        (lambda: Backup(True), r"Backup\.backup_workers=True"),
        (lambda: Strategy(architecture="ps", backup_workers=-1), r"Strategy\.backup_workers=-1"),
        (lambda: Strategy.parse("dist_async:backup_workers=1"), r"backup_workers=1 needs consistency='sync'"),
        (lambda: Strategy(architecture="collective", backup_workers=1), r"Strategy\.consistency=.*'ps'"),
        (lambda: Strategy.parse("dist_sync_device:backup_workers=1"), r"aggregation='process'"),
        (lambda: Strategy(architecture="ps", update_on="worker", backup_workers=1), r"update_on='worker'"),
        (lambda: Strategy.parse("dist_sync:backup_workers=1,clip_grad_norm=1"), r"clip_grad_norm=1\.0"),
        (lambda: Backup(2).check_job(workers=2, replication=1), r"backup_workers=2 needs more workers"),
        (lambda: Backup(1).check_job(workers=3, replication=2), r"JobConfig\.replication=2"),
    ],
)
def test_bad_settings_name_the_field_and_value(make, error):
    with pytest.raises(ValueError, match=error):
        make()


def test_the_trainer_refuses_checkpoint_barriers_with_backup_workers(tmp_path):
    from paratrain.train import Trainer

    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"consistency=backup\(1\) cannot run with checkpoint_every=5"):
        Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            strategy="dist_sync:backup_workers=1",
            checkpoint_dir=tmp_path,
            checkpoint_every=5,
            progress=False,
        )


def test_the_vocabulary_and_the_wire():
    assert Strategy.parse("dist_sync:backup_workers=2").consistency == Backup(2)
    assert KVStoreConfig(consistency="backup").consistency == Backup(1)
    assert parse(Backup(3)) == from_wire(*Backup(3).to_wire()) == Backup(3)
    assert str(Backup(2)) == "backup(2)" and not Backup(1).adds_in_place()
    Backup(1).check_job(workers=2, replication=1)


def _sync_reference(workers: int, epochs: int) -> float:
    """Plain sync's accuracy, in this process, with the job's model."""
    sys.path.insert(0, str(JOBS))
    try:
        from digits_cnn import make_mlp, sync_reference_accuracy  # the job's model
    finally:
        sys.path.remove(str(JOBS))
    return sync_reference_accuracy(make_mlp(), 5e-3, epochs, workers)


def test_a_job_with_a_slowed_worker_drops_its_late_pushes_and_learns_as_sync_does():
    # 3 workers, one backup; worker 2's forward sleeps 30 ms (the others' take a few): most rounds
    # close without it, its late gradients are dropped, and it trains on from the newest weights.
    epochs = 8
    outcome = run_job(
        JOBS / "backup_digits.py",
        workers=3,
        servers=1,
        args=["2", "0.03", str(epochs)],
        env={"OMP_NUM_THREADS": "1"},
        timeout_s=240,
    )
    results = {}
    for rank in range(3):
        line = next(t for t in outcome.lines("worker", rank, "stdout") if "test accuracy" in t)
        found = re.search(r"test accuracy ([0-9.]+) late pushes (\d+)", line)
        results[rank] = (float(found[1]), int(found[2]))
    assert results[2][1] > 0, results  # the slowed worker's pushes missed rounds
    reference = _sync_reference(workers=3, epochs=epochs)
    for accuracy, _ in results.values():
        assert accuracy >= reference - 0.03, (results, reference)
