"""Elastic all-reduce: survivors of a dead worker re-form the group and go on from their last commit,
and a replacement joins (collective/elastic.py, cluster/rendezvous.py, train/elastic.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.cluster.rendezvous import rank_map
from paratrain.collective import elastic


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
