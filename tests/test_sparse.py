"""Sparse embedding tables: server storage, lifecycle, exact values across processes, state, serving,
the Criteo reader and generator, and the CTR example."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from paratrain.data.criteo import category_id, read_criteo, write_synthetic_criteo, zipf_ranks
from paratrain.errors import KVStoreError
from paratrain.kvstore import TableConfig, create, kernels
from paratrain.kvstore.consistency import Async, Bounded, Sync
from paratrain.kvstore.server.rowstore import HUGE_MIN_BYTES, IdIndex, RowStore, initial_rows, shard_of, zeros
from paratrain.kvstore.server.rules import Rules
from paratrain.kvstore.server.sparse import SparseTables
from paratrain.kvstore.server.sparse_fold import fold_order_holds, may_fold
from paratrain.kvstore.server.sparse_optim import build_optimizer
from paratrain.kvstore.server.sparse_table import SparseTable
from paratrain.kvstore.worker.embedding import DistributedEmbedding, ServingEmbedding
from paratrain.testing import run_job

JOBS = Path(__file__).parent / "jobs"
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch.optim on sparse grads
ROOT = Path(__file__).parent.parent
DIM, POOL = 6, 48
SGD_TABLE = TableConfig(initializer="normal", init_scale=0.5)
ADA_TABLE = TableConfig(init_scale=0.5)


# -- storage ----------------------------------------------------------------------------------------
def test_id_index_agrees_with_a_dict_through_inserts_removals_and_rebuilds():
    rng = np.random.default_rng(0)
    index, reference = IdIndex(16), {}
    for round_ in range(6):
        fresh = np.setdiff1d(rng.integers(-(2**63), 2**63 - 1, 5000, dtype=np.int64), list(reference))
        fresh = np.concatenate([fresh, np.arange(round_ * 1000, round_ * 1000 + 1000)])  # sequential ids
        fresh = np.unique(fresh[~np.isin(fresh, list(reference))])
        slots = np.arange(len(reference), len(reference) + len(fresh)) * 7 + round_
        index.insert(fresh, slots)
        reference.update(zip(fresh.tolist(), slots.tolist(), strict=True))
        gone = rng.choice(np.array(list(reference)), len(reference) // 4, replace=False)
        index.remove(gone)
        for i in gone.tolist():
            del reference[i]
        probe = np.concatenate([np.array(list(reference)), gone, rng.integers(-(2**63), 2**63 - 1, 100)])
        expected = [reference.get(i, -1) for i in probe.tolist()]
        assert index.lookup(probe).tolist() == expected
        assert len(index) == len(reference)


def _huge_page_mode() -> str | None:
    """The kernel's transparent huge page setting ("always", "madvise", "never"); None: no THP."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else None


