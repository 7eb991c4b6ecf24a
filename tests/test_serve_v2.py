"""The Open Inference Protocol (KServe v2 / Triton REST) over real HTTP, beside /predict: the request
bodies a KServe or Triton client sends (JSON, flat and nested data, and Triton's binary tensor
extension) get the model's answers; metadata, health and readiness routes; errors as the protocol
says (4xx with {"error": ...}), the server going on."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from test_serve import MODELS, perturbed, save_step

from paratrain.serve.api import InputSpec, ServeConfig
from paratrain.serve.http import HttpServer
from paratrain.serve.model import load_factory
from paratrain.serve.service import model_app

pytestmark = pytest.mark.timeout(120)

STEP = 7
NAME = "digits-mlp"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("v2")
    save_step(root, STEP, perturbed(STEP))
    config = ServeConfig(inputs=[InputSpec("inputs", "float32", (4,))], model_name=NAME, max_request_rows=8)
    server = HttpServer(model_app(load_factory(f"{MODELS}:mlp"), root, config)).start()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
    server.close()


def expected(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return perturbed(STEP)(x)


def test_a_kserve_json_request_gets_the_models_answer(served: httpx.Client) -> None:
    x = torch.randn(3, 4)
    request = {  # as KServe's InferRequest.to_rest() and tritonclient's JSON form write it
        "id": "req-1",
        "inputs": [{"name": "input-0", "shape": [3, 4], "datatype": "FP32", "data": x.flatten().tolist()}],
        "outputs": [{"name": "outputs"}],
    }
    reply = served.post(f"/v2/models/{NAME}/infer", json=request)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert (answer["model_name"], answer["model_version"], answer["id"]) == (NAME, str(STEP), "req-1")
    (out,) = answer["outputs"]
    assert (out["name"], out["shape"], out["datatype"]) == ("outputs", [3, 3], "FP32")
    torch.testing.assert_close(torch.tensor(out["data"]).reshape(3, 3), expected(x))

    nested = {"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": x.tolist()}]}
    reply = served.post(f"/v2/models/{NAME}/versions/{STEP}/infer", json=nested)
    assert reply.status_code == 200, reply.text
    torch.testing.assert_close(torch.tensor(reply.json()["outputs"][0]["data"]).reshape(3, 3), expected(x))


def test_a_triton_binary_request_gets_a_binary_answer(served: httpx.Client) -> None:
    x = torch.randn(2, 4)
    raw = x.numpy().tobytes()
    head = {
        "inputs": [
            {
                "name": "INPUT0",
                "shape": [2, 4],
                "datatype": "FP32",
                "parameters": {"binary_data_size": len(raw)},
            }
        ],
        "outputs": [{"name": "outputs", "parameters": {"binary_data": True}}],
    }
    text = json.dumps(head).encode()
    reply = served.post(
        f"/v2/models/{NAME}/infer",
        content=text + raw,
        headers={
            "Inference-Header-Content-Length": str(len(text)),
            "Content-Type": "application/octet-stream",
        },
    )
    assert reply.status_code == 200, reply.text
    length = int(reply.headers["inference-header-content-length"])
    answer = json.loads(reply.content[:length])
    (out,) = answer["outputs"]
    assert out["parameters"]["binary_data_size"] == 2 * 3 * 4 and out["shape"] == [2, 3]
    got = torch.frombuffer(bytearray(reply.content[length:]), dtype=torch.float32).reshape(2, 3)
    torch.testing.assert_close(got, expected(x))


def test_metadata_health_and_readiness(served: httpx.Client) -> None:
    assert served.get("/v2/health/live").json() == {"live": True}
    assert served.get("/v2/health/ready").json() == {"ready": True}
    assert served.get(f"/v2/models/{NAME}/ready").json() == {"name": NAME, "ready": True}
    assert served.get(f"/v2/models/{NAME}/versions/{STEP}/ready").status_code == 200
    assert "binary_tensor_data" in served.get("/v2").json()["extensions"]
    meta = served.get(f"/v2/models/{NAME}").json()
    assert meta["name"] == NAME and meta["versions"] == [str(STEP)]
    assert meta["inputs"] == [{"name": "inputs", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["outputs"] == [{"name": "outputs", "datatype": "FP32", "shape": [-1, 3]}]


def _infer(shape: list, datatype: str = "FP32", data: object = None, **more: object) -> dict:
    values = [0.5] * (shape[0] * shape[1]) if data is None else data
    return {"inputs": [{"name": "x", "shape": shape, "datatype": datatype, "data": values}], **more}


BAD = [  # (path, body, status, words of the error)
    ("/v2/models/other/infer", _infer([1, 4]), 404, "serves 'digits-mlp'"),
    (f"/v2/models/{NAME}/versions/3/infer", _infer([1, 4]), 404, "version '3' is not served"),
    (f"/v2/models/{NAME}/infer", _infer([1, 3]), 422, "has shape [1, 3]; the model takes [rows, 4]"),
    (f"/v2/models/{NAME}/infer", _infer([2, 4], data=[1.0] * 5), 400, "5 values; shape [2, 4] needs 8"),
    (f"/v2/models/{NAME}/infer", _infer([1, 1], "BYTES", ["a"]), 422, "datatype='BYTES'"),
    (f"/v2/models/{NAME}/infer", _infer([9, 4]), 413, "9 rows; the limit is 8"),
    (f"/v2/models/{NAME}/infer", _infer([1, 4], "FP64"), 422, "dtype float64; the model takes float32"),
    (f"/v2/models/{NAME}/infer", _infer([1, 4], outputs=[{"name": "y"}]), 400, "output 'y' is not one"),
    (f"/v2/models/{NAME}/infer", {"inputs": []}, 400, 'non-empty list "inputs"'),
    (
        f"/v2/models/{NAME}/infer",
        {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32"}]},
        400,
        "neither data",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "words"), BAD, ids=[b[3] for b in BAD])
def test_bad_requests_get_the_protocols_errors(served: httpx.Client, path, body, status, words) -> None:
    reply = served.post(path, json=body)
    assert reply.status_code == status, reply.text
    assert words in reply.json()["error"]
    assert served.post(f"/v2/models/{NAME}/infer", json=_infer([1, 4])).status_code == 200


def test_a_bad_model_name_is_refused_at_configuration() -> None:
    with pytest.raises(ValueError, match="model_name='a/b'"):
        ServeConfig(model_name="a/b")
