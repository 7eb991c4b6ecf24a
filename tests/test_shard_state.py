"""A server's per-key state driven by method calls, without sockets or processes (server/shard.py),
and the consistency policies (consistency.py) that decide what a push does."""

from __future__ import annotations

import pytest
import torch

from paratrain.kvstore import KVStore, KVStoreConfig
from paratrain.kvstore.api import KVError
from paratrain.kvstore.consistency import Async, Bounded, Sync, from_wire, parse
from paratrain.kvstore.server.rules import Push, Rules
from paratrain.kvstore.server.shard import ShardState


def shard(rules: Rules, value: list[float] | None = None) -> ShardState:
    value_t = torch.tensor(value or [0.0, 0.0])
    return ShardState("w", 0, len(value_t), len(value_t), [len(value_t)], "float32", value_t, rules)


def push(state: ShardState, rank: int, clock: int, grad: list[float], weight: int = 1) -> None:
    p = Push(rank, clock, torch.tensor(grad), weight=weight)
    state.check(p)
    state.push(p)


def test_sync_applies_a_round_once_every_member_pushed_and_in_order() -> None:
    s = shard(Rules(Sync(), frozenset({0, 1})))
    push(s, 0, 0, [1.0, 2.0])
    push(s, 0, 1, [5.0, 5.0])  # worker 0 runs ahead: round 1 waits for round 0
    assert s.version == 0 and s.value.tolist() == [0.0, 0.0]
    assert s.waiting(1) == {"key": "w", "start": 0, "stop": 2, "version": 0, "round": 0, "missing": [1]}
    push(s, 1, 0, [3.0, 4.0])
    assert s.version == 1 and s.value.tolist() == [4.0, 6.0]  # without an optimizer: the round's sum
    assert s.ready(1) and not s.ready(2) and s.waiting(1) is None
    push(s, 1, 1, [1.0, 1.0])
    assert s.version == 2 and s.value.tolist() == [6.0, 6.0]
    with pytest.raises(KVError, match="round 1, already applied"):
        s.check(Push(0, 1, torch.zeros(2)))
    push(s, 0, 2, [1.0, 1.0])
    with pytest.raises(KVError, match="worker 0 pushed key 'w' \\[0, 2\\) twice in round 2"):
        s.check(Push(0, 2, torch.zeros(2)))
    with pytest.raises(KVError, match="does not match"):
        s.check(Push(1, 2, torch.zeros(3)))


def test_async_applies_every_push_on_arrival() -> None:
    s = shard(Rules(Async(), frozenset({0, 1})), [1.0, 1.0])
    push(s, 1, 0, [1.0, 2.0])
    push(s, 1, 1, [1.0, 2.0])  # no rounds: worker 0 pushed nothing and nothing waits for it
    assert s.version == 2 and s.value.tolist() == [3.0, 5.0]  # added to the value
    assert s.rounds == {} and s.ready(0)
    with pytest.raises(KVError, match="async pushes carry their payload"):
        s.check(Push(0, 0, None))


def test_bounded_rounds_are_sync_rounds_and_pulls_may_lag_by_the_bound() -> None:
    rules = Rules(parse("bounded", 2), frozenset({0, 1}))
    s = shard(rules)
    for clock in range(3):  # worker 0 runs 3 rounds ahead of worker 1
        push(s, 0, clock, [1.0, 1.0])
    assert s.version == 0 and len(s.rounds) == 3
    assert rules.policy.min_version(3) == 1 and not s.ready(rules.policy.min_version(3))  # must wait
    assert rules.policy.min_version(2) == 0 and s.ready(rules.policy.min_version(2))  # within the bound
    push(s, 1, 0, [1.0, 1.0])
    assert s.version == 1 and s.ready(rules.policy.min_version(3))


def test_a_member_that_leaves_stops_holding_rounds_back() -> None:
    rules = Rules(Sync(), frozenset({0, 1, 2}))
    s = shard(rules)
    push(s, 0, 0, [1.0, 1.0])
    push(s, 1, 0, [2.0, 2.0])
    assert s.version == 0
    rules.members = rules.members - {2}  # what the server does when worker 2 leaves
    s.apply_complete_rounds()
    assert s.version == 1 and s.value.tolist() == [3.0, 3.0]


