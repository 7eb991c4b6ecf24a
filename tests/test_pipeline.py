"""Model parallelism: schedules and splits as data, in-process model parallel, and pipelines over real
processes compared with single-process training of the whole model."""

from __future__ import annotations

import importlib.util
import itertools
import random
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from paratrain.pipeline import (
    Action,
    MeshLayout,
    PipelineConfig,
    StepStats,
    balance,
    build_schedule,
    check_schedule,
    format_schedule,
    gpipe,
    ideal_bubble,
    one_f_one_b,
    p2p,
    peak_in_flight,
    pipeline_for,
    place_on_devices,
    simulate,
    split,
    split_model,
)
from paratrain.pipeline.stage import split_micro_batches
from paratrain.testing import run_job

JOBS = Path(__file__).parent / "jobs"
F, B = "F", "B"


def _load_job(name: str):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(name, JOBS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: the job runs under __main__
    return module


parity = _load_job("pipeline_parity")


@pytest.fixture(autouse=True)
def one_thread():  # noqa: ANN201
    """Intra-op threads spin when the cores are shared: one thread keeps in-process work steady."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- schedules, plain data ----------------------------------------------------------------------------
def _actions(text: str) -> list[Action]:
    return [Action(a[0], int(a[1:])) for a in text.split()]


def test_schedules_list_the_documented_orders():
    assert gpipe(2, 3) == [_actions("F0 F1 F2 B0 B1 B2")] * 2
    assert one_f_one_b(2, 3) == [_actions("F0 F1 B0 F2 B1 B2"), _actions("F0 B0 F1 B1 F2 B2")]
    assert one_f_one_b(4, 2)[0] == _actions("F0 F1 B0 B1")  # fewer micro-batches than stages
    assert format_schedule(one_f_one_b(2, 2)) == "stage 0: F0 F1 B0 B1\nstage 1: F0 B0 F1 B1"


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_every_schedule_runs_each_forward_before_its_backward_and_bounds_what_is_in_flight(name):
    for p, m in itertools.product(range(1, 6), range(1, 10)):
        schedule = build_schedule(name, p, m)
        assert len(schedule) == p
        for stage, actions in enumerate(schedule):
            assert sorted(map(str, actions)) == sorted(
                [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
            )
            for i in range(m):
                assert actions.index(Action(F, i)) < actions.index(Action(B, i)), (p, m, stage, i)
            peak = peak_in_flight(actions)
            if name == "1f1b":
                assert peak == min(p - stage, m) <= p
            else:
                assert peak == m
        # With equal stages both schedules idle each stage (p - 1) / (m + p - 1) of the time.
        timeline = simulate(schedule, forward_s=1.0, backward_s=2.0)
        for stage in range(p):
            assert timeline.bubble(stage) == pytest.approx(ideal_bubble(p, m))


def test_check_schedule_rejects_wrong_orders_and_deadlocks():
    with pytest.raises(ValueError, match="runs B0 before F0"):
        check_schedule([_actions("B0 F0")], 1)
    with pytest.raises(ValueError, match="once each"):
        check_schedule([_actions("F0 B0 F0")], 1)
    with pytest.raises(ValueError, match="different micro-batch orders"):
        check_schedule([_actions("F0 F1 B0 B1"), _actions("F1 F0 B0 B1")], 2)
    with pytest.raises(ValueError, match="deadlocks"):  # stage 0 waits for B0, stage 1 for F1
        check_schedule([_actions("F0 B0 F1 B1"), _actions("F0 F1 B0 B1")], 2)
    with pytest.raises(ValueError, match="not one of"):
        build_schedule("interleaved", 2, 2)


def test_ideal_bubble_and_step_stats():
    assert ideal_bubble(1, 8) == 0.0
    assert ideal_bubble(4, 4) == pytest.approx(3 / 7)
    assert StepStats(wall_s=2.0, busy_s=0.5, in_flight_peak=2).bubble_fraction == pytest.approx(0.75)
    assert StepStats(wall_s=0.0, busy_s=0.0, in_flight_peak=0).bubble_fraction == 0.0


# -- splitting ----------------------------------------------------------------------------------------
def test_balance_minimises_the_slowest_stage():
    assert balance([1, 1, 1, 1], 2) == (2,)
    assert balance([4, 1, 1, 1, 1], 2) == (1,)
    assert balance([1, 2, 3, 4, 5], 3) == (3, 4)
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        stages = rng.randint(1, n)
        times = [rng.uniform(0.1, 5.0) for _ in range(n)]
        points = balance(times, stages)
        assert len(points) == stages - 1 and list(points) == sorted(set(points)) and 0 not in points

        best = min(_slowest(times, c) for c in itertools.combinations(range(1, n), stages - 1))
        assert _slowest(times, points) == pytest.approx(best)


def _slowest(times: list[float], cuts: tuple[int, ...]) -> float:
    bounds = (0, *cuts, len(times))
    return max(sum(times[a:b]) for a, b in zip(bounds, bounds[1:]))


def test_split_follows_measured_time_not_parameter_count_and_prints_it(monkeypatch, capsys):
    blocks = [nn.Linear(100, 100), nn.Linear(100, 4), nn.Linear(4, 4), nn.Linear(4, 4)]
    # Block 0 holds nearly every parameter but is fast; block 3 is slow (say, a big activation).
    monkeypatch.setattr(split, "_time_block", lambda block, x: 0.004 if block is blocks[3] else 0.001)
    result = split_model(blocks, 2, sample_input=torch.randn(2, 100))
    assert result.stages == [[0, 1, 2], [3]]
    assert result.stage_times_s == pytest.approx([0.003, 0.004])
    out = capsys.readouterr().out
    assert "pipeline split at [3]" in out
    assert "stage 0: blocks 0-2, est. 3.000 ms fwd+bwd" in out
    assert "stage 1: block 3, est. 4.000 ms fwd+bwd" in out
    assert all(p.grad is None for b in blocks for p in b.parameters())  # profiling leaves no gradient


def test_split_measures_real_blocks_and_takes_explicit_points():
    class Slow(nn.Module):  # no parameters, many flops
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weight = torch.eye(x.shape[1])
            for _ in range(300):
                x = torch.tanh(x @ weight)
            return x

    # Parameter counts would put the cut at 1 or 2; block 3 takes some 30 times the others' time.
    blocks = [nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64), Slow()]
    assert split_model(blocks, 2, sample_input=torch.randn(64, 64), verbose=False).split_points == (3,)
    explicit = split_model(nn.Sequential(*blocks), 3, split_points=[1, 3], verbose=False)
    assert explicit.stages == [[0], [1, 2], [3]] and explicit.stage_times_s is None
    with pytest.raises(ValueError, match="split_points"):
        split_model(blocks, 2, split_points=[4])
    with pytest.raises(ValueError, match="stages=5"):
        split_model(blocks, 5, split_points=[1, 2, 3, 4])
    with pytest.raises(TypeError, match="nn.Sequential or a list"):
        split_model(nn.Linear(2, 2), 1, split_points=[])


# -- configuration, layout, wire ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"stages": 0}, "stages"),
        ({"micro_batches": 1.5}, "micro_batches"),
        ({"schedule": "zb"}, "schedule"),
        ({"engine": "jax"}, "engine"),
        ({"replica_sync": "gossip"}, "replica_sync"),
        ({"stages": 3, "split_points": (2, 1)}, "split_points"),
        ({"stages": 2, "split_points": (1, 2)}, "split_points"),
        ({"stages": 4, "micro_batches": 2, "engine": "torch"}, "micro_batches"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"PipelineConfig.{field}="):
        PipelineConfig(**kwargs)


def test_config_is_filled_from_a_strategy():
    from paratrain.train.strategy import Strategy as TrainStrategy
    from paratrain.train.strategy import pipeline_config

    ps = TrainStrategy(architecture="ps", pipeline_stages=2, micro_batches=8, pipeline_schedule="gpipe")
    config = pipeline_config(ps)
    assert config == PipelineConfig(stages=2, micro_batches=8, schedule="gpipe", replica_sync="ps")
    assert pipeline_config(TrainStrategy(), engine="torch") == PipelineConfig(engine="torch")
    assert pipeline_config(ps, replica_sync="allreduce").replica_sync == "allreduce"
    assert pipeline_config(TrainStrategy()) == PipelineConfig()
    assert PipelineConfig(2, 4, "gpipe", (1,)).split_points == (1,)


def test_mesh_layout_puts_neighbour_stages_on_consecutive_ranks():
    layout = MeshLayout.for_world(2, 4)
    assert [layout.coords(r) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert layout.pipeline_ranks(1) == (2, 3) and layout.replica_ranks(1) == (1, 3)
    placement = layout.placement(3)
    assert (placement.stage, placement.replica, placement.prev_rank, placement.next_rank) == (1, 1, 2, None)
    with pytest.raises(ValueError, match="does not divide"):
        MeshLayout.for_world(3, 4)


def test_activation_headers_round_trip_and_batches_split_near_evenly():
    for tensor in (
        torch.zeros(3, 5, dtype=torch.float64),
        torch.zeros(2, dtype=torch.int64),
        torch.zeros(()),
    ):
        assert p2p.decode_header(p2p.encode_header(tensor)) == (tensor.dtype, list(tensor.shape))
    with pytest.raises(TypeError, match="complex64"):
        p2p.encode_header(torch.zeros(2, dtype=torch.complex64))
    assert [len(mb) for mb in split_micro_batches(torch.zeros(10, 2), 4, "inputs")] == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="fewer rows than micro_batches=4"):
        split_micro_batches(torch.zeros(3, 2), 4, "inputs")


def test_the_torch_engine_refuses_what_torch_pipelining_cannot_run():
    # PipelineStage sizes its receive buffers from the first micro-batch of the first step.
    from paratrain.pipeline.torch_engine import TorchPipeline

    engine = types.SimpleNamespace(_batch_rows=None)
    with pytest.raises(ValueError, match="equal micro-batches: 10 rows"):
        TorchPipeline._check_batch(engine, split_micro_batches(torch.zeros(10, 2), 4, "inputs"))
    TorchPipeline._check_batch(engine, split_micro_batches(torch.zeros(8, 2), 4, "inputs"))
    with pytest.raises(ValueError, match="fixes the batch size at the first step \\(8 rows\\)"):
        TorchPipeline._check_batch(engine, split_micro_batches(torch.zeros(12, 2), 4, "inputs"))
    TorchPipeline._check_batch(engine, None)  # a middle stage sees no batch


# -- one process: model parallel on local devices -----------------------------------------------------
def _reference(steps: int, replicas: int) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """The whole model trained in this process on the whole batches; per step, each replica's loss."""
    model = parity.pipeline_model()
    opt = torch.optim.SGD(model.parameters(), lr=parity.LR)
    losses = []
    for x, y in parity.pipeline_batches(replicas)[:steps]:
        with torch.no_grad():
            losses.append(
                [
                    nn.functional.mse_loss(
                        model(x[k * parity.ROWS : (k + 1) * parity.ROWS]),
                        y[k * parity.ROWS : (k + 1) * parity.ROWS],
                    ).item()
                    for k in range(replicas)
                ]
            )
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict(), losses


def test_in_process_model_parallel_trains_like_the_whole_model(capsys):
    expected, losses = _reference(parity.STEPS, 1)
    for stages, micro_batches in ((1, 1), (2, 3), (3, 10)):
        model = parity.pipeline_model()
        config = PipelineConfig(stages, micro_batches)
        pipe = pipeline_for(
            model, config, loss_fn=nn.functional.mse_loss, sample_input=torch.randn(4, 6).double()
        )
        assert len(pipe.module.stages) == stages and pipe.is_first_stage and pipe.is_last_stage
        assert all(device.type == "cpu" for device in pipe.module.devices)
        opt = torch.optim.SGD(pipe.parameters(), lr=parity.LR)
        for step, (x, y) in enumerate(parity.pipeline_batches(1)):
            opt.zero_grad()
            loss = pipe.step(x, y)
            opt.step()
            assert loss.item() == pytest.approx(losses[step][0], rel=1e-9)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, expected[key], rtol=1e-9, atol=1e-12)
    assert "pipeline split at" in capsys.readouterr().out


