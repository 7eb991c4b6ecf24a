"""Gradient compression: the codecs against the plain reference beside them, error feedback, the
settings' checks, and (with processes) compressed kvstore rounds against a reference computed here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paratrain.compression import CompressionConfig, make_codec, reference
from paratrain.testing import run_job

JOBS = Path(__file__).parent / "jobs"

SIZES = [1, 3, 4, 5, 17, 1000]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("feedback", [True, False])
def test_2bit_matches_the_reference(n, feedback):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    x[: n // 3] = 0.5  # exactly the threshold is sent (>=), as in MXNet
    residual = torch.randn(n, generator=g) * 0.3 if feedback else None
    expected, left = reference.encode_2bit(x.tolist(), None if residual is None else residual.tolist(), 0.5)
    codec = make_codec(CompressionConfig("2bit", threshold=0.5))
    (codes,) = codec.encode(x, residual)
    assert bytes(codes.numpy()) == expected
    if feedback:
        assert torch.allclose(residual, torch.tensor(left), atol=1e-6)
    out = torch.full((n,), 7.0)
    assert codec.decode([codes], out).tolist() == reference.decode_2bit(expected, n, 0.5)
    added = codec.decode([codes], torch.ones(n), add=True)
    assert torch.equal(added, out + 1)


@pytest.mark.parametrize("n", SIZES)
def test_topk_matches_the_reference(n):
    g = torch.Generator().manual_seed(n)
    x, residual = torch.randn(n, generator=g), torch.randn(n, generator=g)
    codec = make_codec(CompressionConfig("topk", ratio=0.1))
    k = max(1, -(-n // 10))
    sent, left = reference.encode_topk(x.tolist(), residual.tolist(), k)
    values, index = codec.encode(x, residual)
    assert dict(zip(index.tolist(), values.tolist(), strict=True)) == pytest.approx(sent)
    assert torch.allclose(residual, torch.tensor(left))
    assert torch.allclose(
        codec.decode([values, index], torch.empty(n)), torch.tensor(reference.decode_topk(sent, n))
    )


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_casts_keep_what_rounding_lost(kind):
    x, residual = torch.randn(100) * 1e3, torch.zeros(100)
    codec = make_codec(CompressionConfig(kind))
    (sent,) = codec.encode(x, residual)
    assert sent.dtype == (torch.float16 if kind == "fp16" else torch.bfloat16)
    assert torch.allclose(codec.decode([sent], torch.empty(100)) + residual, x)


@pytest.mark.parametrize("kind", ["2bit", "topk", "fp16"])
def test_error_feedback_sends_everything_in_the_end(kind):
    """Over many rounds what arrives is what was pushed, less what the residual holds now: nothing
    is lost, only late. Without error feedback small values are never sent."""
    codec = make_codec(CompressionConfig(kind, threshold=0.05, ratio=0.05))
    g = torch.Generator().manual_seed(0)
    pushed, arrived, residual = torch.zeros(400), torch.zeros(400), torch.zeros(400)
    lost = torch.zeros(400)
    for _ in range(50):
        x = torch.randn(400, generator=g) * 0.01
        pushed += x
        codec.decode(codec.encode(x, residual), arrived, add=True)
        codec.decode(codec.encode(x), lost, add=True)
    assert torch.allclose(arrived + residual, pushed, atol=1e-4)
    if kind != "fp16":
        assert (lost - pushed).abs().sum() > 2 * (arrived - pushed).abs().sum()


def test_payload_sizes_and_bad_payloads():
    two, top = make_codec(CompressionConfig("2bit")), make_codec(CompressionConfig("topk", ratio=0.01))
    x = torch.randn(1 << 16)
    assert sum(t.numel() * t.element_size() for t in two.encode(x)) == two.wire_bytes(x.numel()) == 1 << 14
    assert sum(t.numel() * t.element_size() for t in top.encode(x)) == top.wire_bytes(x.numel())
    with pytest.raises(ValueError, match="2bit payload"):
        two.decode([torch.zeros(3, dtype=torch.uint8)], torch.empty(100))
    with pytest.raises(ValueError, match="out of range"):
        top.decode([torch.ones(1), torch.tensor([100], dtype=torch.int32)], torch.empty(100))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"type": "3bit"}, "type='3bit' is not one of"),
        ({"type": "2bit", "threshold": 0}, "threshold=0 must be"),
        ({"type": "topk", "ratio": 1.5}, "ratio=1.5 must be"),
        ({"type": "powersgd", "rank": 0}, "rank=0 must be"),
        ({"type": "2bit", "treshold": 0.5}, "setting 'treshold' is not one of"),
        ({"threshold": 0.5}, "has no 'type'"),
    ],
)
def test_bad_settings_name_field_and_value(spec, message):
    with pytest.raises(ValueError, match=message):
        CompressionConfig.parse(spec)


def test_parse_forms():
    assert CompressionConfig.parse({"type": "2bit", "threshold": 0.5}) == CompressionConfig(
        "2bit", threshold=0.5
    )
    assert CompressionConfig.parse("topk") == CompressionConfig("topk")
    assert CompressionConfig.parse({"type": "none"}) is None and CompressionConfig.parse(None) is None
    with pytest.raises(ValueError, match="needs architecture='collective'"):
        make_codec(CompressionConfig("powersgd"))


# -- real jobs --------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_compressed_rounds_and_ddp_hooks_match_the_reference(tmp_path):
    """One job, 2 workers, 2 servers (one key sliced across both): kvstore rounds with 2bit, topk
    and fp16 both ways without an optimizer, error feedback on both sides kept across save_state /
    load_state, SGD on the servers with compressed pushes and full-precision weights; then DDP's
    hooks among the workers: 2bit averaged exactly as the reference says, with error feedback across
    DDP's bucket rebuild and through a state_dict; topk, fp16 and powersgd keep every rank equal."""
    outcome = run_job(JOBS / "kv_compressed.py", workers=2, servers=2, args=(str(tmp_path),), timeout_s=200)
    for rank in range(2):
        lines = outcome.lines("worker", rank, "stdout")
        assert lines[-2:] == ["compressed rounds match the reference", "compressed DDP matches the reference"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "servers.compression-worker-0.pt",
        "servers.compression-worker-1.pt",
        "servers.pt",
    ]