def test_a_round_of_fewer_members_gives_their_mean() -> None:
    rules = Rules(Sync(), frozenset({0, 1, 2}), average=True)
    s = shard(rules)
    push(s, 0, 0, [3.0, 6.0])
    push(s, 1, 0, [6.0, 3.0])
    push(s, 2, 0, [0.0, 3.0])
    assert s.value.tolist() == [3.0, 4.0]  # (3 + 6 + 0) / 3, (6 + 3 + 3) / 3
    rules.members = frozenset({0, 1})  # worker 2 left: the next round has two members
    push(s, 0, 1, [1.0, 2.0])
    push(s, 1, 1, [3.0, 6.0])
    assert s.version == 2 and s.value.tolist() == [2.0, 4.0]  # the mean of two, not a third short
    # a host's leader stands for its host's workers: its push weighs that many
    rules.members = frozenset({0, 3})
    push(s, 0, 2, [6.0, 6.0], weight=3)  # the sum of 3 workers' gradients
    push(s, 3, 2, [2.0, 2.0])
    assert s.value.tolist() == [2.0, 2.0]  # (6 + 2) / 4 workers


def test_the_optimizer_steps_once_per_round_on_the_mean() -> None:
    rules = Rules(Sync(), frozenset({0, 1}), average=True)
    s = shard(rules, [1.0, 1.0])
    s.attach_optimizer("torch.optim.SGD", {"lr": 0.5})
    push(s, 0, 0, [1.0, 2.0])
    push(s, 1, 0, [3.0, 2.0])
    assert s.version == 1 and s.value.tolist() == [0.0, 0.0]  # 1 - 0.5 * mean(1, 3); 1 - 0.5 * 2
    entry, tensors = s.state()
    assert entry["version"] == 1 and tensors[0].tolist() == [0.0, 0.0]
    s.load(torch.tensor([5.0, 5.0]), {})
    assert s.version == 0 and s.value.tolist() == [5.0, 5.0] and s.rounds == {}


def test_set_hyper_changes_the_next_rounds_step_only() -> None:
    rules = Rules(Sync(), frozenset({0}), average=True)
    s = shard(rules, [1.0, 1.0])
    s.attach_optimizer("torch.optim.SGD", {"lr": 0.5})
    push(s, 0, 0, [1.0, 1.0])
    s.set_hyper({"lr": 0.25, "weight_decay": 1.0})  # an LR schedule's step, a group's decay
    push(s, 0, 1, [1.0, 2.0])
    assert s.value.tolist() == [0.5 - 0.25 * 1.5, 0.5 - 0.25 * 2.5]  # (grad + decay * value) at 0.25
    with pytest.raises(ValueError, match="SGD has no such setting"):
        s.set_hyper({"betas": [0.9, 0.99]})
    bare = shard(rules, [1.0])
    with pytest.raises(KVError, match="set_hyper before set_optimizer"):
        bare.set_hyper({"lr": 0.1})


def test_a_clipped_round_waits_for_its_scale_and_its_share_outlives_it() -> None:
    rules = Rules(Sync(), frozenset({0, 1}), average=True, clip=True)
    s = shard(rules, [1.0, 1.0])
    s.attach_optimizer("torch.optim.SGD", {"lr": 1.0})
    push(s, 0, 0, [3.0, 0.0])
    push(s, 1, 0, [3.0, 8.0])
    assert s.version == 0 and s.norm_share(0) == 3.0**2 + 4.0**2  # the mean's, held unapplied
    s.set_scale(0, 0.5)  # clipped to a norm of 2.5
    assert s.version == 1 and s.value.tolist() == [1.0 - 1.5, 1.0 - 2.0]
    s.set_scale(0, 0.5)  # another worker's: the round is applied already
    assert s.version == 1 and s.norm_share(0) == 25.0  # a slower worker may still ask
    push(s, 0, 1, [0.0, 0.0])
    push(s, 1, 1, [0.0, 0.0])
    s.set_scale(1, 1.0)
    with pytest.raises(KVError, match="round 0 was applied already"):
        s.norm_share(0)