def _mapping_of(address: int) -> dict[str, str]:
    """The fields of this process's /proc/self/smaps entry for the mapping holding `address`."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            if entry is not None:
                return entry
            if int(head.group(1), 16) <= address < int(head.group(2), 16):
                entry = {}
        elif entry is not None and ":" in line:
            name, value = line.split(":", 1)
            entry[name] = value.strip()
    assert entry is not None, f"no mapping holds {address:#x}"
    return entry


def test_large_row_storage_is_zeroed_and_asks_for_huge_pages():
    store = RowStore({"value": ((16,), torch.float32), "step": ((), torch.int64)}, 200_000)
    value = store.columns["value"]
    assert value.shape == (store.capacity, 16) and value.dtype == torch.float32 and value.is_contiguous()
    assert not value.any() and not store.columns["step"].any() and not store.ids.any()
    capacity = store.capacity
    last = store.allocate(capacity)[-1]
    value[last] = 3.0  # writable to its end, and moved along when the store grows
    store.allocate(1)
    assert store.capacity > capacity and store.columns["value"][last].eq(3.0).all()
    small = zeros(10, np.int64)
    assert small.tolist() == [0] * 10
    mode = _huge_page_mode()
    if mode not in ("always", "madvise"):
        pytest.skip(f"this kernel's transparent huge pages are {mode!r}")
    big = store.columns["value"]
    assert big.numel() * 4 >= HUGE_MIN_BYTES
    assert _mapping_of(big.data_ptr()).get("THPeligible") == "1"  # madvise(MADV_HUGEPAGE) took


def test_combine_sums_repeated_slots_in_order_as_a_plain_loop_does_with_buffers_reused():
    rng = np.random.default_rng(1)
    buffers = kernels.combine_buffers(3000, 4)
    for n, pool in ((3000, 5000), (40, 7), (2500, 10**6)):  # then smaller rounds in the same buffers
        slots = rng.integers(-1, pool, n)
        grads = rng.standard_normal((n, 4)).astype(np.float32)
        grads[rng.random((n, 4)) < 0.05] = -0.0
        order: dict[int, np.ndarray] = {}
        for slot, grad in zip(slots.tolist(), grads, strict=True):
            if slot >= 0:
                order[slot] = order.get(slot, np.zeros(4, np.float32)) + grad
        keys, where, unique, summed = buffers
        size, half = kernels.combine_start(keys, n), n // 2  # in two pushes, as a round's
        count = kernels.combine(slots[:half], grads[:half], keys, size, where, unique, summed, 0)
        count = kernels.combine(slots[half:], grads[half:], keys, size, where, unique, summed, count)
        assert unique[:count].tolist() == list(order)
        expected = np.stack(list(order.values()))
        assert np.array_equal(summed[:count], expected)
        assert not np.signbit(summed[:count][expected == 0]).any()  # 0.0 + -0.0, as a sum from zero


@pytest.mark.parametrize("servers", [1, 3])
def test_dedup_groups_each_unique_id_once_on_its_server(servers):
    from paratrain.kvstore.worker.embedding import TableClient

    rng = np.random.default_rng(1)
    ids = torch.from_numpy(rng.integers(-(2**63), 2**63 - 1, 300, dtype=np.int64))
    ids = ids[torch.from_numpy(rng.integers(0, 300, 5000))]  # repeats
    client = TableClient([None] * servers, 0, None, None, None)
    route, where = client.dedup(ids)
    assert torch.equal(route.ids[where], ids)
    assert sorted(route.ids.tolist()) == sorted(torch.unique(ids).tolist())
    for server, (a, b) in enumerate(route.bounds):
        assert (shard_of(route.ids[a:b], servers) == server).all()
    assert route.bounds[-1][1] == len(route.ids) and route.index is None


def table(config: TableConfig | None = None, dim: int = 4, optimizer=None) -> SparseTable:
    return SparseTable("t", dim, config or TableConfig(), optimizer)


def push(t: SparseTable, clock: int, ids: np.ndarray, value: float = 1.0) -> None:
    t.push(0, clock, ids, torch.full((len(ids), t.dim), value), Sync(), frozenset({0}))


def test_rows_are_created_on_first_training_pull_with_a_value_fixed_by_id_and_seed():
    t = table(TableConfig(initializer="uniform", init_scale=0.1))
    ids = np.array([5, -3, 2**62, 5], np.int64)
    assert torch.equal(t.read(ids, 0, train=False), torch.zeros(4, 4))
    assert t.stats()["rows"] == 0
    rows = t.read(ids, 0, train=True)
    assert t.stats()["rows"] == 3 and t.stats()["created"] == 3
    assert torch.equal(rows, initial_rows(ids, 4, t.config)) and torch.equal(rows[0], rows[3])
    assert torch.equal(rows[1:2], initial_rows(np.array([-3]), 4, t.config))  # not the batch's
    assert rows.abs().max() <= 0.1 and len(rows[:3].unique()) == 12
    other = initial_rows(ids, 4, TableConfig(initializer="uniform", init_scale=0.1, init_seed=1))
    assert not torch.equal(rows, other)
    normal = initial_rows(np.arange(20_000), 8, TableConfig(initializer="normal", init_scale=0.5))
    assert abs(normal.std().item() - 0.5) < 0.01 and abs(normal.mean().item()) < 0.01


def test_admission_after_n_sightings_and_with_probability():
    t = table(TableConfig(admit_after=3))
    ids = np.array([1, 2, 3], np.int64)
    for clock in range(2):
        assert torch.equal(t.read(ids[: 2 + clock], clock, True), torch.zeros(2 + clock, 4))
    assert t.stats()["rows"] == 0 and t.stats()["not_admitted"] == 5 and t.stats()["sighted"] == 3
    t.read(ids, 2, True)  # third sighting of 1 and 2, second of 3
    assert sorted(t.rows.ids[t.rows.live_slots()].tolist()) == [1, 2]
    assert t.stats()["sighted"] == 1  # 1 and 2 are rows now; 3 still waits
    push(t, 0, ids)  # round 0: the gradient of the absent row 3 is dropped
    assert t.stats()["dropped"] == 1
    t.read(ids, 3, True)
    assert t.stats()["rows"] == 3 and t.stats()["sighted"] == 0

    draws = np.arange(20_000, dtype=np.int64)
    half = [table(TableConfig(admit_probability=0.5)) for _ in range(2)]
    for t in half:
        t.read(draws, 7, True)
    assert 9_500 < half[0].stats()["rows"] < 10_500
    kept = [np.sort(t.rows.ids[t.rows.live_slots()]) for t in half]
    assert np.array_equal(kept[0], kept[1])  # a hash of id and step: a replay decides the same


def test_eviction_by_age():
    t = table(TableConfig(ttl_steps=2))
    old, new = np.arange(0, 10, dtype=np.int64), np.arange(10, 20, dtype=np.int64)
    t.read(np.concatenate([old, new]), 0, True)
    push(t, 0, new)
    t.read(new, 1, True)
    push(t, 1, new)
    assert t.stats()["rows"] == 20  # old was last seen at step 0: age 1
    t.read(new, 2, True)
    push(t, 2, new)
    stats = t.stats()
    assert stats["rows"] == 10 and stats["evicted_age"] == 10
    assert sorted(t.rows.ids[t.rows.live_slots()].tolist()) == new.tolist()
    assert torch.equal(t.read(old, 3, False), torch.zeros(10, 4))


@pytest.mark.parametrize("cap", ["rows", "bytes"])
def test_eviction_of_the_least_recently_seen_past_a_cap(cap):
    probe = table(optimizer=build_optimizer("torch.optim.Adagrad", {"lr": 0.1}))
    row_bytes = probe.stats()["row_bytes"]
    assert row_bytes == 4 * 4 + 4 * 4 + 8 + 8 + 1  # value, Adagrad's sum, id, last seen, alive flag
    limit = {"max_rows": 100} if cap == "rows" else {"max_bytes": 100 * row_bytes + row_bytes // 2}
    t = table(TableConfig(**limit), optimizer=build_optimizer("torch.optim.Adagrad", {"lr": 0.1}))
    for clock in range(15):
        t.read(np.arange(clock * 10, clock * 10 + 10, dtype=np.int64), clock, True)
    t.read(np.arange(0, 10, dtype=np.int64), 15, True)  # seen again: young
    held = sorted(t.rows.ids[t.rows.live_slots()].tolist())
    assert held == list(range(0, 10)) + list(range(60, 150))
    stats = t.stats()
    assert stats["rows"] == 100 and stats["evicted_cap"] == 60
    assert stats["bytes"] == 100 * row_bytes <= stats["reserved_bytes"]
    assert t.rows.top <= 110  # released slots were reused


def test_a_push_uses_the_slots_of_its_pull_only_while_they_still_hold_its_rows():
    sgd = build_optimizer("torch.optim.SGD", {"lr": 1.0})
    t = table(TableConfig("zeros", max_rows=4), dim=1, optimizer=sgd)
    t.read(np.array([1, 2, 3, 4]), 0, True, rank=0)  # slots 0..3
    t.read(np.array([2, 3, 4]), 1, True, rank=1)
    t.read(np.array([5]), 2, True, rank=1)  # evicts 1
    t.read(np.array([3, 4, 6]), 3, True, rank=1)  # 6 takes 1's slot; evicts 2
    assert t.rows.ids[0] == 6 and not t.rows.alive[1]
    t.push(0, 2, np.array([1, 2, 3, 4]), torch.ones(4, 1), Async(), frozenset({0, 1}))
    values = t.read(np.arange(1, 7), 3, False).flatten().tolist()
    assert values == [0.0, 0.0, -1.0, -1.0, 0.0, 0.0]
    assert t.stats()["dropped"] == 2 and t.stats()["evicted_cap"] == 2


def test_fold_order_keeps_the_rank_order_sum():
    order = [0, 2, 5, 7]
    assert may_fold(2, [], order) and may_fold(0, [2], order) and not may_fold(5, [2], order)
    assert may_fold(5, [2, 0], order) and not may_fold(7, [0, 2], order)
    assert fold_order_holds([2, 0, 5], order) and fold_order_holds([2], order) and fold_order_holds([], order)
    assert not fold_order_holds([5], order) and not fold_order_holds([0, 5], order)
    assert not fold_order_holds([2, 0, 7], order)


def rounds_tables(seed: int, workers: int, rows: int = 64) -> tuple[list, list[SparseTable]]:
    """Pushes of `workers` ranks over 3 rounds to overlapping rows of float32 gradients of mixed
    magnitudes (the order of a sum shows in its bits), and two tables holding those rows."""
    g = torch.Generator().manual_seed(seed)
    pushes = []
    for _ in range(3):
        pushes.append({})
        for rank in range(workers):
            ids = torch.randperm(rows, generator=g)[: rows // 2].numpy()
            scale = 10.0 ** torch.randint(-4, 4, (len(ids), 1), generator=g).float()
            pushes[-1][rank] = (ids, torch.randn(len(ids), 3, generator=g) * scale)
    made = []
    for _ in range(2):
        t = table(dim=3, optimizer=build_optimizer("torch.optim.Adagrad", {"lr": 0.1}))
        t.read(np.arange(rows), 0, True)
        made.append(t)
    return pushes, made


@pytest.mark.parametrize("arrival", [[0, 1, 2, 3], [1, 0, 3, 2], [3, 2, 1, 0], [2, 3, 0, 1], [1, 0]])
def test_a_round_folded_push_by_push_equals_the_rank_order_sum(arrival):
    """Sync pushes are added to their round's sum as they arrive (sparse_fold.py); the update must
    be the same, to the bit, as summing the round's pushes in rank order when the round completes."""
    workers = len(arrival)
    members = frozenset(range(workers))
    pushes, (folded, reference) = rounds_tables(7, workers)
    for round_, pushed in enumerate(pushes):
        for n, rank in enumerate(arrival):
            ids, grads = pushed[rank]
            folded.push(rank, round_, ids, grads, Sync(), members, apply=False)
            folded.apply_complete_rounds(members)  # as the server does after each push
            if n < workers - 1:  # held back only while ranks below it are missing
                assert len(folded.folding.ranks) == len(sorted_prefix(arrival[: n + 1]))
        reference.apply([(*pushed[rank], None) for rank in range(workers)], round_, add=False)
    assert folded.version == reference.version == 3
    for name, column in reference.rows.columns.items():
        assert torch.equal(folded.rows.columns[name], column), name
    if arrival[2:] != list(range(2, workers)):  # the test can fail: summed in arrival order,
        dense = [torch.zeros(64, 3).index_add_(0, torch.from_numpy(i), g) for i, g in pushes[0].values()]
        assert not torch.equal(sum_in(dense, arrival), sum_in(dense, range(workers)))  # bits differ


