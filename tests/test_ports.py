"""A port already taken ends a command with one line naming the port and the setting that changes
it, never a traceback: `paratrain launch --dashboard-port`, `paratrain serve --port`, and the
scheduler that rank 0 runs at MASTER_PORT+1 under torchrun (whose agent then stops the other ranks
at once, rather than their waiting out the 60 s connect timeout), and, with no agent, the other
ranks that find a program there that is no scheduler."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from paratrain import checkpoint
from paratrain.errors import TransportError
from paratrain.launch.cli import main
from paratrain.testing import free_port, free_port_run
from paratrain.transport.client import RpcClient
from paratrain.transport.config import TransportConfig
from paratrain.transport.handshake import NoGreeting

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "serve_models.py"


@pytest.fixture
def taken() -> Iterator[int]:
    """A port some other process listens on."""
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):
        yield port


def test_a_dashboard_port_taken_is_one_line_naming_the_option(tmp_path, taken) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    args = ["launch", "-w", "1", "-s", "0", "--dashboard", "--dashboard-port", str(taken), str(script)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and result.exception is not None and isinstance(result.exception, SystemExit)
    assert (
        f"Error: port {taken} on 127.0.0.1 is taken by another process: choose another with --dashboard-port"
        in (result.output)
    ), result.output
    assert "Traceback" not in result.output


def test_a_serve_port_taken_is_one_line_naming_the_option(tmp_path, taken) -> None:
    from paratrain.serve.model import load_factory

    folder = checkpoint.staging_dir(tmp_path, 1)
    model = load_factory(f"{MODELS}:mlp")()
    checkpoint.save_file(folder / "model.pt", {"model": model.state_dict(), "optimizer": {}})
    checkpoint.commit(tmp_path, 1, {})
    args = [
        "serve",
        "--model",
        f"{MODELS}:mlp",
        "--port",
        str(taken),
        "--reload-interval",
        "0",
        str(tmp_path),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"Error: port {taken} on 127.0.0.1 is taken by another process: choose another with --port" in (
        result.output
    ), result.output


def _init_job(tmp_path) -> tuple[Path, int, dict[str, str], str]:
    """A script that only calls paratrain.init(), a free MASTER_PORT, the ranks' environment, and
    the line each rank must print when MASTER_PORT+1 (the scheduler's) is taken."""
    script = tmp_path / "init.py"
    script.write_text("import paratrain\nparatrain.init()\nprint('init done', flush=True)\n")
    master = free_port_run(2)
    env = {
        **os.environ,
        "PARATRAIN_SECRET": "ab" * 32,
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": "1",
    }
    line = f"paratrain: port {master + 1} on 127.0.0.1 is taken by another process: the scheduler listens on "
    return script, master, env, line + "MASTER_PORT+1: choose another MASTER_PORT"


@pytest.mark.timeout(120)
def test_under_torchrun_a_scheduler_port_taken_is_one_line_and_the_other_ranks_are_stopped(tmp_path) -> None:
    script, master, env, line = _init_job(tmp_path)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(master), str(script)]
    with socket.create_server(("127.0.0.1", master + 1)):
        # The deadline is the test's bound on a hang: the other rank would wait 60 s to connect.
        done = subprocess.run(torchrun, env=env, capture_output=True, text=True, timeout=55)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "init done" not in output, output
    assert line in output, output
    assert "SIGTERM" in output, output  # rank 1, stopped by torchrun's agent when rank 0 ended


@pytest.mark.timeout(120)
def test_ranks_started_without_an_agent_each_say_the_scheduler_port_is_taken_without_waiting(
    tmp_path,
) -> None:
    """As under srun or by hand: no agent stops the other ranks when rank 0 cannot bind
    MASTER_PORT+1. A rank that finds there a listener that sends no paratrain greeting says the
    same line as rank 0 once the handshake timeout passed, not after the 60 s connect timeout."""
    script, master, env, line = _init_job(tmp_path)
    env = {
        **env,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master),
        "WORLD_SIZE": "2",
    }
    env = {k: v for k, v in env.items() if not k.startswith("TORCHELASTIC_")}
    with socket.create_server(("127.0.0.1", master + 1)):  # accepts, never greets
        ranks = [
            subprocess.Popen(
                [sys.executable, str(script)],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(2)
        ]
        try:
            # The deadline is the test's bound on a hang: rank 1 would wait 60 s to connect.
            outputs = [rank.communicate(timeout=50)[0] for rank in ranks]
        finally:
            for rank in ranks:
                rank.kill()
                rank.wait()
    for rank, output in zip(ranks, outputs, strict=True):
        assert rank.returncode == 1 and line in output and "Traceback" not in output, output


def test_a_silent_listener_is_final_only_where_the_client_says_so(taken) -> None:
    """The scheduler's link gives up on a listener that never greets; other clients keep trying
    until their connect timeout (a stalled server may still come back)."""
    quick = TransportConfig(connect_timeout_s=0.6, handshake_timeout_s=0.2)
    with pytest.raises(
        NoGreeting, match="accepted the connection but sent no paratrain greeting within 0.2 s"
    ):
        RpcClient("127.0.0.1", taken, b"s" * 32, config=quick, silence_is_final=True)
    with pytest.raises(TransportError, match="within 0.6 s") as raised:
        RpcClient("127.0.0.1", taken, b"s" * 32, config=quick)
    assert not isinstance(raised.value, NoGreeting)
