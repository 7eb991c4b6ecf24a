"""The dashboard's pieces without processes: the board's rates and splits, /metrics from it, the
token and its 401s, trace files and their merge, the settings' checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from paratrain.metrics.board import JobBoard, hottest_keys, staleness_total
from paratrain.metrics.dashboard import DashboardConfig, build_app, dashboard_token, dashboard_url
from paratrain.metrics.prometheus import prometheus_text
from paratrain.metrics.trace import Tracer, merge_traces, read_trace

pytestmark = pytest.mark.timeout(30)

ROLES = [
    {"role": "server", "rank": 0, "host": "h", "pid": 1, "state": "running", "heartbeat_age_s": 0.2},
    {"role": "worker", "rank": 0, "host": "h", "pid": 2, "state": "failed", "heartbeat_age_s": 3.0},
]


def _worker(t: float, steps: int, samples: int, compute: float, loss: float) -> dict:
    seconds = {
        "data": steps * 0.003,
        "compute": compute,
        "communication": steps * 0.01,
        "waiting": steps * 0.02,
    }
    return {
        "time": t,
        "steps": steps,
        "samples": samples,
        "loss": loss,
        "seconds": seconds,
        "rss_bytes": 5,
        "peak_memory_bytes": 7,
    }


def _server(t: float, pushes: int, staleness: list) -> dict:
    key = {"key": "w", "pushes": pushes, "pulls": pushes, "bytes_in": 40 * pushes, "bytes_out": 40 * pushes}
    return {
        "time": t,
        "pushes": pushes,
        "pulls": pushes,
        "bytes_in": 40 * pushes,
        "bytes_out": 40 * pushes,
        "waiting_pulls": 1,
        "open_rounds": 2,
        "staleness": staleness,
        "tables": [{"key": "emb", "rows": 7}],
        "keys": [{**key, "version": pushes}],
        "rss_bytes": 9,
    }


def _board() -> JobBoard:
    board = JobBoard(lambda: ROLES, lambda: {"state": "running", "failures": []}, strategy="ps, sync")
    board.record("worker", 0, _worker(100.0, 10, 320, 1.0, 0.9))
    board.record("worker", 0, _worker(102.0, 30, 960, 2.0, 0.5))
    board.record("server", 0, _server(100.0, 10, [[0, 8], [3, 2]]))
    board.record("server", 0, _server(101.0, 30, [[0, 20], [3, 10]]))
    return board


def test_board_rates_split_and_curves() -> None:
    state = _board().state()
    (worker,) = state["workers"]
    assert worker["step"] == 30 and worker["samples_per_s"] == pytest.approx(320.0)
    # 20 steps took 0.06 s waiting on data, 1.0 s of compute, 0.2 s of communication, 0.4 s waiting
    assert worker["seconds_per_step"] == pytest.approx(
        {"data": 0.003, "compute": 0.05, "communication": 0.01, "waiting": 0.02}
    )
    assert [point[1:] for point in worker["history"]] == [[10, 0.9], [30, 0.5]]
    (server,) = state["servers"]
    assert server["pushes_per_s"] == pytest.approx(20.0) and server["bytes_in_per_s"] == pytest.approx(800.0)
    assert state["staleness"] == [[0, 20], [3, 10]]
    assert state["job"]["strategy"] == "ps, sync"


def test_board_ignores_a_report_that_is_not_a_dict() -> None:
    board = _board()
    board.record("worker", 0, "junk")  # type: ignore[arg-type]
    assert board.state()["workers"][0]["step"] == 30


def test_hottest_keys_and_staleness_sum_over_servers() -> None:
    servers = [
        {"rank": 0, "keys": [{"key": "a", "bytes_in": 5, "bytes_out": 0}], "staleness": [[0, 1], [2, 4]]},
        {"rank": 1, "keys": [{"key": "b", "bytes_in": 50, "bytes_out": 1}], "staleness": [[2, 1]]},
    ]
    assert [(k["key"], k["server"]) for k in hottest_keys(servers)] == [("b", 1), ("a", 0)]
    assert staleness_total(servers) == [[0, 1], [2, 5]]


def test_prometheus_text_parses_with_labels_and_conventions() -> None:
    families = {f.name: f for f in text_string_to_metric_families(prometheus_text(_board()).decode())}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples
    }
    assert samples["paratrain_worker_steps_total", (("rank", "0"), ("role", "worker"))] == 30
    assert samples["paratrain_worker_peak_memory_bytes", (("rank", "0"), ("role", "worker"))] == 7
    key = (("key", "w"), ("rank", "0"), ("role", "server"))
    assert samples["paratrain_key_received_bytes_total", key] == 1200
    assert samples["paratrain_node_up", (("rank", "0"), ("role", "worker"))] == 0  # failed
    assert samples["paratrain_sparse_table_rows", (("key", "emb"), ("rank", "0"), ("role", "server"))] == 7
    buckets = {
        dict(s.labels)["le"]: s.value
        for s in families["paratrain_push_staleness_rounds"].samples
        if s.name.endswith("_bucket")
    }
    assert buckets["0"] == 20 and buckets["2"] == 20 and buckets["4"] == 30 and buckets["+Inf"] == 30
    assert families["paratrain_worker_steps"].type == "counter"
    assert families["paratrain_server_waiting_pulls"].type == "gauge"
    for name, family in families.items():
        assert name.startswith("paratrain_")
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples)


def test_token_guards_every_route() -> None:
    token = dashboard_token(b"s" * 32)
    assert token != dashboard_token(b"t" * 32) and len(token) == 32
    client = TestClient(build_app(_board(), token))
    for path in ("/", "/workers", "/servers", "/keys", "/staleness", "/api/state", "/metrics"):
        assert client.get(path).status_code == 401
        assert client.get(f"{path}?token=wrong").status_code == 401
    page = client.get(f"/workers?token={token}")
    assert page.status_code == 200 and "paratrain" in page.text
    # No cookie: a browser would send it to every server on the host, any port, any user's.
    assert "set-cookie" not in page.headers and not client.cookies
    assert page.headers["referrer-policy"] == "no-referrer"
    assert client.get("/api/state").status_code == 401
    fresh = TestClient(build_app(_board(), token))
    metrics = fresh.get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert metrics.status_code == 200 and "paratrain_worker_steps_total" in metrics.text
    assert dashboard_url("::1", 80, token) == f"http://[::1]:80/?token={token}"


@pytest.mark.parametrize(
    "field, value", [("host", ""), ("port", -1), ("port", 70000), ("port", True), ("linger_s", -1.0)]
)
def test_dashboard_config_names_bad_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"DashboardConfig.{field}="):
        DashboardConfig(**{field: value})


def test_trace_files_merge_onto_the_scheduler_clock(tmp_path: Path) -> None:
    worker = Tracer(tmp_path / "trace-worker0.json", role="worker", rank=0, clock_offset_s=0.5, flush_s=60)
    server = Tracer(tmp_path / "trace-server0.json", role="server", rank=0, flush_s=60)
    with worker.range("push", keys=2):
        pass
    worker.add("forward", 1000.0, 10.0)
    server.add("serve push", 2000.0, 5.0)
    worker.flush()  # a process killed now leaves a file without its closing "]"
    meta, events = read_trace(tmp_path / "trace-worker0.json")
    assert meta == {"role": "worker", "rank": 0, "clock_offset_s": 0.5} and len(events) == 2
    worker.close()
    server.close()
    merged = json.loads(json.dumps(merge_traces(tmp_path)))
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"}
    assert names == {1: "server 0", 2: "worker 0"}
    forward = next(e for e in merged["traceEvents"] if e["name"] == "forward")
    assert forward["ts"] == 1000.0 + 0.5e6 and forward["pid"] == 2 and forward["ph"] == "X"


def test_merge_names_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no trace"):
        merge_traces(tmp_path)
    (tmp_path / "trace-x.json").write_text("[\n{}\n")
    with pytest.raises(ValueError, match="trace-x.json"):
        merge_traces(tmp_path)


def test_peak_memory_is_the_gpu_allocators_on_a_gpu_and_peak_rss_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import resource

    import torch

    from paratrain.metrics.telemetry import peak_memory_bytes

    asked = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: asked.append(device) or 1234)
    assert peak_memory_bytes(torch.device("cuda", 1)) == 1234 and asked == [torch.device("cuda", 1)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert peak_memory_bytes(torch.device("cpu")) >= before and peak_memory_bytes(None) >= before


def test_trainer_trace_dir_writes_a_timeline_and_telemetry(tmp_path: Path) -> None:
    import torch
    from torch import nn

    from paratrain.metrics.telemetry import worker_telemetry
    from paratrain.metrics.trace import close_tracer
    from paratrain.node import Context
    from paratrain.train import Trainer

    model = nn.Linear(4, 1)
    before = worker_telemetry().report()["steps"]
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), ctx=Context("worker", 0, 1, 0), trace_dir=tmp_path
    )
    try:
        for _ in range(3):
            trainer.step(trainer.model(torch.randn(8, 4)).pow(2).mean())
    finally:
        close_tracer()
    meta, events = read_trace(tmp_path / "trace-worker0.json")
    assert meta["role"] == "worker" and meta["clock_offset_s"] == 0.0
    names = [e["name"] for e in events]
    assert names.count("forward") == names.count("backward") == names.count("optimizer step") == 3
    report = worker_telemetry().report()
    assert report["steps"] == before + 3 and report["loss"] is not None and report["strategy"] == "local"
    # On the CPU the peak is the process's peak RSS: about what it holds now, or more (the kernel
    # folds each thread's page counts into the peak lazily, so it may trail the RSS a little).
    assert report["peak_memory_bytes"] >= 0.9 * report["rss_bytes"] > 0


def test_a_prepared_loop_records_its_backward_ranges_as_the_trainer_does(tmp_path: Path) -> None:
    import torch
    from torch import nn

    from paratrain.metrics.trace import close_tracer
    from paratrain.node import Context
    from paratrain.train import prepare

    model = nn.Linear(4, 1)
    model, optimizer = prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), ctx=Context("worker", 0, 1, 0), trace_dir=tmp_path
    )
    try:
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            optimizer.step()
        with torch.no_grad():
            model(torch.randn(2, 4))  # no backward follows: no range
    finally:
        close_tracer()
    _, events = read_trace(tmp_path / "trace-worker0.json")
    names = [e["name"] for e in events]
    assert names.count("backward") == names.count("optimizer step") == 3 and names.count("forward") == 4
    forwards = [e for e in events if e["name"] == "forward"]
    backwards = [e for e in events if e["name"] == "backward"]
    assert all(f["ts"] + f["dur"] <= b["ts"] for f, b in zip(forwards, backwards, strict=False))


class FakeConn:
    """The connection of a FakeRequest: hashable, as the server keys its reply senders by it."""

    recv_ring = None
    closed = False
    peer = "fake"


class FakeRequest:
    """A frame as KVServer.handle sees it, from a worker on another host; keeps the reply."""

    def __init__(self, op: str, meta: dict, tensors: list | None = None) -> None:
        from types import SimpleNamespace

        self.op, self.meta, self.tensors = op, meta, tensors or []
        self.header = SimpleNamespace(op=op, meta=meta, at=None)
        self.conn = FakeConn()
        self.replies: list = []

    def reply(self, meta: dict | None = None, tensors: list | tuple = ()) -> None:
        self.replies.append(meta)

    def fail(self, message: str) -> None:
        raise AssertionError(message)


def _kv_server(mode: str):  # noqa: ANN202
    import torch

    from paratrain.kvstore.server.server import KVServer

    kv = KVServer(0, intra_op_threads=None)
    kv.handle(FakeRequest("configure", {"mode": mode, "members": [0, 1]}))
    ident = {
        "keys": ["w"],
        "starts": [0],
        "stops": [4],
        "shapes": [[4]],
        "dtypes": ["float32"],
        "numels": [4],
    }
    kv.handle(FakeRequest("init", ident, [torch.zeros(4)]))
    return kv


def _push(kv, rank: int, clock: int = 0) -> None:  # noqa: ANN001
    import torch

    meta = {"keys": ["w"], "starts": [0], "stops": [4], "clocks": [clock], "rank": rank}
    kv.handle(FakeRequest("push", meta, [torch.ones(4)]))


def _pull(kv, rank: int) -> None:  # noqa: ANN001
    """A pull, once its reply went out: the server replies from a sender thread (replies.py)."""
    import time

    from paratrain.kvstore.server.report import server_report

    before = server_report(kv)["pulls"]
    kv.handle(
        FakeRequest("pull", {"keys": ["w"], "starts": [0], "stops": [4], "min_versions": [0], "rank": rank})
    )
    deadline = time.monotonic() + 30
    while server_report(kv)["pulls"] == before and time.monotonic() < deadline:
        time.sleep(0.001)


def test_server_counts_how_stale_each_push_is_and_reports_it() -> None:
    from paratrain.kvstore.server.report import server_report

    kv = _kv_server("async")
    _pull(kv, 0)  # worker 0 reads version 0
    _push(kv, 1)  # 0 behind (worker 1 never pulled: it starts from the initial value)
    _push(kv, 1)  # 1 behind
    _push(kv, 0)  # 2 behind: two updates since worker 0's pull
    report = server_report(kv)
    assert report["staleness"] == [[0, 1], [1, 1], [2, 1]]
    assert (report["pushes"], report["pulls"], report["bytes_in"], report["bytes_out"]) == (3, 1, 48, 16)
    (key,) = report["keys"]
    assert key == {"key": "w", "pushes": 3, "pulls": 1, "bytes_in": 48, "bytes_out": 16, "late": 0} | {
        "version": 3
    }

    bounded = _kv_server("rounds")
    _push(bounded, 0, clock=0)
    _push(bounded, 1, clock=0)  # round 0 applied: version 1
    _pull(bounded, 0)  # worker 0 reads version 1
    _push(bounded, 0, clock=1)  # computed on version 1 for round 1: 0 behind
    _push(bounded, 0, clock=2)  # a step ahead without a pull: 1 behind
    assert server_report(bounded)["staleness"] == [[0, 3], [1, 1]]
    assert server_report(bounded)["open_rounds"] == 2


def test_ddp_all_reduce_ranges_keep_ddp_gradients(tmp_path: Path) -> None:
    """While tracing, a DDP model's buckets go through a timing comm hook: same gradients."""
    import gc
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from torch import nn

    from paratrain.metrics.trace import close_tracer, open_tracer
    from paratrain.testing import free_port
    from paratrain.train.observe import StepObserver

    def traced_gradient(plain: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # The DDP model (and its reducer, which holds the process group) is gone when this returns,
        # before the group is destroyed: the order torch expects (the other order once hung in
        # Gloo's destructor here).
        traced = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
        traced.module.load_state_dict(plain.state_dict())
        StepObserver(SimpleNamespace(rank=0, link=None, distributed=True), None).attach(traced)
        traced(x).sum().backward()
        return traced.module.weight.grad

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain, x = nn.Linear(4, 2), torch.randn(3, 4)
        open_tracer(tmp_path, role="worker", rank=0)
        plain(x).sum().backward()
        assert torch.equal(plain.weight.grad, traced_gradient(plain, x))
    finally:
        close_tracer()
        gc.collect()  # a DDP model in a reference cycle too
        dist.destroy_process_group()
    names = {e["name"] for e in read_trace(tmp_path / "trace-worker0.json")[1]}
    assert {"all_reduce", "forward"} <= names


def test_prometheus_names_stragglers_and_their_slowdown() -> None:
    job = {"state": "running", "failures": [], "stragglers": [{"rank": 1, "ratio": 3.2}]}
    board = JobBoard(lambda: ROLES, lambda: {**job, "slowdown": [[0, 0.9], [1, 3.2]]})
    for rank in (0, 1):
        board.record("worker", rank, _worker(100.0, 10, 320, 1.0, 0.9))
    samples = {
        (s.name, s.labels["rank"]): s.value
        for f in text_string_to_metric_families(prometheus_text(board).decode())
        for s in f.samples
        if s.labels.get("role") == "worker"
    }
    assert samples["paratrain_worker_straggler", "0"] == 0 and samples["paratrain_worker_straggler", "1"] == 1
    assert samples["paratrain_worker_slowdown_ratio", "1"] == pytest.approx(3.2)
