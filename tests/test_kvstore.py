"""The parameter server: placement, configuration, and exact values across real processes."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from paratrain.errors import KVStoreError
from paratrain.kvstore import KINDS, KVStoreConfig, create
from paratrain.kvstore import optim as kvoptim
from paratrain.kvstore.consistency import Async
from paratrain.kvstore.placement import Placement, split
from paratrain.kvstore.shared import PAGE, Arena, ArenaMap
from paratrain.testing import run_job

JOBS = Path(__file__).parent / "jobs"


# -- placement, a pure function ---------------------------------------------------------------------
def test_split_is_near_equal_and_contiguous():
    assert split(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split(2, 3) == [(0, 1), (1, 2), (2, 2)]
    for numel in (1, 999, 1000, 10_007):
        for parts in (1, 2, 3, 4):
            bounds = split(numel, parts)
            assert bounds[0][0] == 0 and bounds[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [b - a for a, b in bounds]
            assert max(sizes) - min(sizes) <= 1


def test_small_keys_balance_bytes_and_big_keys_are_sliced_across_every_server():
    placement = Placement(num_servers=3, slice_elements=100)
    first = placement.place(50, 4)  # -> server 0
    second = placement.place(10, 8)  # fewer bytes on 1 and 2 -> server 1
    third = placement.place(30, 4)  # -> server 2
    fourth = placement.place(5, 4)  # server 1 holds 80 B, least -> server 1
    assert [s.server for s in first + second + third + fourth] == [0, 1, 2, 1]
    big = placement.place(1001, 4)
    assert [(s.server, s.start, s.stop) for s in big] == [(0, 0, 334), (1, 334, 668), (2, 668, 1001)]
    assert placement.load == [200 + 1336, 80 + 20 + 1336, 120 + 1332]


def test_max_slice_bytes_cuts_keys_into_slices_no_bigger_on_the_least_loaded_servers():
    placement = Placement(num_servers=2, slice_elements=100, max_slice_bytes=40)
    assert [(s.server, s.start, s.stop) for s in placement.place(10, 4)] == [(0, 0, 10)]  # 40 B: whole
    small = placement.place(25, 4)  # 100 B, at most slice_elements: 3 slices, each where least is
    assert [(s.server, s.start, s.stop) for s in small] == [(1, 0, 9), (1, 9, 17), (0, 17, 25)]
    big = placement.place(101, 4)  # more than slice_elements: still no slice over 40 B
    assert [s.numel for s in big] == [10, 10] + [9] * 9 and big[-1].stop == 101
    assert sum(placement.load) == 4 * (10 + 25 + 101) and abs(placement.load[0] - placement.load[1]) <= 40
    uncapped = Placement(num_servers=2, slice_elements=100, max_slice_bytes=1000).place(101, 4)
    assert [(s.server, s.start, s.stop) for s in uncapped] == [(0, 0, 51), (1, 51, 101)]  # as without


def test_a_compressed_key_is_capped_by_the_bytes_it_puts_on_the_wire():
    placement = Placement(num_servers=2, slice_elements=100, max_slice_bytes=40)
    # 2bit: 25 float32 elements (100 B) travel in 7 B, under the cap: whole, as a small key is
    assert [(s.server, s.start, s.stop) for s in placement.place(25, 4, wire_bytes=7)] == [(0, 0, 25)]
    halved = placement.place(25, 4, wire_bytes=50)  # fp16: 50 B on the wire, 2 slices of at most 40
    assert [(s.server, s.start, s.stop) for s in halved] == [(1, 0, 13), (1, 13, 25)]
    assert placement.load == [100, 100]  # the servers hold the values themselves, uncompressed


def test_placement_is_the_same_on_every_worker():
    def run():
        p = Placement(2, slice_elements=1000)
        return [p.place(n, 4) for n in (5, 3000, 7, 7, 1, 999, 1001)]

    assert run() == run()
    single = Placement(1, slice_elements=10).place(10_000, 4)
    assert [(s.server, s.start, s.stop) for s in single] == [(0, 0, 10_000)]


# -- configuration ----------------------------------------------------------------------------------
def test_mxnet_kinds_map_onto_configs():
    assert KINDS["dist_sync"] == KVStoreConfig()
    assert KINDS["dist_async"].consistency == Async()
    assert KINDS["dist_sync_device"].aggregation == "host"
    assert KINDS["dist_async_device"] == KVStoreConfig(consistency="async", aggregation="host")
    assert KINDS["local"].local and KINDS["device"].local


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"consistency": "eventual"}, "KVStoreConfig.consistency='eventual'"),
        ({"consistency": "sync", "staleness": 2}, "KVStoreConfig.staleness=2 needs consistency='bounded'"),
        ({"consistency": "bounded", "staleness": -1}, "KVStoreConfig.staleness=-1"),
        ({"aggregation": "rack"}, "KVStoreConfig.aggregation='rack'"),
        ({"slice_elements": 0}, "KVStoreConfig.slice_elements=0"),
    ],
)
def test_bad_config_names_the_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        KVStoreConfig(**kwargs)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kvstore kind 'dist_magic'"):
        create("dist_magic")


def test_optimizers_are_allow_listed_by_class_path():
    assert kvoptim.resolve("torch.optim.Adam") is torch.optim.Adam
    assert kvoptim.resolve(kvoptim.class_path(torch.optim.SGD)) is torch.optim.SGD
    for bad in ("os.system", "torch.optim.Optimizer", "torch.nn.Linear", "builtins.eval"):
        with pytest.raises(ValueError, match="is not one of torch.optim's optimizers"):
            kvoptim.resolve(bad)
    with pytest.raises(TypeError, match="hyperparameter lr="):
        kvoptim.check_hyperparameters({"lr": object()})


# -- the local store: same API, one process -----------------------------------------------------------
def test_local_store_sums_device_lists_and_runs_the_optimizer():
    kv = create("local")
    kv.init("w", torch.zeros(3))
    out = torch.empty(3)
    kv.pushpull("w", [torch.ones(3), 2 * torch.ones(3)], out=out)  # one tensor per local device
    assert out.tolist() == [3.0, 3.0, 3.0]
    kv.set_optimizer("torch.optim.SGD", lr=0.5)
    kv.pushpull("w", torch.ones(3), out=out)
    assert out.tolist() == [2.5, 2.5, 2.5]
    with pytest.raises(ValueError, match="init as torch.float32\\[4\\] is not allowed"):
        kv.init("w", torch.zeros(4))
    with pytest.raises(KVStoreError, match="never initialized"):
        kv.pull("nope", out=out)


@pytest.mark.parametrize("call", ["push", "pull", "pushpull"])
def test_a_plain_python_list_is_refused_with_a_type_error_saying_what_was_expected(call):
    kv = create("local")
    kv.init("w", torch.zeros(3))
    plain = [1.0, 2.0, 3.0]
    args = {"push": (plain,), "pull": (), "pushpull": (plain,)}[call]
    out = {"out": plain} if call != "push" else {}
    expected = "the value for key 'w' must be a tensor \\(or a list of tensors, one per local device\\)"
    with pytest.raises(TypeError, match=expected + ", not a list holding a float"):
        getattr(kv, call)("w", *args, **out)
    out = torch.empty(3)
    kv.pull("w", out=out)  # nothing was pushed
    assert out.tolist() == [0.0, 0.0, 0.0]


def test_local_store_state_round_trip(tmp_path):
    kv = create("local")
    kv.init([0, 1], [torch.ones(4), torch.zeros(2, 2)])
    kv.set_optimizer(torch.optim.Adam, lr=0.1)
    kv.set_hyperparameters(0, lr=0.5)  # kept in the file
    kv.push([0, 1], [torch.ones(4), torch.ones(2, 2)])
    kv.save_state(tmp_path / "kv.pt")
    kv.push([0, 1], [torch.ones(4), torch.ones(2, 2)])
    after = torch.empty(4)
    kv.pull(0, out=after)

    other = create("local")
    other.init([0, 1], [torch.zeros(4), torch.zeros(2, 2)])
    other.set_optimizer(torch.optim.Adam, lr=0.1)
    other.load_state(tmp_path / "kv.pt")
    other.push([0, 1], [torch.ones(4), torch.ones(2, 2)])
    again = torch.empty(4)
    other.pull(0, out=again)
    assert torch.equal(after, again)  # values, Adam's moments and key 0's lr all came back


# -- shared shards (the same-host path), one process: the server's map and a worker's ------------
@pytest.fixture
def shared_region():
    arena = Arena()
    server = arena.region(5, torch.float32, 3)
    server.buffers[0].copy_(torch.arange(5.0))
    server.publish(0, 0)
    server.open(1, 0)
    worker_map = ArenaMap.open(arena.describe())  # through /proc: its own open file, its own locks
    worker = worker_map.region(server.offset, 5, torch.float32, 3)
    yield server, worker
    worker_map.close()
    server.close()
    os.close(arena.fd)


def test_a_shared_round_copies_its_first_push_and_adds_the_rest(shared_region):
    server, worker = shared_region
    assert worker.add(0, torch.ones(5)) and worker.add(0, torch.full((5,), 2.0))
    assert not worker.add(1, torch.ones(5))  # no buffer is open for round 1: the caller sends it
    assert server.buffers[1].tolist() == [3.0] * 5 and server.words[5] == 2  # adds to buffer 1
    out = torch.empty(5)
    assert worker.read(out) == 0 and out.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    server.close_round(1)
    assert not worker.add(0, torch.ones(5))  # a complete round takes no more pushes
    server.publish(1, 1)
    assert worker.read(out) == 1 and out.tolist() == [3.0] * 5


def test_a_shared_value_is_never_read_while_the_server_updates_it(shared_region):
    server, worker = shared_region
    out = torch.empty(5)
    reader = threading.Thread(target=worker.read, args=(out,))
    with server.writing(0):
        server.buffers[0].fill_(-1.0)  # half-way through an update
        reader.start()
        reader.join(timeout=0.5)
        assert reader.is_alive()  # held back by the lock, not reading the half-made value
        server.buffers[0].fill_(7.0)
        server.stamp(1)
    reader.join(timeout=30)
    assert out.tolist() == [7.0] * 5


def test_a_forked_child_lets_go_of_the_arena(shared_region):
    # Else a DataLoader worker forked from a trainer would keep the trainer's locks alive after
    # the trainer died: OFD locks go only when every descriptor of their open file is closed.
    _, worker = shared_region
    pid = os.fork()
    if pid == 0:
        os._exit(0 if worker.fd == -1 else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert worker.fd != -1  # the parent keeps its own


def test_an_arena_is_mapped_only_if_it_is_the_one_described():
    arena = Arena()
    try:
        pid, fd, token = arena.describe()
        with pytest.raises(ValueError, match="token differs"):
            ArenaMap.open([pid, fd, bytes(32)])
        worker_map = ArenaMap.open([pid, fd, token])
        with pytest.raises(ValueError, match="outside the arena"):
            worker_map.region(PAGE, 1000, torch.float32, 3)  # no such region yet
        worker_map.close()
    finally:
        os.close(arena.fd)


# -- real jobs --------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "kind, workers, servers, path",
    [
        ("dist_sync", 3, 3, "mixed"),  # worker 1 over TCP: the servers add its payloads in shared memory
        ("dist_sync", 4, 2, "shm"),
        ("dist_sync", 2, 2, "tcp"),  # pushes into pooled buffers, pulls over the socket
        ("dist_sync_device", 3, 2, "shm"),
    ],
)
def test_sync_values_are_exact(kind, workers, servers, path):
    args = (kind, "3", path)
    outcome = run_job(JOBS / "kv_exact.py", workers=workers, servers=servers, args=args, timeout_s=200)
    for rank in range(workers):
        assert outcome.lines("worker", rank, "stdout")[-1] == "all exact"


@pytest.mark.timeout(240)
def test_bounded_staleness_holds_the_fast_workers_back_by_at_most_s_rounds(tmp_path):
    # Worker 2 is slow: before each push it waits until both fast workers announced that they are
    # about to pull at a clock that needs that push, then writes a marker and pushes. A fast
    # worker's pull that returns must then find the marker of every round it depended on: it was
    # held back. Every pull's version must also be within s rounds of the puller's own clock.
    outcome = run_job(
        f"""
        import os, time, torch, paratrain, paratrain.kvstore
        from paratrain.kvstore import KVStoreConfig
        S, ROUNDS, SLOW = 1, 5, 2
        marks = {str(tmp_path)!r}
        ctx = paratrain.init()
        kv = paratrain.kvstore.create(KVStoreConfig(consistency="bounded", staleness=S))
        kv.init("w", torch.zeros(4))
        out = torch.empty(4)
        def touch(name):
            open(os.path.join(marks, name), "w").close()
        def exists(name):
            return os.path.exists(os.path.join(marks, name))
        held = 0
        for clock in range(1, ROUNDS + 1):           # clock: pushes done after this round's push
            if ctx.rank == SLOW:
                round_ = clock - 1
                # fast workers at clock round_+S+1 need this push; wait until they are pulling
                deadline = time.monotonic() + 60
                while clock + S <= ROUNDS and not all(exists(f"pulling-{{r}}-{{clock + S}}") for r in (0, 1)):
                    assert time.monotonic() < deadline, "fast workers never reached their pull"
                    time.sleep(0.01)
                touch(f"pushed-{{round_}}")
                kv.push("w", torch.ones(4)).wait()
                continue
            kv.push("w", torch.ones(4)).wait()
            touch(f"pulling-{{ctx.rank}}-{{clock}}")
            version = kv.pull("w", out=out)
            assert version >= clock - S, (clock, version)       # never more than S rounds ahead
            needed = clock - S - 1                               # the slow round this pull needed
            if needed >= 0:
                assert exists(f"pushed-{{needed}}"), (clock, needed)
                held += 1
        print("held", held)
        """,
        workers=3,
        servers=2,
        timeout_s=200,
    )
    for rank in (0, 1):
        assert outcome.lines("worker", rank, "stdout")[-1] == "held 4"


@pytest.mark.timeout(240)
def test_every_bounded_pull_holds_exactly_the_version_it_reports():
    # Several pushpulls in flight at once, workers drifting apart within the bound, pulls copied
    # out of the servers' shared memory while rounds are applied: with SGD(lr=1) and worker w
    # pushing (w + 1) * (r + 1) in round r, version v of every element is -T * v * (v + 1) / 2.
    outcome = run_job(
        """
        import random, time, torch, paratrain, paratrain.kvstore
        from paratrain.kvstore import KVStoreConfig
        S = 2
        ctx = paratrain.init()
        kv = paratrain.kvstore.create(KVStoreConfig(consistency="bounded", staleness=S))
        sizes = {"a": 5, "b": 300_000, "c": 1000, "d": 50_000}
        kv.init(list(sizes), [torch.zeros(n) for n in sizes.values()])
        kv.set_optimizer(torch.optim.SGD, lr=1.0)
        outs = {k: torch.empty(n) for k, n in sizes.items()}
        rng = random.Random(ctx.rank)
        T = ctx.num_workers * (ctx.num_workers + 1) // 2
        wrong = []
        for r in range(150):
            handles = []
            for k, n in sizes.items():
                grad = torch.full((n,), float((ctx.rank + 1) * (r + 1)))
                handles.append((k, kv.pushpull_async(k, grad, out=outs[k])))
                if rng.random() < 0.2:
                    time.sleep(0.002 * rng.random())
            for k, handle in handles:
                handle.wait()
                v = handle.version
                if v < r + 1 - S or not bool((outs[k] == -T * v * (v + 1) / 2).all()):
                    wrong.append((k, r, v))
        print("wrong", wrong[:5])
        """,
        workers=2,
        servers=2,
        timeout_s=200,
    )
    for rank in (0, 1):
        assert outcome.lines("worker", rank, "stdout")[-1] == "wrong []"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("aggregation", ["process", "host"])  # dist_async, dist_async_device
def test_async_applies_every_push_from_every_worker(aggregation):
    outcome = run_job(
        """
        import sys, torch, paratrain, paratrain.kvstore
        from paratrain.kvstore import KVStoreConfig
        ctx = paratrain.init()
        config = KVStoreConfig(consistency="async", aggregation=sys.argv[1], slice_elements=1000)
        kv = paratrain.kvstore.create(config)
        keys = ["a", 1, "big"]
        kv.init(keys, [torch.full((5,), 10.0), torch.zeros(3, 3), torch.zeros(2500)])
        outs = [torch.empty(5), torch.empty(3, 3), torch.empty(2500)]
        for step in range(20):
            grads = [torch.full((5,), float(ctx.rank + 1)), torch.ones(3, 3), torch.full((2500,), 2.0)]
            handle = kv.push(keys, grads)
            if step % 5 == 4:
                kv.pull(keys, out=outs)   # any version: async pulls never wait
            handle.wait()
        kv.barrier()
        kv.pull(keys, out=outs)
        W = ctx.num_workers
        assert outs[0].tolist() == [10.0 + 20 * W * (W + 1) / 2] * 5, outs[0]
        assert outs[1].eq(20 * W).all(), outs[1]
        assert outs[2].eq(40 * W).all(), outs[2]
        kv.barrier()
        kv.set_optimizer("torch.optim.SGD", lr=0.5)
        for step in range(10):
            kv.push(keys, [torch.ones(5), torch.ones(3, 3), torch.ones(2500)]).wait()
        kv.barrier()
        kv.pull(keys, out=outs)
        assert outs[1].eq(20 * W - 0.5 * 10 * W).all(), outs[1]
        assert outs[2].eq(40 * W - 0.5 * 10 * W).all(), outs[2]
        print("async exact")
        """,
        workers=3,
        servers=2,
        args=(aggregation,),
        timeout_s=200,
    )
    assert outcome.lines("worker", 2, "stdout")[-1] == "async exact"


STATE_JOB = """
import sys, torch, paratrain, paratrain.kvstore
from paratrain.kvstore import KVStoreConfig
mode, path = sys.argv[1], sys.argv[2]
ctx = paratrain.init()
kv = paratrain.kvstore.create(KVStoreConfig(slice_elements=100))
keys = ["emb", 0, "head"]
shapes = [(40, 10), (3,), (5, 2)]          # "emb" is sliced across every server
start = torch.Generator().manual_seed(7)
kv.init(keys, [torch.zeros(s) if mode == "load" else torch.randn(s, generator=start) for s in shapes])
kv.set_optimizer(torch.optim.Adam, lr=0.01)
outs = [torch.empty(s) for s in shapes]
def step(r):
    g = torch.Generator().manual_seed(100 * r + ctx.rank)
    kv.pushpull(keys, [torch.randn(s, generator=g) for s in shapes], out=outs)