# -- top-k sends the optimizer's update (train/ps.py), against a plain reference, no processes ----
class _OneWorkerKV:
    """A kvstore of one worker and one server in this process: a push goes through the worker's real
    encoding (top-k with error feedback) and the codec's decoding; the server averages over its one
    worker and applies SGD (the only optimizer it may be given here) or keeps the mean."""

    def __init__(self) -> None:
        self.values, self.server_optimizer, self.pushed = {}, None, []

    def set_gradient_compression(self, config):
        from paratrain.kvstore.compressed import WorkerCompression

        self.compression = WorkerCompression(config)

    def init(self, keys, values):
        self.values = {k: v.clone().reshape(-1) for k, v in zip(keys, values, strict=True)}

    def set_optimizer(self, optimizer, **hyper):
        self.server_optimizer = (optimizer, hyper)

    def pull(self, keys, out):
        for k, o in zip(keys, out, strict=True):
            o.copy_(self.values[k].reshape(o.shape))

    def pushpull_async(self, keys, values, out):
        self.pushed.append([v.clone() for v in values])
        for k, v, o in zip(keys, values, out, strict=True):
            flat = v.reshape(-1)
            payload = self.compression.encode(k, 0, flat, flat.numel())
            sent = (
                flat.clone()
                if len(payload) == 1
                else self.compression.codec.decode(payload, torch.empty_like(flat))
            )
            if self.server_optimizer is None:
                self.values[k] = sent
            else:
                assert self.server_optimizer == (torch.optim.SGD, {"lr": 1.0})
                self.values[k] = self.values[k] - sent
            o.copy_(self.values[k].reshape(o.shape))
        return self

    def wait(self):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("update_on", ["server", "worker"])