def test_place_on_devices_moves_activations_between_devices():
    stages = [nn.Linear(3, 4), nn.Linear(4, 2)]
    module = place_on_devices(stages, ["cpu", "cpu"])
    out = module(torch.randn(5, 3))
    out.sum().backward()
    assert out.shape == (5, 2) and all(p.grad is not None for p in module.parameters())
    with pytest.raises(ValueError, match="2 stages but 1 devices"):
        place_on_devices(stages, ["cpu"])


# -- pipelines over processes -------------------------------------------------------------------------
def _check_parity(out_dir: Path, spec: str, workers: int) -> None:
    tag, stages, schedule, micro_batches = spec.split(":")[:4]
    stages, micro_batches = int(stages), int(micro_batches)
    replicas = workers // stages
    expected, losses = _reference(parity.STEPS, replicas)
    for replica in range(replicas):
        seen = {}
        for stage in range(stages):
            saved = torch.load(out_dir / f"{tag}_rank{replica * stages + stage}.pt")
            assert (saved["stage"], saved["replica"]) == (stage, replica)
            assert all(0.0 <= b < 1.0 for b in saved["bubbles"])
            peak = micro_batches if schedule == "gpipe" else min(stages - stage, micro_batches)
            assert saved["peak"] == peak, tag
            seen.update(saved["state"])
            if stage == stages - 1:
                assert saved["losses"] == pytest.approx([step[replica] for step in losses], rel=1e-9), tag
            else:
                assert saved["losses"] == [None] * parity.STEPS
        assert seen.keys() == expected.keys(), tag
        for key, value in seen.items():
            torch.testing.assert_close(value, expected[key], rtol=1e-9, atol=1e-12, msg=f"{tag} {key}")


