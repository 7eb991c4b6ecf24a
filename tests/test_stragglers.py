"""Straggler detection as data (cluster/stragglers.py): heartbeat reports in, events out."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch

from paratrain.cluster.config import JobConfig
from paratrain.cluster.scheduler import STRAGGLERS_FILE
from paratrain.cluster.stragglers import PHASES, StragglerConfig, StragglerDetector
from paratrain.data.loader import ShardedLoader
from paratrain.testing import run_job

JOBS = Path(__file__).parent / "jobs"

NORMAL = {"data": 0.002, "compute": 0.020, "communication": 0.003, "waiting": 0.001}


def _run(
    slowdown: dict[int, dict[str, float]],
    *,
    beats: int,
    workers: int = 4,
    from_beat: int = 0,
    steps_per_beat: int = 5,
    noise: float = 0.0,
    until_beat: int | None = None,
    seed: int = 0,
):
    """Feed `beats` heartbeats of `workers` workers; from `from_beat` (to `until_beat`), worker r's
    phase times per step get slowdown[r] added. Returns [(beat, event), ...]."""
    rng = random.Random(seed)
    detector = StragglerDetector()
    totals = {r: dict.fromkeys(PHASES, 0.0) for r in range(workers)}
    events = []
    for beat in range(1, beats + 1):
        for rank in range(workers):
            extra = (
                slowdown.get(rank, {})
                if from_beat <= beat and (until_beat is None or beat < until_beat)
                else {}
            )
            for phase in PHASES:
                per_step = NORMAL[phase] * (1 + rng.uniform(-noise, noise)) + extra.get(phase, 0.0)
                totals[rank][phase] += per_step * steps_per_beat
            report = {"steps": beat * steps_per_beat, "seconds": dict(totals[rank])}
            event = detector.observe(rank, f"host{rank}", report)
            if event is not None:
                events.append((beat, event))
    return events


@pytest.mark.parametrize(
    ("phase", "extra"),
    [("compute", {"compute": 0.04}), ("data", {"data": 0.04})],
)
def test_a_slowed_worker_is_named_with_its_phase_within_ten_steps(phase, extra):
    events = _run({2: extra}, beats=20, from_beat=5, noise=0.2)
    assert len(events) == 1, events
    beat, event = events[0]
    assert (event.rank, event.host, event.slow, event.phase) == (2, "host2", True, phase)
    assert (beat - 5 + 1) * 5 <= 10  # reported by the 10th slow step (5 steps a heartbeat)
    assert event.ratio > 2
    assert "worker 2 (host host2) is a straggler" in event.describe() and phase in event.describe()


def test_reported_again_once_it_recovers():
    events = _run({1: {"compute": 0.05}}, beats=20, from_beat=3, until_beat=10)
    assert [(e.rank, e.slow) for _, e in events] == [(1, True), (1, False)]
    assert events[1][0] == 10
    assert "no longer a straggler" in events[1][1].describe()


@pytest.mark.parametrize("seed", range(5))
def test_no_false_alarm_on_noisy_normal_steps(seed):
    # Every phase +-25 % at random on every heartbeat, 200 heartbeats of 4 workers.
    assert _run({}, beats=200, noise=0.25, seed=seed) == []


def test_waiting_for_a_straggler_is_not_slowness():
    # In a sync round the fast workers wait for the slow one: their waiting grows, not their own time.
    slow = {0: {"compute": 0.05}} | {r: {"waiting": 0.05} for r in (1, 2, 3)}
    events = _run(slow, beats=10, from_beat=2)
    assert [(e.rank, e.phase) for _, e in events] == [(0, "compute")]


def test_a_jittery_communication_is_not_slowness():
    assert _run({0: {"communication": 0.04}}, beats=10, from_beat=2) == []


def test_twice_as_slow_by_a_millisecond_is_not_reported():
    detector = StragglerDetector()
    events = []
    for beat in range(1, 30):
        for rank, per_step in ((0, 0.001), (1, 0.001), (2, 0.002)):
            report = {"steps": beat * 10, "seconds": {"compute": beat * 10 * per_step}}
            events.append(detector.observe(rank, "h", report))
    assert events == [None] * len(events)
    assert detector.ratios()[2] == pytest.approx(2.0)


def test_one_pause_inside_one_heartbeat_is_not_reported():
    # 20 steps in that heartbeat's interval, all slowed on average: still one heartbeat only.
    assert _run({3: {"compute": 0.5}}, beats=10, from_beat=4, until_beat=5, steps_per_beat=20) == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("ratio", 1.0), ("ratio", "2"), ("steps", 0), ("steps", 2.5), ("steps", True), ("min_excess_s", -1)],
)
def test_config_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"StragglerConfig\.{field}={value!r}"):
        StragglerConfig(**{field: value})


def test_the_loader_measures_the_wait_for_batches():
    class Slow(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> torch.Tensor:
            time.sleep(0.01)
            return torch.tensor([float(i)])

    loader = ShardedLoader(Slow(), batch_size=4, num_replicas=1, rank=0)
    batches = list(loader)
    assert len(batches) == 2
    assert loader.take_wait_s() >= 8 * 0.01  # at least the dataset's sleeps: a bound, not a speed
    assert loader.take_wait_s() == 0.0


@pytest.mark.parametrize(("strategy", "servers"), [("dist_sync", 1), ("collective", 0)])
def test_a_worker_slowed_in_its_forward_is_named_with_phase_compute(tmp_path, strategy, servers):
    # 3 workers: worker 1's forward takes 55 ms instead of 5 ms from step 30 to step 110. Under
    # collective (DDP) every rank's step takes as long; the others' wait in the all-reduce is theirs.
    outcome = run_job(
        JOBS / "slow_worker.py",
        workers=3,
        servers=servers,
        args=("1", "30", "110", "200", strategy),
        env={"PARATRAIN_LOG_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"},
        timeout_s=240,
    )
    said = [line for line in outcome.lines("scheduler", 0) if "straggler" in line]
    assert len(said) == 2, said
    assert "worker 1 (host" in said[0] and "is a straggler" in said[0] and "phase compute grew" in said[0]
    assert "worker 1 (host" in said[1] and "is no longer a straggler" in said[1]
    events = [json.loads(line) for line in (tmp_path / STRAGGLERS_FILE).read_text().splitlines()]
    assert [(e["rank"], e["slow"], e["phase"]) for e in events][:1] == [(1, True, "compute")]
    assert [(e["rank"], e["slow"]) for e in events] == [(1, True), (1, False)]
    # Named once 10 slow steps were counted over two heartbeats at least (each covers a few steps).
    assert 30 < events[0]["step"] <= 30 + 25
    assert events[1]["step"] > 110


def test_job_config_takes_a_straggler_config():
    assert JobConfig(stragglers=StragglerConfig(ratio=2.0, steps=5)).as_dict()["stragglers.ratio"] == 2.0
    with pytest.raises(TypeError, match=r"JobConfig\.stragglers=\{'ratio': 2\}"):
        JobConfig(stragglers={"ratio": 2})


def test_ddps_wait_after_its_last_bucket_is_waiting_not_compute():
    # What the comm hook notes (train/observe.py): the last bucket went to all-reduce, and backward
    # then blocked on it (for the slowest rank's gradients). That time is waiting, not compute.
    from types import SimpleNamespace

    from paratrain.train.observe import StepObserver

    observer = StepObserver(SimpleNamespace(rank=0), strategy=None)
    before = dict(observer.telemetry.seconds)
    with observer.backward():
        time.sleep(0.01)  # the backward's own work
        observer._all_reduce.launched = time.perf_counter()
        time.sleep(0.05)  # blocked on the all-reduce
    observer.step_done(1, 0.1, engine=SimpleNamespace())
    spent = {phase: observer.telemetry.seconds[phase] - before[phase] for phase in PHASES}
    assert spent["waiting"] >= 0.05 and spent["compute"] >= 0.01
    with observer.backward():  # a backward without a bucket sent (no_sync micro-steps): no wait
        pass
    observer.step_done(1, 0.1, engine=SimpleNamespace())
    assert observer.telemetry.seconds["waiting"] - before["waiting"] == spent["waiting"]