if mode == "save":
    kv.set_hyperparameters(["emb", 0], lr=0.05, betas=[0.8, 0.9]).wait()  # kept in the file
    for r in range(3):
        step(r)
    kv.save_state(path)
    saved = [o.clone() for o in outs]
else:
    kv.load_state(path)
    kv.pull(keys, out=outs)
    saved = [o.clone() for o in outs]
step(3)   # Adam's step depends on its moments: equal results need the optimizer state too
if ctx.rank == 0:
    torch.save({"saved": saved, "after": [o.clone() for o in outs]}, path + "." + mode)
"""


@pytest.mark.timeout(300)
def test_state_round_trip_into_a_different_number_of_servers(tmp_path):
    path = str(tmp_path / "kv.pt")
    run_job(STATE_JOB, workers=2, servers=2, args=("save", path), timeout_s=200)
    run_job(STATE_JOB, workers=2, servers=3, args=("load", path), timeout_s=200)
    saved, loaded = torch.load(path + ".save"), torch.load(path + ".load")
    for a, b in zip(saved["saved"], loaded["saved"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(saved["after"], loaded["after"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.timeout(240)
def test_a_worker_that_leaves_early_does_not_hang_the_others_and_bad_calls_get_clear_errors():
    outcome = run_job(
        """
        import torch, paratrain, paratrain.kvstore
        from paratrain.errors import KVStoreError, RemoteError
        ctx = paratrain.init()
        kv = paratrain.kvstore.create("dist_sync")
        kv.init("w", torch.zeros(2))
        out = torch.empty(2)
        rounds = 2 if ctx.rank == 1 else 5      # worker 1 runs out of data after 2 rounds
        for r in range(rounds):
            kv.pushpull("w", torch.full((2,), float(ctx.rank + 1)), out=out)
        if ctx.rank == 1:
            kv.close()                           # leave: later rounds stop waiting for rank 1
        else:
            assert out.tolist() == [1.0, 1.0], out   # rounds 2..4 were worker 0's alone
            try:
                kv.push("missing", torch.zeros(1))
            except KVStoreError as exc:
                print("error:", exc)
            try:
                kv.init("w", torch.zeros(3))
            except ValueError as exc:
                print("error:", exc)
            meta = {"keys": ["w"], "starts": [0], "stops": [2], "clocks": [99], "rank": 0, "added": [True]}
            try:   # claims to have added round 99 into a shared buffer that is not open
                kv._clients[0].call("push", meta)
            except RemoteError as exc:
                print("error:", exc)
            kv.pull("w", out=out)                    # the server goes on serving
        print("finished", ctx.rank)
        """,
        workers=2,
        servers=1,
        timeout_s=200,
    )
    lines = outcome.lines("worker", 0, "stdout")
    missing = "error: key 'missing' was never initialized (call kv.init first)"
    assert any(line.startswith(missing) for line in lines)  # then the troubleshooting link
    assert any("init as torch.float32[3] is not allowed" in line for line in lines)
    assert any("no shared buffer is open for round 99" in line for line in lines)
    assert lines[-1] == "finished 0"


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/paratrain-pwned",))


def test_state_files_load_without_running_code(tmp_path):
    import pickle

    kv = create("local")
    kv.init("w", torch.zeros(2))
    torch.save({"x": 1}, tmp_path / "other.pt")
    with pytest.raises(KVStoreError, match="is not a paratrain kvstore state file"):
        kv.load_state(tmp_path / "other.pt")
    marker = Path("/tmp/paratrain-pwned")
    marker.unlink(missing_ok=True)
    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"format": _Evil()}, protocol=2))
    with pytest.raises(pickle.UnpicklingError):
        kv.load_state(tmp_path / "evil.pt")
    assert not marker.exists()


def test_frames_of_compressed_keys_are_filled_by_their_compressed_bytes():
    from paratrain.compression import CompressionConfig
    from paratrain.kvstore.compressed import WorkerCompression
    from paratrain.kvstore.placement import Slice
    from paratrain.kvstore.worker.client import DistKVStore, KeyInfo

    store = DistKVStore.__new__(DistKVStore)  # only what _frames reads: no servers needed
    store.rank, store._clients = 0, [None]
    store._keys = {k: KeyInfo([4096], torch.float32, [Slice(0, 0, 4096)]) for k in range(8)}
    store._compression = WorkerCompression(CompressionConfig("2bit", threshold=0.5))

    def frames(compressed: bool) -> list[list]:
        found = store._frames(list(range(8)), 4 << 10, compressed)
        return [frame.keys for _, frame in found]

    # 16 KiB of float32 each, over the 4 KiB: a frame of its own raw; 1 KiB in 2bit: four a frame.
    assert frames(compressed=False) == [[k] for k in range(8)]
    assert frames(compressed=True) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    store._keys[8] = KeyInfo([10], torch.float32, [Slice(0, 0, 10)])  # under min_elements: sent raw
    found = store._frames([8, 0], 1040, True)  # 40 + 1024 B: two frames
    assert [(frame.keys, frame.more) for _, frame in found] == [([8], True), ([0], False)]


def test_the_worker_builds_its_frames_as_typed_messages_with_the_wire_form_unchanged():
    """Push, pushpull and pull frames are built from protocol.py's messages; their maps carry the
    fields in the order they always had, and a field at its default (weight 1, more False) not at
    all, so frames keep their bytes."""
    from paratrain.kvstore.api import KVStoreConfig
    from paratrain.kvstore.placement import Slice
    from paratrain.kvstore.worker.client import DistKVStore, KeyInfo

    sent = []

    class Recorder:
        replication = 1

        def in_place(self, server):
            return False

        def request(self, server, op, meta, tensors=(), out=None, payload=None):
            sent.append((server, op, list(meta.items()), len(tensors)))

    store = DistKVStore.__new__(DistKVStore)  # no servers: what the requests would carry
    store.config = KVStoreConfig(consistency="sync", frame_bytes=16)
    store.rank, store._clients, store._timeout_s, store._joined = 1, [None, None], 1.0, False
    store._servers, store._compression, store._weight, store._frame_bytes = Recorder(), None, 1, 16
    store._keys = {k: KeyInfo([4], torch.float32, [Slice(0, 0, 4)]) for k in ("a", "b")}
    store._keys["c"] = KeyInfo([4], torch.float32, [Slice(1, 0, 4)])
    store.push(["a", "b", "c"], [torch.ones(4)] * 3)
    where = [("starts", [0]), ("stops", [4]), ("rank", 1), ("clocks", [0]), ("min_versions", [1])]
    assert sent == [
        (1, "push", [("keys", ["c"]), *where], 1),  # from server `rank` on (_interleaved)
        (0, "push", [("keys", ["a"]), *where, ("more", True)], 1),
        (0, "push", [("keys", ["b"]), *where], 1),
    ]
    sent.clear()
    store._weight = 3
    store.pushpull_async("c", torch.ones(4), torch.empty(4))
    store.pull_async("c", torch.empty(4))
    clock = [("clocks", [1]), ("min_versions", [2])]
    assert sent == [
        (
            1,
            "pushpull",
            [("keys", ["c"]), ("starts", [0]), ("stops", [4]), ("rank", 1), *clock, ("weight", 3)],
            1,
        ),
        (
            1,
            "pull",
            [("keys", ["c"]), ("starts", [0]), ("stops", [4]), ("rank", 1), ("min_versions", [2])],
            0,
        ),
    ]