def test_topk_sends_the_optimizers_update_with_error_feedback(monkeypatch, update_on):
    """Top-k under ps: the worker steps Adam on its own gradient and pushes the update (before -
    after); the weights then move by exactly what top-k with error feedback let through
    (reference.encode_topk on the updates), whether the servers apply it or the worker does."""
    from torch import nn

    from paratrain.train import ps
    from paratrain.train.strategy import Strategy

    kv = _OneWorkerKV()
    monkeypatch.setattr(ps.kvstore, "create", lambda config, ctx: kv)
    torch.manual_seed(0)
    model, reference_model = nn.Linear(64, 32), nn.Linear(64, 32)  # 2048 weights: compressed
    reference_model.load_state_dict(model.state_dict())
    # eps=1: Adam's first updates are not all +-lr (top-k would pick among ties)
    optimizer, reference_optimizer = (
        torch.optim.Adam(m.parameters(), lr=0.01, eps=1.0) for m in (model, reference_model)
    )
    strategy = Strategy(architecture="ps", update_on=update_on, compression="topk", compression_ratio=0.05)
    engine = ps.PSEngine(model, optimizer, strategy, ctx=None)
    assert engine.per_worker_optimizer and (kv.server_optimizer is not None) == (update_on == "server")
    residual = [0.0] * 2048
    for step in range(6):
        x, y = torch.randn(16, 64), torch.randn(16, 32)
        for m in (model, reference_model):
            nn.functional.mse_loss(m(x), y).backward()
        engine.step(optimizer, optimizer.step)
        optimizer.zero_grad()
        with torch.no_grad():  # the reference: Adam's update, its top-k with error feedback, applied
            before = [p.clone() for p in reference_model.parameters()]
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            weight, bias = reference_model.parameters()
            update = (before[0] - weight).reshape(-1)
            assert torch.allclose(kv.pushed[-1][0].reshape(-1), update, atol=1e-7)
            sent, residual = reference.encode_topk(update.tolist(), residual, 103)
            weight.copy_(before[0] - torch.tensor(reference.decode_topk(sent, 2048)).reshape(32, 64))
            bias.copy_(before[1] - (before[1] - bias))  # 32 elements: sent whole
        for p, q in zip(model.parameters(), reference_model.parameters(), strict=True):
            assert torch.allclose(p, q, atol=1e-6), f"step {step}"


def _breast_cancer_replay(
    config: CompressionConfig | None, epochs: int = 8, workers: int = 2
) -> tuple[float, float]:
    """(test accuracy, test loss) of an MLP on scikit-learn's breast-cancer data (the model a user
    tried), 2 workers' gradients averaged as dist_sync does, each encoded with `config` and its
    error feedback where given: the compression layer's own arithmetic, in one process."""
    from sklearn.datasets import load_breast_cancer
    from torch import nn

    x, y = load_breast_cancer(return_X_y=True)
    x = torch.tensor((x - x.mean(0)) / x.std(0), dtype=torch.float32)
    y = torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = order[:400], order[400:]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    codec = make_codec(config) if config is not None else None
    residuals = [[torch.zeros(p.numel()) for p in params] for _ in range(workers)]
    batch = 16
    for epoch in range(epochs):
        shuffled = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(epoch))]
        for start in range(0, len(train) - batch * workers + 1, batch * workers):
            sums = [torch.zeros(p.numel()) for p in params]
            for w in range(workers):
                rows = shuffled[start + batch * w : start + batch * (w + 1)]
                model.zero_grad()
                nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
                for p, total, residual in zip(params, sums, residuals[w], strict=True):
                    share = p.grad.flatten() / workers  # the threshold applies to this
                    if codec is None or share.numel() < config.min_elements:
                        total += share
                    else:
                        codec.decode(codec.encode(share, residual), total, add=True)
            for p, total in zip(params, sums, strict=True):
                p.grad = total.view_as(p)
            optimizer.step()
    with torch.no_grad():
        logits = model(x[test])
    return (logits.argmax(1) == y[test]).float().mean().item(), nn.functional.cross_entropy(
        logits, y[test]
    ).item()


def test_2bit_at_its_default_threshold_trains_as_well_as_uncompressed():
    """MXNet's 0.5 is far above this model's gradient elements (about 1e-3): an element waits for
    hundreds of steps, then moves by 0.5 (4 points and 4x the test loss lost here)."""
    plain_accuracy, plain_loss = _breast_cancer_replay(None)
    accuracy, loss = _breast_cancer_replay(CompressionConfig("2bit"))
    assert accuracy >= plain_accuracy - 0.01 and loss <= plain_loss + 0.03, (
        accuracy,
        loss,
        plain_accuracy,
        plain_loss,
    )
