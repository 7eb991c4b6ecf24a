"""Metrics loggers (JSON lines, TensorBoard, fan-out, null) and the progress display, in one process."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from paratrain.metrics import (
    JsonLinesMetrics,
    MetricsLogger,
    MultiMetrics,
    NullMetrics,
    Progress,
    TensorBoardMetrics,
    open_metrics,
)

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class TTYStream(io.StringIO):
    def isatty(self) -> bool:
        return True


class Recorder(MetricsLogger):
    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []
        self.closed = 0

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.calls.append((step, dict(scalars)))

    def close(self) -> None:
        self.closed += 1


def _read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_jsonl_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "m.jsonl"
    clock = FakeClock(1.5e9)
    with JsonLinesMetrics(path, clock=clock) as metrics:
        metrics.log(0, {"loss": 2.5, "lr": 0.1})
        clock.t += 1
        metrics.log(10, {"loss": torch.tensor(1.25), "samples/s": 300})
        metrics.log(20, {"loss": math.nan, "grad_norm": math.inf})
        assert len(path.read_text().splitlines()) == 3  # flushed per line, before close
    with JsonLinesMetrics(path) as metrics:  # appends
        metrics.log(30, {"loss": 1.0})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[0] == {"step": 0, "time": 1.5e9, "loss": 2.5, "lr": 0.1}
    assert records[1] == {"step": 10, "time": 1.5e9 + 1, "loss": 1.25, "samples/s": 300.0}
    assert records[2] == {"step": 20, "time": 1.5e9 + 1, "loss": None, "grad_norm": None}
    assert records[3]["step"] == 30 and records[3]["loss"] == 1.0
    assert list(records[1]) == ["step", "time", "loss", "samples/s"]


def test_jsonl_rejects_bad_input(tmp_path: Path) -> None:
    with JsonLinesMetrics(tmp_path / "m.jsonl") as metrics:
        with pytest.raises(ValueError, match="reserved"):
            metrics.log(1, {"time": 1.0})
        with pytest.raises(TypeError, match="'loss'"):
            metrics.log(1, {"loss": "high"})
        with pytest.raises(ValueError, match="step=-1"):
            metrics.log(-1, {"loss": 1.0})
    assert (tmp_path / "m.jsonl").read_text() == ""


def test_tensorboard_scalars_read_back(tmp_path: Path) -> None:
    with TensorBoardMetrics(tmp_path / "tb") as metrics:
        for step in range(3):
            metrics.log(step * 10, {"loss": 1.0 / (step + 1), "train/lr": 0.5})
    scalars = _read_scalars(tmp_path / "tb")
    assert set(scalars) == {"loss", "train/lr"}
    assert [s for s, _ in scalars["loss"]] == [0, 10, 20]
    assert [v for _, v in scalars["loss"]] == pytest.approx([1.0, 0.5, 1.0 / 3])
    assert [v for _, v in scalars["train/lr"]] == pytest.approx([0.5] * 3)


def test_multi_metrics_fans_out_and_closes_all() -> None:
    a, b = Recorder(), Recorder()
    with MultiMetrics([a, b]) as metrics:
        metrics.log(3, {"loss": 0.5})
    assert a.calls == b.calls == [(3, {"loss": 0.5})]
    assert a.closed == b.closed == 1


def test_open_metrics(tmp_path: Path) -> None:
    assert isinstance(open_metrics(None, rank=0), NullMetrics)
    NullMetrics().log(1, {"loss": 1.0})
    assert isinstance(open_metrics(tmp_path, rank=0, tensorboard=False, jsonl=False), NullMetrics)
    with open_metrics(tmp_path, rank=2) as metrics:
        assert isinstance(metrics, MultiMetrics)
        metrics.log(5, {"loss": 0.25})
    assert json.loads((tmp_path / "metrics-rank2.jsonl").read_text())["loss"] == 0.25
    assert _read_scalars(tmp_path / "tb" / "rank2")["loss"] == [(5, 0.25)]
    only = open_metrics(tmp_path, rank=1, tensorboard=False)
    assert isinstance(only, JsonLinesMetrics)
    only.close()
    with pytest.raises(ValueError, match="rank=-1"):
        open_metrics(tmp_path, rank=-1)


def test_progress_plain_lines() -> None:
    stream, clock = io.StringIO(), FakeClock()
    with Progress(300, desc="train", every_s=2.0, stream=stream, initial=100, clock=clock) as progress:
        for _ in range(4):  # one update per second: a line at the first, then every 2 s
            clock.t += 1.0
            progress.update(steps=5, samples=320, loss=0.23456789, acc=0.5)
        clock.t += 1.0
    assert stream.getvalue().splitlines() == [
        "train step 105/300 loss 0.2346 acc 0.5 samples/s 320.0",
        "train step 115/300 loss 0.2346 acc 0.5 samples/s 320.0",
        "train done step 120/300 loss 0.2346 acc 0.5 samples/s 256.0 time 5.0s",
    ]


def test_progress_shows_the_latest_peak_memory() -> None:
    stream, clock = io.StringIO(), FakeClock()
    with Progress(desc="train", every_s=2.0, stream=stream, clock=clock) as progress:
        clock.t += 1.0
        progress.update(steps=1, loss=0.5, memory_bytes=3 * 2**29)
        clock.t += 2.0
        progress.update(steps=1, memory_bytes=900 * 2**20)
    assert stream.getvalue().splitlines() == [
        "train step 1 loss 0.5 peak mem 1.5 GiB",
        "train step 2 loss 0.5 peak mem 900 MiB",
        "train done step 2 loss 0.5 peak mem 900 MiB time 3.0s",
    ]


def test_progress_without_total_or_samples() -> None:
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress(stream=stream, every_s=0, clock=clock)
    progress.update(loss=1.0)
    progress.update(loss=2.0)
    progress.close()
    progress.close()
    assert stream.getvalue().splitlines() == [
        "train step 1 loss 1",
        "train step 2 loss 2",
        "train done step 2 loss 2 time 0.0s",
    ]


def test_samples_per_s_uses_the_recent_window() -> None:
    clock = FakeClock(0.0)
    progress = Progress(enabled=False, window_s=5.0, clock=clock)
    assert progress.samples_per_s is None
    for _ in range(10):  # 100 samples/s for 10 s
        clock.t += 1.0
        progress.update(samples=100)
    assert progress.samples_per_s == pytest.approx(100.0)
    for _ in range(5):  # then 400 samples/s for 5 s
        clock.t += 1.0
        progress.update(samples=400)
    assert progress.samples_per_s == pytest.approx(400.0)
    assert progress.overall_samples_per_s == pytest.approx((1000 + 2000) / 15)
    clock.t += 0.5
    progress.update(samples=0)  # the window starts at the newest update at least 5 s old: t=10
    assert progress.samples_per_s == pytest.approx(5 * 400 / 5.5)
    clock.t += 0.5
    progress.update(samples=0)  # now t=11
    assert progress.samples_per_s == pytest.approx(4 * 400 / 5.0)


def test_disabled_progress_writes_nothing() -> None:
    stream = TTYStream()
    with Progress(10, enabled=False, stream=stream, every_s=0) as progress:
        progress.update(samples=5, loss=1.0)
    assert stream.getvalue() == ""
    assert progress.step == 1 and progress.samples == 5


def test_progress_tty_uses_a_bar() -> None:
    stream, clock = TTYStream(), FakeClock()
    with Progress(10, stream=stream, clock=clock) as progress:
        clock.t += 2.0
        progress.update(steps=10, samples=64, loss=0.5)
    text = stream.getvalue()
    assert "\r" in text and "10/10" in text
    assert "loss=0.5" in text and "samples/s=32.0" in text


def test_progress_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="every_s=-1"):
        Progress(every_s=-1)
    with pytest.raises(ValueError, match="total=-3"):
        Progress(-3)
    with pytest.raises(ValueError, match="samples=-1"):
        Progress(enabled=False).update(samples=-1)
