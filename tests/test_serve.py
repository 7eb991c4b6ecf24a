"""Serving over real HTTP (httpx against uvicorn on 127.0.0.1): answers equal model(x) in every wire
form and under concurrent load (batched), bad requests get a 4xx naming the problem while the
server goes on, a newer checkpoint is picked up with no failed request, and exported weights load."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

import paratrain.serve
from paratrain import checkpoint
from paratrain.errors import CheckpointError
from paratrain.serve.api import InputSpec, ServeConfig
from paratrain.serve.batcher import FEW_ROWS, Batcher, ModelInputError
from paratrain.serve.http import HttpServer
from paratrain.serve.model import load_factory
from paratrain.serve.service import model_app
from paratrain.testing import assert_all_gone, free_port

MODELS = Path(__file__).parent / "serve_models.py"
X_SPEC = InputSpec("inputs", "float32", (4,))


def save_step(root: Path, step: int, model: torch.nn.Module, keep: int | None = None) -> None:
    folder = checkpoint.staging_dir(root, step)
    checkpoint.save_file(folder / "model.pt", {"model": model.state_dict(), "optimizer": {}})
    checkpoint.commit(root, step, {}, keep=keep)


def perturbed(step: int) -> torch.nn.Module:
    """The mlp with its weights shifted by `step` (what training would have made of it)."""
    model = load_factory(f"{MODELS}:mlp")()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * step)
    return model.eval()


def serve(root: Path, factory: str = "mlp", **config) -> HttpServer:
    app = model_app(load_factory(f"{MODELS}:{factory}"), root, ServeConfig(**config))
    return HttpServer(app).start()


def test_answers_equal_the_model_in_every_form_and_batched(tmp_path):
    save_step(tmp_path, 7, perturbed(7))
    model = perturbed(7)
    x = torch.randn(64, 4)
    with torch.no_grad():
        expected = model(x)
    server = serve(tmp_path, inputs=[X_SPEC], max_batch=16, batch_wait_s=0.02)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            answer = client.post("/predict", json={"inputs": x[:3].tolist()}).json()
            assert answer["model_step"] == 7 and answer["shape"] == [3, 3] and answer["dtype"] == "float32"
            torch.testing.assert_close(torch.tensor(answer["outputs"]), expected[:3])

            body = save_safetensors({"inputs": x[3:5].contiguous()})
            reply = client.post(
                "/predict",
                content=body,
                headers={"content-type": "application/x-safetensors", "accept": "application/x-safetensors"},
            )
            assert reply.headers["x-model-step"] == "7"
            torch.testing.assert_close(load_safetensors(reply.content)["outputs"], expected[3:5])

            raw = {"content-type": "application/octet-stream", "x-dtype": "float32", "x-shape": "2,4"}
            reply = client.post(
                "/predict",
                content=x[5:7].numpy().tobytes(),
                headers=raw | {"accept": "application/octet-stream"},
            )
            assert (reply.headers["x-dtype"], reply.headers["x-shape"]) == ("float32", "2,3")
            got = torch.frombuffer(bytearray(reply.content), dtype=torch.float32).reshape(2, 3)
            torch.testing.assert_close(got, expected[5:7])

            def one(i: int) -> torch.Tensor:  # 64 clients at once: answers come from shared batches
                reply = client.post("/predict", json={"inputs": x[i : i + 1].tolist()})
                assert reply.status_code == 200, reply.text
                return torch.tensor(reply.json()["outputs"])

            with ThreadPoolExecutor(32) as pool:
                answers = list(pool.map(one, range(64)))
            torch.testing.assert_close(torch.cat(answers), expected)
            metrics = client.get("/metrics").text
            assert 'paratrain_serve_requests_total{status="200"} 67.0' in metrics
            batches = _metric(metrics, "paratrain_serve_batch_requests_count")
            assert batches < 67  # some requests shared a batch
            assert _metric(metrics, "paratrain_serve_batch_rows_sum") == 64 + 7
            assert _metric(metrics, "paratrain_serve_model_step") == 7
            assert client.get("/healthz").json()["model_step"] == 7
    finally:
        server.close()


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


BAD_REQUESTS = [  # (body or json, headers, status, words of the error)
    ({"json": {"inputs": [[1.0, 2.0, 3.0]]}}, 422, "has shape [1, 3]; the model takes [rows, 4]"),
    ({"json": {"inputs": [[1, 2], [3]]}}, 422, "not a rectangular array"),
    ({"json": {"inputs": [[1.0, 2.0, 3.0, 4.0]] * 9}}, 413, "9 rows; the limit is 8"),
    ({"json": {"outputs": [1]}}, 400, '"inputs"'),
    ({"json": {"inputs": {"x": [[1.0] * 4]}}}, 422, "missing ['inputs'], unexpected ['x']"),
    ({"json": {"inputs": []}}, 422, "has no rows"),
    (
        {"content": b'{"inputs": [[1, 2', "headers": {"content-type": "application/json"}},
        400,
        "not valid JSON",
    ),
    ({"content": b"x" * 5000, "headers": {"content-type": "application/json"}}, 413, "the limit is 4096"),
    ({"content": b"abc", "headers": {"content-type": "text/plain"}}, 415, "text/plain"),
    ({"content": b"\x00" * 8, "headers": {"content-type": "application/x-safetensors"}}, 400, "safetensors"),
    ({"content": b"\x00" * 12, "headers": {"content-type": "application/octet-stream"}}, 400, "X-Dtype"),
    (
        {
            "content": b"\x00" * 12,
            "headers": {"content-type": "application/octet-stream", "x-dtype": "float32", "x-shape": "1,4"},
        },
        400,
        "16 bytes; the body has 12",
    ),
    (
        {
            "content": b"\x00" * 32,
            "headers": {"content-type": "application/octet-stream", "x-dtype": "float64", "x-shape": "1,4"},
        },
        422,
        "dtype float64; the model takes float32",
    ),
]


def test_bad_requests_get_a_4xx_naming_the_problem_and_the_server_goes_on(tmp_path):
    save_step(tmp_path, 1, perturbed(1))
    server = serve(tmp_path, inputs=[X_SPEC], max_request_rows=8, max_body_bytes=4096)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for request, status, words in BAD_REQUESTS:
                reply = client.post("/predict", **request)
                assert (reply.status_code, words in reply.json()["error"]) == (status, True), (
                    request,
                    reply.text,
                )
            x = torch.randn(2, 4)
            reply = client.post("/predict", json={"inputs": x.tolist()})
            assert reply.status_code == 200
            torch.testing.assert_close(torch.tensor(reply.json()["outputs"]), perturbed(1)(x).detach())
            assert client.get("/predict").status_code == 405
    finally:
        server.close()


def test_without_declared_inputs_a_request_the_model_fails_on_fails_alone(tmp_path):
    """No InputSpec: a wrong shape reaches the model; it fails that request only (422 with the model's
    error), even when it shared a batch with good ones; named inputs go to forward as keywords."""
    model = load_factory(f"{MODELS}:two_inputs")()
    save_step(tmp_path, 3, model)
    server = serve(tmp_path, factory="two_inputs", max_batch=64, batch_wait_s=0.05)
    x, ids = torch.randn(4, 3), torch.randint(0, 10, (4, 5))
    good = {"inputs": {"x": x.tolist(), "ids": ids.tolist()}}
    bad = {"inputs": {"x": torch.randn(4, 3).tolist(), "ids": [[99] * 5] * 4}}  # ids out of range
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client, ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda body: client.post("/predict", json=body), [good, bad] * 4))
        for reply in replies[0::2]:
            assert reply.status_code == 200, reply.text
            torch.testing.assert_close(torch.tensor(reply.json()["outputs"]), model(x, ids).detach())
        for reply in replies[1::2]:
            assert reply.status_code == 422 and "IndexError" in reply.json()["error"], reply.text
    finally:
        server.close()


def test_a_newer_checkpoint_is_served_with_no_failed_request(tmp_path):
    save_step(tmp_path, 1, perturbed(1))
    server = serve(tmp_path, inputs=[X_SPEC], reload_interval_s=0.05, max_batch=8, batch_wait_s=0.002)
    x = torch.randn(1, 4)
    expected = {step: perturbed(step)(x).detach() for step in range(1, 7)}
    seen: list[tuple[int, int, torch.Tensor | None]] = []
    stop = threading.Event()

    def hammer() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            while not stop.is_set():
                reply = client.post("/predict", json={"inputs": x.tolist()})
                doc = reply.json()
                seen.append((reply.status_code, doc.get("model_step"), doc.get("outputs")))

    try:
        clients = [threading.Thread(target=hammer) for _ in range(4)]
        for thread in clients:
            thread.start()
        for step in range(2, 7):  # keep=1 prunes the folder being served
            time.sleep(0.3)
            save_step(tmp_path, step, perturbed(step), keep=1)
        deadline = time.monotonic() + 30
        while not any(s == 6 for _, s, _ in seen[-4:]) and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        for thread in clients:
            thread.join()
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        stop.set()
        server.close()
    assert {status for status, _, _ in seen} == {200}
    steps = [step for _, step, _ in seen]
    assert steps[-1] == 6 and len(set(steps)) >= 2, sorted(set(steps))
    for _, step, outputs in seen:  # every answer is the model of the step it names
        torch.testing.assert_close(torch.tensor(outputs), expected[step])
    assert _metric(metrics, "paratrain_serve_reloads_total") >= 1


def test_export_writes_safetensors_that_load_back(tmp_path):
    model = perturbed(4)
    save_step(tmp_path / "ckpt", 4, model)
    out = paratrain.serve.export(tmp_path / "ckpt", tmp_path / "model.safetensors")
    state = paratrain.serve.load(out)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    served = paratrain.serve.load(tmp_path / "ckpt" / "step-00000004", model=load_factory(f"{MODELS}:mlp")())
    assert not served.training and torch.equal(served[0].weight, model[0].weight)
    from click.testing import CliRunner

    from paratrain.launch.cli import main

    result = CliRunner().invoke(main, ["export", str(tmp_path / "ckpt"), str(tmp_path / "cli.safetensors")])
    assert result.exit_code == 0 and torch.equal(
        paratrain.serve.load(tmp_path / "cli.safetensors")["0.bias"], model[0].bias
    )
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(main, ["export", str(tmp_path / "empty"), str(tmp_path / "x.safetensors")])
    assert result.exit_code == 1 and "no complete checkpoint in" in result.output
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        paratrain.serve.export(tmp_path / "empty", tmp_path / "x.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        paratrain.serve.load(tmp_path / "bad.safetensors")


def test_the_batcher_groups_by_signature_within_the_limit_and_isolates_failures():
    runs: list[int] = []

    def run(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, str]:
        x = inputs["inputs"]
        runs.append(x.shape[0])
        if (x < 0).any():
            raise ValueError("negative input")
        return x * 2, "tag"

    started, gate = threading.Event(), threading.Event()
    batcher = Batcher(
        lambda inputs: (started.set(), gate.wait(), run(inputs))[2], max_batch=4, batch_wait_s=0.5
    )
    first = batcher.submit({"inputs": torch.ones(1, 5)})  # runs at once, alone; the rest queue meanwhile
    assert started.wait(30)
    futures = [batcher.submit({"inputs": torch.full((1, 2), float(i))}) for i in range(6)]
    odd = batcher.submit({"inputs": torch.ones(1, 3)})  # another signature: its own batch
    bad = batcher.submit({"inputs": -torch.ones(1, 2)})
    gate.set()
    for i, future in enumerate(futures):
        output, tag = future.result(timeout=30)
        assert tag == "tag" and torch.equal(output, torch.full((1, 2), 2.0 * i))
    assert odd.result(timeout=30)[0].shape == (1, 3) and first.result(timeout=30)[0].shape == (1, 5)
    with pytest.raises(ModelInputError, match="negative input"):
        bad.result(timeout=30)
    batcher.close()
    # the first; 4 of the same signature; the other 2 with the bad one, which fails, so each runs
    # alone; the odd one
    assert runs == [1, 4, 3, 1, 1, 1, 1]


def test_a_batch_waits_only_for_as_many_rows_as_recent_batches_had():
    """A lone request runs at once (no wait of 60 s); requests queued while a batch runs form the
    next batch, whose size the one after it then waits for."""
    runs: list[int] = []
    started, gate = threading.Event(), threading.Event()

    def run(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, str]:
        runs.append(inputs["inputs"].shape[0])
        started.set()
        gate.wait()
        return inputs["inputs"] + 1, "tag"

    batcher = Batcher(run, max_batch=8, batch_wait_s=60)
    lone = batcher.submit({"inputs": torch.zeros(1, 2)})
    assert started.wait(30)  # running, not waiting 60 s for others
    queued = [batcher.submit({"inputs": torch.zeros(1, 2)}) for _ in range(3)]
    gate.set()
    assert torch.equal(lone.result(timeout=30)[0], torch.ones(1, 2))
    assert all(torch.equal(f.result(timeout=30)[0], torch.ones(1, 2)) for f in queued)
    waiting = [batcher.submit({"inputs": torch.zeros(1, 2)}) for _ in range(2)]
    time.sleep(0.2)
    assert not any(f.done() for f in waiting)  # 2 rows < the recent batches' 3: still waiting
    last = batcher.submit({"inputs": torch.zeros(1, 2)})
    assert all(f.result(timeout=30)[1] == "tag" for f in [*waiting, last])
    batcher.close()
    assert runs == [1, 3, 3]


def test_a_batch_of_few_rows_runs_on_one_thread_and_a_large_one_on_the_servers_threads():
    threads: list[int] = []

    def run(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, str]:
        threads.append(torch.get_num_threads())
        return inputs["inputs"], "tag"

    before = torch.get_num_threads()
    torch.set_num_threads(3)  # the server's threads (--threads 3)
    try:
        batcher = Batcher(run, max_batch=32, batch_wait_s=0)
        for rows in (1, FEW_ROWS - 1, FEW_ROWS, 1):
            batcher.submit({"inputs": torch.zeros(rows, 2)}).result(timeout=30)
        batcher.close()
    finally:
        torch.set_num_threads(before)
    assert threads == [1, 1, 3, 1]


def test_the_batcher_answers_an_event_loop_in_one_hand_off_per_batch_and_skips_cancelled_requests():
    started, gate = threading.Event(), threading.Event()
    batcher = Batcher(
        lambda inputs: (started.set(), gate.wait(), (inputs["inputs"] + 1, "tag"))[2],
        max_batch=8,
        batch_wait_s=0.2,
    )
    first = batcher.submit({"inputs": torch.zeros(1, 2)})  # runs alone; the four queue meanwhile
    assert started.wait(30)
    hand_offs: list[object] = []

    async def main() -> list:
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(*args: object) -> object:
            hand_offs.append(args[0])
            return call_soon_threadsafe(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        tasks = [
            asyncio.ensure_future(batcher.predict({"inputs": torch.full((1, 2), float(i))})) for i in range(4)
        ]
        await asyncio.sleep(0)  # all four queued, the batch still gathering
        tasks[1].cancel()  # its client went away: the batch runs it, nobody takes the answer
        gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    batcher.close()
    assert isinstance(results[1], asyncio.CancelledError)
    for i in (0, 2, 3):
        output, tag = results[i]
        assert tag == "tag" and torch.equal(output, torch.full((1, 2), i + 1.0))
    assert len(hand_offs) == 1  # the batch's answers in one call onto the loop
    assert first.result(timeout=30)[1] == "tag"


def start_cli(*args: str, timeout_s: float = 240) -> tuple[subprocess.Popen, str]:
    """`paratrain serve ARGS` in a process of its own; returns it and its URL once /healthz answers."""
    port = free_port()
    argv = [
        sys.executable,
        "-c",
        "from paratrain.launch.cli import main; main()",
        "serve",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen([*argv, *args])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(url + "/healthz", timeout=5)
            return proc, url
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"paratrain serve exited with {proc.poll()} or did not answer in time")
            time.sleep(0.2)


@pytest.mark.timeout(360)
def test_a_model_split_across_processes_answers_as_the_whole_model(tmp_path):
    """`paratrain serve --stages 3`: stage i in process i, micro-batches of 4 rows in flight, the
    split balanced on the declared input; batched answers equal the whole model's, and stopping the
    server stops every stage process."""
    model = load_factory(f"{MODELS}:deep")()
    save_step(tmp_path, 5, model)
    x = torch.randn(40, 8)
    with torch.no_grad():
        expected = model(x)
    args = ["--model", f"{MODELS}:deep", "--stages", "3", "--input", "inputs:float32:8", "--micro-batch", "4"]
    proc, url = start_cli(*args, "--batch-wait-ms", "20", str(tmp_path))
    try:
        with httpx.Client(base_url=url, timeout=60) as client, ThreadPoolExecutor(16) as pool:
            health = client.get("/healthz").json()
            assert health["stages"] == 3 and health["model_step"] == 5 and len(health["pids"]) == 3
            replies = list(
                pool.map(
                    lambda i: client.post("/predict", json={"inputs": x[i : i + 2].tolist()}), range(0, 40, 2)
                )
            )
            whole = client.post("/predict", json={"inputs": x.tolist()})  # 10 micro-batches at once
            metrics = client.get("/metrics").text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert all(reply.status_code == 200 for reply in replies), [r.text for r in replies]
    torch.testing.assert_close(torch.cat([torch.tensor(r.json()["outputs"]) for r in replies]), expected)
    torch.testing.assert_close(torch.tensor(whole.json()["outputs"]), expected)
    assert _metric(metrics, "paratrain_serve_batch_rows_sum") == 80
    assert_all_gone(health["pids"])


def test_the_row_cache_is_bounded_and_time_limited():
    import numpy as np

    from paratrain.serve.remote import RowCache

    cache = RowCache(max_rows=3, ttl_s=1.0)
    cache.put(np.array([1, 2, 3]), torch.eye(3), now=0.0)
    found, missing = cache.get(np.array([1, 4]), now=0.5)  # 1 is now the most recently used
    assert list(found) == [0] and torch.equal(found[0], torch.eye(3)[0]) and missing.tolist() == [1]
    cache.put(np.array([4]), torch.ones(1, 3), now=0.5)  # over 3 rows: 2, the least recently used, goes
    assert len(cache) == 3 and cache.get(np.array([2]), now=0.6)[1].tolist() == [0]
    found, missing = cache.get(np.array([1, 3, 4]), now=1.2)  # 1 and 3 were stored at 0.0: expired
    assert list(found) == [2] and missing.tolist() == [0, 1]
    assert len(RowCache(max_rows=0, ttl_s=1.0)) == 0


@pytest.mark.parametrize("factory", ["small_cnn", "views_conv"])
def test_convolutions_run_channels_last_unless_the_model_fails_so(tmp_path, factory):
    """A conv model is served channels-last with the answers of the model as built; one that fails
    channels-last (a .view of a conv's output) on its first batch is made contiguous for good, and a
    bad request after that fails alone without changing the layout."""
    from paratrain.serve.model import ModelHolder

    built = load_factory(f"{MODELS}:{factory}")().eval()
    (tmp_path / "m.safetensors").write_bytes(save_safetensors(built.state_dict()))
    holder = ModelHolder(load_factory(f"{MODELS}:{factory}"), tmp_path / "m.safetensors", reload_interval_s=0)
    model = holder.current.model
    x = torch.randn(5, 2, 6, 6)
    with torch.inference_mode():
        output, _ = holder.run(lambda m: m(x))
        torch.testing.assert_close(output, built(x))
        fails_channels_last = factory == "views_conv"
        assert holder.channels_last is not fails_channels_last
        weight = next(p for p in model.parameters() if p.dim() == 4)
        assert weight.is_contiguous(memory_format=torch.channels_last) is not fails_channels_last
        with pytest.raises(RuntimeError):
            holder.run(lambda m: m(torch.randn(5, 3, 6, 6)))
        assert holder.channels_last is not fails_channels_last


@pytest.mark.parametrize(
    "dtype", ["float32", "float64", "float16", "bfloat16", "int64", "int8", "uint8", "bool"]
)
def test_a_raw_body_decodes_to_its_tensor_in_every_dtype(dtype):
    from paratrain.serve import codec
    from paratrain.serve.api import DTYPES

    x = (torch.arange(24).reshape(2, 3, 4) % 3).to(DTYPES[dtype])
    raw = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
    headers = {"x-dtype": dtype, "x-shape": "2,3,4"}
    got = codec.decode(raw.numpy().tobytes(), codec.RAW, headers, ())["inputs"]
    assert got.dtype == x.dtype and torch.equal(got, x)
    got.add_(1) if dtype != "bool" else got.logical_not_()  # writable: the model may work in place


def test_the_coalescing_transport_joins_the_writes_of_one_turn_and_flushes_on_close():
    from paratrain.serve.http import CoalescingTransport

    class Recorder:
        def __init__(self) -> None:
            self.writes: list[bytes] = []
            self.closed = False

        def write(self, data: bytes) -> None:
            self.writes.append(data)

        def is_closing(self) -> bool:
            return self.closed

        def close(self) -> None:
            self.closed = True

        def get_write_buffer_size(self) -> int:
            return 0

        def get_extra_info(self, name: str) -> str:
            return f"info {name}"

    async def main() -> Recorder:
        inner = Recorder()
        transport = CoalescingTransport(inner)
        transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        transport.write(b"body")
        assert inner.writes == [] and transport.get_write_buffer_size() == 23
        await asyncio.sleep(0)
        assert inner.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        transport.write(b"last")
        transport.close()  # written before the close, not lost
        assert inner.writes[-1] == b"last" and inner.closed
        assert transport.get_extra_info("peername") == "info peername"
        return inner

    assert len(asyncio.run(main()).writes) == 2
