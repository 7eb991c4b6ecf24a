"""Each engine's devices and local places: the environment it gives each process (process-free),
and one real local job whose workers report what their Context makes of it."""

from __future__ import annotations

import pytest

from paratrain.launch.engines.local.job import LocalJobConfig, ProcessHost, device_env, gpu_shortfall
from paratrain.testing import run_job


@pytest.mark.parametrize(
    ("role", "local_rank", "gpus", "visible", "env"),
    [
        ("worker", 3, 0, None, {}),  # no GPUs asked for: the machine's own view stands
        ("worker", 0, 1, None, {"CUDA_VISIBLE_DEVICES": "0", "PARATRAIN_GPUS_PER_WORKER": "1"}),
        ("worker", 1, 2, None, {"CUDA_VISIBLE_DEVICES": "2,3", "PARATRAIN_GPUS_PER_WORKER": "2"}),
        ("worker", 1, 2, "4,5,6,7", {"CUDA_VISIBLE_DEVICES": "6,7", "PARATRAIN_GPUS_PER_WORKER": "2"}),
        ("server", 0, 2, "4,5", {"CUDA_VISIBLE_DEVICES": ""}),
        ("scheduler", 0, 1, None, {"CUDA_VISIBLE_DEVICES": ""}),
    ],
)
def test_the_local_engine_gives_each_worker_its_own_gpus_and_servers_none(
    role, local_rank, gpus, visible, env
):
    assert device_env(role, local_rank, gpus, visible) == env


def test_more_gpus_than_the_machine_shows_are_refused_naming_the_variable():
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES='0,1' shows 2"):
        device_env("worker", 1, 2, "0,1")


def test_a_worker_s_local_place_counts_the_workers_on_its_host():
    hosts = [ProcessHost("10.0.0.1"), ProcessHost("10.0.0.2"), ProcessHost("10.0.0.1")]
    config = LocalJobConfig(script="train.py", num_workers=3, placements={"worker": hosts})
    assert [config.local_place(rank) for rank in range(3)] == [(0, 2), (0, 1), (1, 2)]
    assert LocalJobConfig(script="train.py", num_workers=4).local_place(3) == (3, 4)


@pytest.mark.parametrize(
    ("workers", "gpus", "environ", "count", "says"),
    [
        (4, 2, {}, 8, ""),
        (4, 2, {}, None, ""),  # GPUs unknown: the workers' CUDA says
        (4, 2, {}, 4, "--gpus-per-worker 2 for 4 workers needs 8 GPUs; this machine has 4"),
        (
            2,
            1,
            {"CUDA_VISIBLE_DEVICES": "3"},
            8,
            "--gpus-per-worker 1 for 2 workers needs 2 GPUs; CUDA_VISIBLE_DEVICES='3' shows 1",
        ),
        (2, 0, {}, 0, ""),
    ],
)
def test_a_local_job_asking_for_more_gpus_than_the_machine_has_is_refused(
    workers, gpus, environ, count, says
):
    config = LocalJobConfig(script="train.py", num_workers=workers, gpus_per_worker=gpus)
    assert gpu_shortfall(config, environ, count) == says


REPORT = """
import os
names = ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
print("env", *(repr(os.environ.get(name)) for name in names))
import paratrain
ctx = paratrain.init()
print("place", ctx.local_rank, ctx.local_world_size, ctx.device)
"""


def test_a_local_job_s_workers_know_their_local_rank_and_device():
    # GPUs 5 and 6 of the machine as the launcher sees them: workers 0 and 1 get one each
    env = {"CUDA_VISIBLE_DEVICES": "5,6"}
    outcome = run_job(REPORT, workers=2, servers=1, gpus_per_worker=1, env=env, timeout_s=120)
    for rank in range(2):
        lines = outcome.lines("worker", rank, "stdout")
        assert f"env '{5 + rank}' '{rank}' '2'" in lines
        assert f"place {rank} 2 cpu" in lines  # this machine has no CUDA: the worker's GPU is the CPU
    assert "env '' None None" in outcome.lines("server", 0, "stdout")


def test_a_ray_worker_s_local_place_counts_the_worker_actors_on_its_node():
    from paratrain.launch.engines.ray.driver import local_places

    workers = [(2, "b"), (0, "a"), (1, "b"), (3, "a"), (4, "c")]
    assert local_places(workers) == {0: (0, 2), 3: (1, 2), 1: (0, 2), 2: (1, 2), 4: (0, 1)}


def test_the_launcher_refuses_before_starting_anything(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from paratrain.launch.cli import main

    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never run')\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    done = CliRunner().invoke(main, ["launch", "-w", "2", "-s", "0", "--gpus-per-worker", "1", str(script)])
    assert done.exit_code == 2
    assert "needs 2 GPUs; CUDA_VISIBLE_DEVICES='0' shows 1" in done.output and "never run" not in done.output
