"""kvstore/reference.py, the obviously correct single-process store: its semantics on their own
(no processes), then the real store (servers, workers) against it, and a consistency model that
only a test defines, run by the servers' own round logic."""

from __future__ import annotations

import runpy
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from paratrain.kvstore import KVStoreConfig
from paratrain.kvstore.consistency import POLICIES, ArrivalPolicy, Async, Bounded, Sync, register
from paratrain.kvstore.reference import ReferenceStore, WouldWait
from paratrain.testing import run_job

JOBS = Path(__file__).parent / "jobs"


def test_sync_rounds_apply_once_every_worker_pushed_and_pulls_wait_for_them():
    ref = ReferenceStore(Sync(), workers=2)
    ref.init("w", torch.zeros(2))
    ref.push(0, "w", torch.tensor([1.0, 2.0]))
    with pytest.raises(WouldWait):
        ref.pull(0, "w")  # its round waits for worker 1
    assert ref.pull(1, "w").tolist() == [0.0, 0.0]  # worker 1 pushed nothing yet
    ref.push(1, "w", torch.tensor([3.0, 4.0]))
    assert ref.pull(0, "w").tolist() == [4.0, 6.0] and ref.version("w") == 1  # the sum is the value


def test_async_pushes_add_up_on_arrival_and_bounded_pulls_may_lag():
    ref = ReferenceStore(Async(), workers=2)
    ref.init("w", torch.zeros(1))
    for _ in range(3):
        ref.push(0, "w", torch.ones(1))
    assert ref.pull(0, "w").tolist() == [3.0] and ref.version("w") == 3
    bounded = ReferenceStore(Bounded(1), workers=2)
    bounded.init("w", torch.zeros(1))
    bounded.push(0, "w", torch.ones(1))
    bounded.pull(0, "w")  # one round ahead of worker 1: allowed
    bounded.push(0, "w", torch.ones(1))
    with pytest.raises(WouldWait):
        bounded.pull(0, "w")


def test_rows_are_made_by_training_pulls_and_stepped_row_by_row():
    ref = ReferenceStore(Sync(), workers=1)
    ref.init_table("t", 2)
    ref.set_table_optimizer("t", "torch.optim.SGD", lr=0.5)
    assert ref.pull_rows(0, "t", [3], train=False).tolist() == [[0.0, 0.0]]
    ref.push_rows(0, "t", [3], torch.ones(1, 2))  # never pulled for training: dropped
    ref.pull_rows(0, "t", [3, 5])
    ref.push_rows(0, "t", [3, 5], torch.tensor([[1.0, 2.0], [2.0, 2.0]]))
    assert ref.pull_rows(0, "t", [5, 3, 8], train=False).tolist() == [[-1.0, -1.0], [-0.5, -1.0], [0, 0]]


def _schedule() -> dict:
    """The job's schedule (its constants and push functions), read without running the job."""
    return runpy.run_path(str(JOBS / "reference_compare.py"), run_name="schedule")


def _replay(consistency: str, workers: int) -> ReferenceStore:
    job = _schedule()
    policy = Bounded(1) if consistency == "bounded" else consistency
    ref = ReferenceStore(policy, workers)
    ref.set_optimizer("torch.optim.Adagrad", lr=0.1)
    ref.init("w", torch.linspace(-1, 1, job["SIZE"]))
    ref.init_table("t", job["DIM"])
    ref.set_table_optimizer("t", "torch.optim.SGD", lr=0.1)
    for r in range(job["ROUNDS"]):
        for w in range(workers):
            ref.pull_rows(w, "t", job["IDS"][w])
        for w in range(workers):  # the job's order where it matters (async); any order in rounds
            ref.push(w, "w", job["grad"](w, r))
            ref.push_rows(w, "t", job["IDS"][w], job["row_grads"](w, r))
    return ref


@pytest.mark.parametrize("consistency", ["sync", "async", "bounded"])
def test_the_real_store_computes_what_the_reference_does(consistency, tmp_path):
    out = tmp_path / "pulled"
    run_job(JOBS / "reference_compare.py", workers=2, servers=2, args=[consistency, str(out)], timeout_s=180)
    ref = _replay(consistency, workers=2)
    ids = _schedule()["IDS"]
    for rank in (0, 1):
        got = torch.load(f"{out}.{rank}")
        torch.testing.assert_close(got["value"], ref.pull(rank, "w"), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["rows"], ref.pull_rows(rank, "t", ids[rank], train=False))


# -- a consistency model defined here: one class and one registry line -----------------------------
@dataclass(frozen=True)
class Damped(ArrivalPolicy):
    """Toy model: each push applies on arrival at half its size (a stale push counts for less)."""

    name: ClassVar[str] = "damped"

    def min_version(self, clock: int) -> int:
        return 0

    def local_update(self, value: torch.Tensor, update: torch.Tensor) -> None:
        value.add_(update, alpha=0.5)

    def update(self, state, grad, weight, buffer) -> None:  # noqa: ANN001
        state.apply_arrival(grad * 0.5)


class FakeConn:
    recv_ring = None


class FakeRequest:
    def __init__(self, op: str, meta: dict, tensors: list | None = None) -> None:
        from types import SimpleNamespace

        self.op, self.meta, self.tensors = op, meta, tensors or []
        self.header = SimpleNamespace(op=op, meta=meta, at=None)
        self.conn = FakeConn()
        self.replies: list = []

    def reply(self, meta: dict | None = None, tensors: list | tuple = ()) -> None:
        self.replies.append((meta, list(tensors)))

    def fail(self, message: str) -> None:
        raise AssertionError(message)


def test_a_new_consistency_model_is_one_class_and_one_registry_line():
    from paratrain.kvstore.server.server import KVServer

    register(Damped)
    try:
        assert KVStoreConfig(consistency="damped").consistency == Damped()  # a name, parsed at the edge
        server = KVServer(0, intra_op_threads=None)
        mode, params = Damped().to_wire()  # what worker 0's configure carries
        server.handle(FakeRequest("configure", {"mode": mode, "params": params or None, "members": [0, 1]}))
        assert server.rules.policy == Damped()
        ident = {"keys": ["w"], "starts": [0], "stops": [2], "shapes": [[2]], "dtypes": ["float32"]}
        server.handle(FakeRequest("init", ident | {"numels": [2]}, [torch.zeros(2)]))
        ref = ReferenceStore(Damped(), workers=2)
        ref.init("w", torch.zeros(2))
        for rank, clock, grad in [(0, 0, [2.0, 4.0]), (1, 0, [1.0, 1.0]), (0, 1, [4.0, 0.0])]:
            push = {"keys": ["w"], "starts": [0], "stops": [2], "clocks": [clock], "rank": rank}
            server.handle(FakeRequest("push", push, [torch.tensor(grad)]))
            ref.push(rank, "w", torch.tensor(grad))
        shard = server.shard_of(("w", 0, 2))
        assert shard.version == 3 and shard.value.tolist() == ref.pull(0, "w").tolist() == [3.5, 2.5]
        server.close()
    finally:
        POLICIES.pop("damped")