def _run_parity(tmp_path: Path, workers: int, servers: int, specs: list[str]) -> None:
    """One job runs every spec in turn (a launch costs seconds); then each is checked."""
    run_job(
        JOBS / "pipeline_parity.py",
        workers=workers,
        servers=servers,
        args=[str(tmp_path), *specs],
        timeout_s=120,
    )
    for spec in specs:
        _check_parity(tmp_path, spec, workers)


def test_two_stage_pipelines_train_like_one_process(tmp_path):
    _run_parity(
        tmp_path,
        workers=2,
        servers=0,
        specs=[
            "gpipe1:2:gpipe:1:paratrain:allreduce:auto",
            "gpipe3:2:gpipe:3:paratrain:allreduce:2",
            "1f1b4:2:1f1b:4:paratrain:allreduce:3",  # 10 rows: micro-batches of 3, 3, 2, 2
            "1f1b10:2:1f1b:10:paratrain:allreduce:1",
            "torch-gpipe2:2:gpipe:2:torch:allreduce:2",
            "torch-1f1b5:2:1f1b:5:torch:allreduce:4",
        ],
    )


def test_four_stage_pipelines_and_a_two_by_two_mesh_train_like_one_process(tmp_path):
    _run_parity(
        tmp_path,
        workers=4,
        servers=2,
        specs=[
            "gpipe2:4:gpipe:2:paratrain:allreduce:1+2+4",
            "1f1b3:4:1f1b:3:paratrain:allreduce:auto",  # fewer micro-batches than stages
            "1f1b7:4:1f1b:7:paratrain:allreduce:2+3+4",
            "torch-1f1b5:4:1f1b:5:torch:allreduce:1+2+3",
            # 2 stages x 2 replicas: replicas average gradients by all-reduce or through the servers
            "mesh-allreduce:2:1f1b:4:paratrain:allreduce:auto",
            "mesh-ps:2:gpipe:3:paratrain:ps:2",
            "mesh-torch:2:1f1b:2:torch:allreduce:3",
        ],
    )


@pytest.mark.parametrize(
    "mode, stage, expected",
    [
        ("raise", 1, "pipeline stage 1 (rank 1, replica 0) failed at F1 of step 1: RuntimeError: injected"),
        ("kill", 0, "killed by signal SIGKILL"),
    ],
    ids=["raise", "kill"],
)
def test_a_failing_stage_ends_the_job_with_a_report_naming_it(mode, stage, expected):
    # The other stage is left waiting for the failed one: the launcher must end the job, not hang.
    outcome = run_job(
        JOBS / "pipeline_fault.py", workers=2, args=[mode, str(stage), "1"], expect="failure", timeout_s=90
    )
    assert outcome.failure is not None
    assert (outcome.failure.role, outcome.failure.rank) == ("worker", stage)
    assert expected in outcome.report
    assert "done" not in outcome.stdout