def sorted_prefix(arrived: list[int]) -> list[int]:
    """The ranks a fold can hold once `arrived` came: 0 and 1 at once, each later one after all below."""
    held = [r for r in (0, 1) if r in arrived]
    while len(held) >= 2 and len(held) in arrived:
        held.append(len(held))
    return held


def sum_in(terms: list[torch.Tensor], order) -> torch.Tensor:
    total = torch.zeros_like(terms[0])
    for i in order:
        total = total + terms[i]
    return total


def test_a_folded_round_whose_rows_were_evicted_meanwhile_is_summed_again_from_its_pushes():
    members = frozenset(range(3))
    pushes, (folded, reference) = rounds_tables(3, 3)
    pushed = pushes[0]
    for rank in (1, 0):
        folded.push(rank, 0, *pushed[rank], Sync(), members, apply=False)
        folded.apply_complete_rounds(members)
    assert folded.folding.ranks == [1, 0]
    gone = np.array([int(pushed[0][0][0]), int(pushed[1][0][0])])
    for t in (folded, reference):  # an eviction between the folds and the round's end
        t._evict(t.index.lookup(gone), "evicted_age")
    folded.push(2, 0, *pushed[2], Sync(), members, apply=False)
    folded.apply_complete_rounds(members)
    reference.apply([(*pushed[rank], None) for rank in range(3)], 0, add=False)
    assert folded.version == 1 and folded.stats()["dropped"] == reference.stats()["dropped"] > 0
    for name, column in reference.rows.columns.items():
        assert torch.equal(folded.rows.columns[name], column), name