def test_an_overflowed_round_is_dropped_and_leaves_value_and_optimizer_state_alone() -> None:
    rules = Rules(Sync(), frozenset({0, 1}), average=True, overflow=True)
    s = shard(rules, [1.0, 1.0])
    s.attach_optimizer("torch.optim.Adam", {"lr": 0.1})
    push(s, 0, 0, [1.0, 1.0])
    push(s, 1, 0, [1.0, 3.0])
    assert s.version == 0  # complete, held for the workers' overflow flags
    s.set_verdict(0, False)
    state = s.state()[1]  # copies of the value and of Adam's moments
    assert s.version == 1 and not torch.equal(state[0], torch.ones(2))
    push(s, 0, 1, [float("inf"), 1.0])
    push(s, 1, 1, [1.0, float("nan")])
    s.set_verdict(1, True)
    assert s.version == 2 and s.rounds == {}
    assert all(torch.equal(a, b) for a, b in zip(state, s.state()[1], strict=True))  # value, Adam's moments
    push(s, 0, 2, [0.0, 0.0])
    push(s, 1, 2, [0.0, 0.0])
    s.set_verdict(2, False)
    assert s.version == 3 and torch.isfinite(s.value).all()


def test_a_servers_verdict_needs_every_members_flag_and_follows_a_leave() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from paratrain.kvstore.server.overflow import Verdicts

    members = frozenset({0, 1, 2})
    told: list[tuple[int, bool]] = []
    verdicts = Verdicts(lambda: members, lambda clock, dropped: told.append((clock, dropped)))
    with ThreadPoolExecutor(3) as pool:
        answers = [pool.submit(verdicts.report, 0, rank, rank == 1) for rank in range(3)]
        assert [a.result(timeout=10) for a in answers] == [True, True, True]  # one overflow drops it
        assert told == [(0, True)]
        waiting = pool.submit(verdicts.report, 1, 0, False)
        with pytest.raises(KVError, match=r"no flag from worker\(s\) \[1, 2\]"):
            verdicts.report(1, 0, False, timeout_s=0.05)
        members = frozenset({0})  # the others left: the round is decided on worker 0's flag
        verdicts.check()
        assert waiting.result(timeout=10) is False and told[-1] == (1, False)


def test_the_policies_answer_for_both_sides() -> None:
    assert [parse(n).name for n in ("sync", "rounds", "async", "bounded")] == [
        "sync",
        "sync",
        "async",
        "bounded",
    ]
    assert (Sync().min_version(5), Async().min_version(5), Bounded(2).min_version(5)) == (5, 0, 3)
    assert KVStoreConfig(consistency="bounded", staleness=4).policy == Bounded(4)
    with pytest.raises(ValueError, match="consistency 'eventual' is not one of"):
        from_wire("eventual")
    assert from_wire(*Bounded(3).to_wire()) == Bounded(3) and str(Bounded(3)) == "bounded(3)"
    with pytest.raises(ValueError, match="KVStoreConfig.consistency='eventual'"):
        KVStoreConfig(consistency="eventual")


def test_every_store_implements_the_kvstore_protocol() -> None:
    from paratrain.kvstore.worker.client import DistKVStore
    from paratrain.kvstore.worker.device import HostKVStore
    from paratrain.kvstore.worker.local import LocalKVStore
    from paratrain.kvstore.worker.local_sparse import LocalSparseKVStore

    members = [name for name in dir(KVStore) if not name.startswith("_")]
    methods = [m for m in members if callable(getattr(KVStore, m))]
    assert {"init", "push", "pull", "pushpull", "set_optimizer", "save_state", "close"} <= set(methods)
    for store in (DistKVStore, HostKVStore, LocalKVStore, LocalSparseKVStore):
        assert [m for m in methods if not callable(getattr(store, m, None))] == [], store
    assert isinstance(LocalSparseKVStore(KVStoreConfig(local=True)), KVStore)


def test_a_wait_that_runs_out_raises_the_kvstores_error_not_the_builtin() -> None:
    from paratrain.errors import KVStoreError, ParatrainError
    from paratrain.kvstore.api import Handle, KVStoreTimeoutError, TableError
    from paratrain.transport.client import Future

    never = Future("'pull' (id 1) from server 0 (127.0.0.1:1)", None)  # its reply never comes
    with pytest.raises(
        KVStoreTimeoutError, match=r"^w0's pull got no reply within 0.1 s: no reply from server 0"
    ):
        Handle([never], timeout_s=0.1, what="w0's pull").wait()
    assert issubclass(KVStoreTimeoutError, KVStoreError) and issubclass(KVError, ParatrainError)
    assert issubclass(TableError, KVStoreError) and issubclass(TableError, ValueError)