def test_a_round_that_fails_to_apply_fails_every_later_pull_instead_of_hanging(monkeypatch):
    """In rounds modes a push is acknowledged once it joined its round, and the round is applied
    after; if that update fails, pulls report it."""
    kv = create("local")
    kv.init_table("t", 4, TableConfig())
    kv.set_table_optimizer("t", torch.optim.SGD, lr=0.1)
    ids, out = torch.tensor([1, 2, 3]), torch.empty(3, 4)
    kv.row_sparse_pull("t", out=out, row_ids=ids)

    def broken_step(*args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(kv._server.tables["t"].optimizer, "step", broken_step)
    kv.push_sparse("t", ids, torch.ones(3, 4)).wait()  # joined its round: done
    for _ in range(2):
        with pytest.raises(KVStoreError, match="could not apply a round: RuntimeError"):
            kv.row_sparse_pull("t", out=out, row_ids=ids)


class Request:
    """A request as SparseTables.handle sees it, answered in place."""

    def __init__(self, op: str, meta: dict, tensors: list[torch.Tensor]) -> None:
        self.op, self.meta, self.tensors, self.result = op, meta, tensors, None
        self.header = SimpleNamespace(at=None)

    def reply(self, meta: dict | None = None, tensors=()) -> None:
        self.result = (meta, list(tensors))

    def fail(self, message: str) -> None:
        raise AssertionError(message)


@pytest.mark.parametrize("read", ["pull", "state"])
def test_a_round_whose_pushes_were_all_acknowledged_is_applied_before_a_later_read(monkeypatch, read):
    """The last push of a round is acknowledged before its thread applies the round; a pull or a
    state read arriving in between applies it itself. (It once read the round before: a bounded(1)
    pull after kv.barrier() then missed the last round, as the flaky sparse_exact job showed.)"""
    tables = SparseTables(SimpleNamespace(rank=0, rules=Rules(Bounded(1), frozenset({0, 1}))))
    tables.handle(Request("sparse_init", {"key": "t", "dim": 2, "config": {"initializer": "zeros"}}, []))
    tables.handle(
        Request("sparse_optimizer", {"key": "t", "path": "torch.optim.SGD", "hyper": {"lr": 1.0}}, [])
    )
    ids = torch.tensor([3, 8])
    late = []  # the pushers' threads, not scheduled yet after their replies
    monkeypatch.setattr(tables, "_apply_rounds", lambda table, members: late.append(table.key) or [])
    for rank in (0, 1):
        pulled = {"key": "t", "clock": 0, "min_version": 0, "train": True, "rank": rank}
        tables.handle(Request("sparse_pull", pulled, [ids]))
        push = Request("sparse_push", {"key": "t", "clock": 0, "rank": rank}, [ids, torch.ones(2, 2)])
        tables.handle(push)
        assert push.result == ({}, [])  # acknowledged
    assert late == ["t", "t"] and tables.tables["t"].version == 0
    if read == "pull":  # min_version 0 under bounded(1): the round need not, but must be seen
        request = Request("sparse_pull", {"key": "t", "clock": 1, "min_version": 0, "train": False}, [ids])
        tables.handle(request)
        assert request.result[0] == {"versions": [1]}
        values = request.result[1][0]
    else:
        request = Request("sparse_get_state", {"key": "t", "full": False}, [])
        tables.handle(request)
        values = request.result[1][1]
    assert values.tolist() == [[-2.0, -2.0], [-2.0, -2.0]]


def test_table_config_validation_names_the_field():
    for kwargs, field in [
        ({"initializer": "ones"}, "initializer"),
        ({"admit_after": 0}, "admit_after"),
        ({"admit_probability": 0.0}, "admit_probability"),
        ({"ttl_steps": -1}, "ttl_steps"),
        ({"max_rows": 1.5}, "max_rows"),
    ]:
        with pytest.raises(ValueError, match=f"TableConfig.{field}="):
            TableConfig(**kwargs)
    with pytest.raises(ValueError, match="no sparse form"):
        build_optimizer("torch.optim.Adagrad", {"lr": 0.1, "lr_decay": 0.5})


def test_ids_spread_evenly_over_servers():
    counts = torch.bincount(shard_of(torch.arange(30_000), 3), minlength=3)
    assert counts.min() > 9_500


# -- one process: the module against torch.nn ------------------------------------------------------
@pytest.mark.parametrize("name", ["SGD", "Adagrad", "Adam"])
def test_module_in_one_process_matches_torch_embedding_bag(name):
    kv = create("local")
    cls, hyper = getattr(torch.optim, name), {"lr": 0.05}
    emb = DistributedEmbedding(
        "t", 5, mode="sum", config=ADA_TABLE, optimizer=cls, optimizer_args=hyper, kv=kv
    )
    assert emb.paratrain_sparse and not list(emb.parameters())
    pool = torch.tensor([7, -1, 2**40, 3, 99, 123456789])
    reference = nn.EmbeddingBag(len(pool), 5, mode="sum", sparse=True)
    reference.weight.data = initial_rows(pool.numpy(), 5, ADA_TABLE)
    ref_opt = (torch.optim.SparseAdam if name == "Adam" else cls)(reference.parameters(), **hyper)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        where = torch.randint(0, len(pool), (3, len(pool)), generator=g)
        if name == "Adam":  # every row in every step: a row's own step count is torch's global one
            where = torch.cat([where, torch.arange(len(pool))[None]])
        target = torch.randn(len(where), 5, generator=g)
        ((emb(pool[where]) - target) ** 2).sum().backward()
        ref_opt.zero_grad()
        ((reference(where) - target) ** 2).sum().backward()
        ref_opt.step()
    emb.flush()
    rows = torch.empty(len(pool), 5)
    kv.row_sparse_pull("t", out=rows, row_ids=pool, train=False)
    torch.testing.assert_close(rows, reference.weight.detach(), rtol=1e-5, atol=1e-6)


def test_row_sparse_pull_and_push_sparse_sum_repeated_ids(tmp_path):
    kv = create("local")
    kv.init_table("t", 3, TableConfig("zeros"))
    kv.set_table_optimizer("t", torch.optim.SGD, lr=1.0)
    ids = torch.tensor([4, 9, 4, 4])
    out = torch.empty(4, 3)
    kv.row_sparse_pull("t", out=out, row_ids=ids)
    kv.push_sparse("t", ids, torch.ones(4, 3)).wait()
    kv.row_sparse_pull("t", out=out, row_ids=ids)
    assert out[:, 0].tolist() == [-3.0, -1.0, -3.0, -3.0]
    kv.export_table("t", tmp_path / "t.export")
    serving = ServingEmbedding.from_export(tmp_path / "t.export")
    assert serving(torch.tensor([9, 5, 4]))[:, 1].tolist() == [-1.0, 0.0, -3.0]
    kv.save_state(tmp_path / "state")
    fresh = create("local")
    fresh.init_table("t", 3, TableConfig("zeros"))
    fresh.set_table_optimizer("t", torch.optim.SGD, lr=1.0)
    fresh.load_state(tmp_path / "state")
    again = torch.empty(4, 3)
    fresh.row_sparse_pull("t", out=again, row_ids=ids, train=False)
    assert torch.equal(again, out)
    with pytest.raises(ValueError, match="offsets are for bag modes"):
        DistributedEmbedding("u", 3, kv=kv)(ids, torch.tensor([0]))


# -- several processes ------------------------------------------------------------------------------
def replay(result: dict, workers: int, loss_kind: str) -> dict[str, nn.Module]:
    """The job's training on torch.nn in one process: each step's loss is the sum of every worker's."""
    pool = result["pool"]
    position = {i: n for n, i in enumerate(pool.tolist())}
    sgd = nn.Embedding(POOL, DIM, sparse=True)
    ada = nn.EmbeddingBag(POOL, DIM, mode="mean", sparse=True)
    sgd.weight.data = initial_rows(pool.numpy(), DIM, SGD_TABLE)
    ada.weight.data = initial_rows(pool.numpy(), DIM, ADA_TABLE)
    optimizers = [torch.optim.SGD(sgd.parameters(), lr=0.1), torch.optim.Adagrad(ada.parameters(), lr=0.1)]
    targets = torch.randn(8, DIM, generator=torch.Generator().manual_seed(6))
    for step in range(len(result["batches"][0])):
        for opt in optimizers:
            opt.zero_grad()
        for rank in range(workers):
            lookup, bags = (t.apply_(position.get) for t in map(torch.clone, result["batches"][rank][step]))
            a, b = sgd(lookup), ada(bags)
            if loss_kind == "linear":
                loss = (a * targets[:, None]).sum() + (b * targets).sum()
            else:
                loss = ((a - targets[:, None]) ** 2).sum() + ((b - targets) ** 2).sum()
            loss.backward()
        for opt in optimizers:
            opt.step()
    return {"sgd": sgd, "ada": ada}


def check_rows(result: dict, reference: dict[str, nn.Module], keys=("sgd", "ada")) -> None:
    pool = result["pool"]
    for n, key in enumerate(("sgd", "ada")):
        touched = torch.isin(pool, torch.cat([b[n].flatten() for r in result["batches"] for b in r]))
        rows = result["rows"][key]
        assert torch.equal(rows[~touched], torch.zeros_like(rows[~touched]))  # never created
        if key in keys:
            torch.testing.assert_close(rows[touched], reference[key].weight[touched], rtol=1e-5, atol=1e-6)
        stats = result["stats"][key]
        assert sum(s["rows"] for s in stats) == int(touched.sum())
        assert all(s["bytes"] == s["rows"] * s["row_bytes"] for s in stats)


def load_results(out: Path, workers: int) -> list[dict]:
    return [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(workers)]


def test_sync_pushes_to_overlapping_ids_match_torch_then_load_into_other_servers(tmp_path):
    out, state = tmp_path / "exact", tmp_path / "state"
    run_job(
        JOBS / "sparse_exact.py", workers=2, servers=2, args=["dist_sync", "quadratic", str(out), str(state)]
    )
    results = load_results(out, 2)
    batches = [r["batches"] for r in results]
    result = results[0] | {"batches": batches}
    reference = replay(result, 2, "quadratic")
    for r in results:
        check_rows(r | {"batches": batches}, reference)
    assert torch.equal(results[0]["rows"]["ada"], results[1]["rows"]["ada"])

    # export for serving: the held rows, ids the table never saw read as zeros
    serving = ServingEmbedding.from_export(f"{state}.export", mode="mean")
    bags = batches[0][-1][1]
    expected = nn.functional.embedding_bag(
        torch.searchsorted(result["pool"].sort().values, bags),
        result["rows"]["ada"][result["pool"].argsort()],
        mode="mean",
    )
    torch.testing.assert_close(serving(bags), expected)
    assert torch.equal(serving(torch.tensor([[12345]])), torch.zeros(1, DIM))

    # the state file loads into three servers; its Adagrad sums come along
    loaded = tmp_path / "loaded"
    run_job(JOBS / "sparse_state.py", workers=2, servers=3, args=[str(state), str(loaded)])
    after = torch.load(loaded, weights_only=True)
    assert torch.equal(after["loaded"]["sgd"], result["rows"]["sgd"])
    assert torch.equal(after["loaded"]["ada"], result["rows"]["ada"])
    touched = result["rows"]["ada"].abs().sum(1) > 0
    assert len(after["rows_per_server"]) == 3 and sum(after["rows_per_server"]) == int(touched.sum())
    table = next(t for t in torch.load(state, weights_only=True)["tables"] if t["key"] == "ada")
    order = torch.searchsorted(table["ids"], result["pool"][touched])
    grads = torch.arange(POOL * DIM, dtype=torch.float32).reshape(POOL, DIM) / 100 * 3  # ranks 1 + 2
    grads[:5] *= 2  # pushed twice
    weight = result["rows"]["ada"][touched].clone().requires_grad_()
    adagrad = torch.optim.Adagrad([weight], lr=0.1)
    adagrad.state[weight]["sum"] = table["state"]["sum"][order].clone()
    adagrad.state[weight]["step"] = torch.tensor(0.0)
    weight.grad = grads[touched]
    adagrad.step()
    torch.testing.assert_close(after["after"][touched], weight.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, keys", [("bounded", ("sgd", "ada")), ("dist_async", ("sgd",))])
def test_bounded_and_async_pushes_with_row_independent_gradients(tmp_path, kind, keys):
    # linear loss: the gradients do not depend on the rows, so a round's sum (bounded) and, for SGD,
    # the sum of every push (async) do not depend on timing
    out = tmp_path / "exact"
    run_job(
        JOBS / "sparse_exact.py",
        workers=2,
        servers=1 if kind == "dist_async" else 2,
        args=[kind, "linear", str(out)],
    )
    results = load_results(out, 2)
    batches = [r["batches"] for r in results]
    reference = replay(results[0] | {"batches": batches}, 2, "linear")
    check_rows(results[1] | {"batches": batches}, reference, keys)


# -- Criteo data and the example --------------------------------------------------------------------
def test_criteo_reader_on_a_small_file(tmp_path):
    cats = ["68fd1e64", ""] + ["0000000a"] * 24
    lines = [
        "\t".join(["1", "5", "", "-3"] + ["0"] * 10 + cats),
        "\t".join(["0"] + [""] * 13 + ["ffffffff"] * 26),
    ]
    (tmp_path / "day.tsv").write_text("\n".join(lines) + "\n")
    labels, dense, ids = read_criteo(tmp_path / "day.tsv").tensors
    assert labels.tolist() == [1.0, 0.0]
    assert dense[0, :3].tolist() == pytest.approx([np.log(6.0), 0.0, 0.0]) and dense[1].abs().sum() == 0
    assert ids[0, :3].tolist() == [category_id(0, 0x68FD1E64), category_id(1, None), category_id(2, 10)]
    assert len(set(ids[1].tolist())) == 26  # one value in 26 columns: 26 ids
    assert len(read_criteo(tmp_path / "day.tsv", limit=1).tensors[0]) == 1
    (tmp_path / "bad.tsv").write_text("1\t2\t3\n")
    with pytest.raises(ValueError, match="bad.tsv:1: 3 tab-separated fields"):
        read_criteo(tmp_path / "bad.tsv")


def test_generator_writes_criteo_lines_whose_ids_follow_a_power_law(tmp_path):
    ranks = zipf_ranks(400_000, 100_000, 1.1, torch.Generator().manual_seed(0))
    counts = torch.bincount(ranks)[1:].double()
    slope = np.polyfit(np.log(np.arange(1, 101)), np.log(counts[:100].numpy()), 1)[0]
    assert -1.2 < slope < -1.0
    write_synthetic_criteo(tmp_path / "a.tsv", 5000, seed=3, vocab=1000)
    labels, dense, ids = read_criteo(tmp_path / "a.tsv").tensors
    assert len(labels) == 5000 and 0.1 < labels.mean() < 0.9
    column = torch.unique(ids[:, 0], return_counts=True)[1].sort(descending=True).values.double()
    assert 5 < column[0] / column[9] < 25  # rank 1 vs rank 10: about 10 ** 1.1
    again = tmp_path / "b.tsv"
    write_synthetic_criteo(again, 5000, seed=3, vocab=1000)
    assert again.read_bytes() == (tmp_path / "a.tsv").read_bytes()


@pytest.mark.timeout(300)
def test_ctr_example_learns_with_tables_on_two_servers_and_the_dense_part_by_all_reduce():
    """... and with --serve, a serving process joined read-only to the same servers answers click
    predictions while the job trains: its rows change as training goes on, rows never created read
    as zeros, the dense part follows the checkpoints, and the job's rounds never wait for it."""
    outcome = run_job(
        ROOT / "examples" / "ctr.py", workers=2, servers=2, args=["--rows", "16000", "--serve"], timeout_s=240
    )
    lines = outcome.lines("worker", 0, "stdout")
    found = re.search(r"held-out AUC ([0-9.]+)", "\n".join(lines))
    assert found, outcome.stdout
    assert float(found[1]) > 0.65
    assert "strategy hybrid" in "\n".join(lines)
    served = [line for line in lines if line.startswith("served at step")]
    assert len(served) >= 3 and lines.index(served[0]) < next(
        i for i, line in enumerate(lines) if "held-out AUC" in line
    ), outcome.stdout
    answers = [
        re.search(r"model_step (\d+) clicks \[(.*)\] deep rows \[(.*)\] unseen row zero (\w+)", line)
        for line in served
    ]
    assert all(a and a[4] == "True" for a in answers), served
    clicks = [[float(v) for v in a[2].split(",")] for a in answers]
    assert all(len(c) == 4 and all(0 < p < 1 for p in c) for c in clicks), served
    rows = [[float(v) for v in a[3].split(",")] for a in answers]
    assert rows[0] != rows[-1], served  # the servers kept training the rows the server reads
    assert int(answers[-1][1]) > int(answers[0][1]), served  # a newer checkpoint's dense part


def test_the_sparse_benchmarks_lockstep_ceiling_is_the_mean_step_over_the_expected_longest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = Path(__file__).parent.parent / "benchmarks" / "sparse.py"
    monkeypatch.syspath_prepend(str(path.parent))  # its helpers (_anchors, _jobs) sit beside it
    spec = importlib.util.spec_from_file_location("sparse_benchmark", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.lockstep_ceiling([[2.0, 2.0], [2.0, 2.0]]) == 1.0  # steady steps: the barrier is free
    # Steps of 1 or 3 ms, equally likely, on each of two workers: the mean is 2, the longest of two
    # independent draws 2.5 on average (1 only when both draw 1).
    assert bench.lockstep_ceiling([[1.0, 3.0], [3.0, 1.0]]) == pytest.approx(0.8)
    # The slowest worker's mean sets the numerator; a steady faster worker never holds it back.
    assert bench.lockstep_ceiling([[1.0, 1.0], [2.0, 2.0]]) == 1.0
    assert bench.lockstep_ceiling([[1.0, 3.0], [1.0, 1.0]]) == 1.0
