"""Scheduler, registration, barriers, heartbeats and failure reports, as real multi-process jobs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.cluster.config import JobConfig, config_differences
from paratrain.testing import assert_all_gone, free_port_run, listening_ports, run_job

pytestmark = pytest.mark.timeout(180)

FAST = "paratrain.JobConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0)"


def servers_of(outcome, workers: int) -> list[list]:
    """The server list each worker printed as a JSON line 'servers [...]'."""
    found = []
    for rank in range(workers):
        lines = [s for s in outcome.lines("worker", rank, "stdout") if s.startswith("servers ")]
        assert lines, f"worker {rank} printed no server list:\n{outcome.stdout}"
        found.append(json.loads(lines[0][len("servers ") :]))
    return found


def assert_ports_released(server_lists: list[list]) -> None:
    ports = {port for servers in server_lists for _, port in servers}
    assert not ports & listening_ports(), f"server ports still bound: {ports & listening_ports()}"


def test_every_worker_gets_its_rank_and_the_servers_and_barriers_hold(tmp_path):
    # Each worker writes "rank step" lines, staggered by rank, then passes a barrier; after it,
    # every worker must see every other worker's line of that step: without a real barrier the
    # early ranks would read the file before the late ranks wrote to it.
    log = tmp_path / "steps.log"
    outcome = run_job(
        f"""
        import json, time, paratrain
        ctx = paratrain.init()
        print("rank", ctx.rank, ctx.num_workers, ctx.num_servers)
        print("servers", json.dumps(ctx.servers))
        for step in range(3):
            time.sleep(0.1 * ctx.rank)
            with open({str(log)!r}, "a") as f:
                f.write(f"{{ctx.rank}} {{step}}\\n")
            ctx.barrier(name=f"step{{step}}")
            seen = {{line.split()[0] for line in open({str(log)!r}) if line.split()[1] == str(step)}}
            assert seen == {{"0", "1", "2"}}, (step, seen)
        ctx.barrier(group="all")
        print("done")
        """,
        workers=3,
        servers=2,
    )
    for rank in range(3):
        assert outcome.lines("worker", rank, "stdout")[0] == f"rank {rank} 3 2"
        assert outcome.lines("worker", rank, "stdout")[-1] == "done"
    server_lists = servers_of(outcome, 3)
    assert server_lists[0] == server_lists[1] == server_lists[2]
    assert len({port for _, port in server_lists[0]}) == 2
    assert_ports_released(server_lists)


@pytest.mark.parametrize(
    "action, expected",
    [
        ("raise RuntimeError('boom in worker 1')", "exited with code 1"),
        ("sys.exit(3)", "exited with code 3"),
        ("os.kill(os.getpid(), signal.SIGKILL)", "killed by signal SIGKILL"),
    ],
)
def test_a_failing_worker_ends_the_job_with_a_report_naming_it(action, expected):
    outcome = run_job(
        f"""
        import json, os, signal, sys, time, paratrain
        ctx = paratrain.init({FAST})
        print("servers", json.dumps(ctx.servers))
        if ctx.rank == 1:
            time.sleep(0.5)
            {action}
        ctx.barrier()      # the others wait here for worker 1, which never comes
        time.sleep(120)
        """,
        workers=3,
        servers=2,
        expect="failure",
        timeout_s=120,
    )
    assert outcome.failure is not None
    assert (outcome.failure.role, outcome.failure.rank) == ("worker", 1)
    assert expected in outcome.report
    if "raise" in action:
        assert "RuntimeError: boom in worker 1" in outcome.report
    assert_ports_released(servers_of(outcome, 3))


def test_a_server_that_dies_aborts_the_job():
    # Code before init() runs on every role: on the server it arms a SIGKILL of itself.
    outcome = run_job(
        f"""
        import os, signal, threading, time, paratrain
        if os.environ["PARATRAIN_ROLE"] == "server":
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
        ctx = paratrain.init({FAST})
        time.sleep(120)
        """,
        workers=2,
        servers=1,
        expect="failure",
        timeout_s=120,
    )
    assert (outcome.failure.role, outcome.failure.rank) == ("server", 0)
    assert "killed by signal SIGKILL" in outcome.report


def test_version_and_config_mismatches_are_refused_saying_what_differs():
    outcome = run_job(
        """
        import paratrain, paratrain.version
        if __import__("os").environ["PARATRAIN_RANK"] == "1" and \\
                __import__("os").environ["PARATRAIN_ROLE"] == "worker":
            paratrain.version.__version__ = "0.0.0-other"
        ctx = paratrain.init()
        """,
        workers=2,
        servers=0,
        expect="failure",
    )
    assert "worker 1" in outcome.report
    assert "runs paratrain '0.0.0-other' but the scheduler runs" in outcome.stderr

    outcome = run_job(
        """
        import os, paratrain
        late = os.environ["PARATRAIN_ROLE"] == "worker" and os.environ["PARATRAIN_RANK"] == "1"
        ctx = paratrain.init(paratrain.JobConfig(heartbeat_timeout_s=7.0 if late else 5.0))
        """,
        workers=2,
        servers=0,
        expect="failure",
    )
    assert "different JobConfig: heartbeat_timeout_s: 7.0 on that node, 5.0 here" in outcome.stderr


def test_a_wrong_secret_is_refused_and_the_job_goes_on():
    outcome = run_job(
        """
        import paratrain
        from paratrain.errors import AuthenticationError
        from paratrain.transport.client import RpcClient
        import torch
        ctx = paratrain.init()
        host, port = ctx.servers[0]
        sched_host, sched_port = ctx.spec.scheduler_host, ctx.spec.scheduler_port
        for h, p in [(host, port), (sched_host, sched_port)]:
            try:
                RpcClient(h, p, b"x" * 32)
            except AuthenticationError as exc:
                print("refused", p)
        good = RpcClient(host, port, ctx.spec.secret)
        reply = good.call("ping", {"n": 7}, [torch.arange(5)])
        assert reply.meta == {"n": 7} and reply.tensors[0].tolist() == [0, 1, 2, 3, 4]
        good.close()
        ctx.barrier()
        print("still serving")
        """,
        workers=1,
        servers=1,
    )
    lines = outcome.lines("worker", 0, "stdout")
    assert len([s for s in lines if s.startswith("refused")]) == 2
    assert lines[-1] == "still serving"
    assert "refused connection" in outcome.stderr  # the servers log each refusal


def test_collective_only_job_has_no_servers():
    outcome = run_job(
        """
        import paratrain
        ctx = paratrain.init()
        ctx.barrier()
        print("servers", ctx.servers, ctx.num_servers, ctx.num_workers)
        """,
        workers=2,
        servers=0,
    )
    assert outcome.lines("worker", 1, "stdout") == ["servers [] 0 2"]


def test_a_script_runs_alone_without_a_launcher(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text("import paratrain\nctx = paratrain.init()\nctx.barrier()\nprint(ctx)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARATRAIN_", "DMLC_"))}
    for name in ("RANK", "WORLD_SIZE", "TF_CONFIG", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "role='worker', rank=0, num_workers=1, num_servers=0" in done.stdout


def test_docs_describe_every_field_and_method_of_the_context_init_returns():
    import dataclasses

    from paratrain.node import Context

    page = (Path(__file__).parent.parent / "docs" / "reference" / "context.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)", page, re.MULTILINE))
    public = {f.name for f in dataclasses.fields(Context)}
    public |= {name for name in vars(Context) if not name.startswith("_")}
    assert public == documented, (public - documented, documented - public)


def test_under_torchrun_a_missing_secret_is_said_once_in_one_line():
    """Every process torchrun starts has the same mistake: the first of the host says it, in one
    line and no traceback; the others fail quietly."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARATRAIN_", "DMLC_"))}
    env.update(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29400")
    said = []
    for local_rank in ("0", "1"):
        done = subprocess.run(
            [sys.executable, "-c", "import paratrain; paratrain.init()"],
            env={**env, "LOCAL_RANK": local_rank},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1, done.stderr
        said.append(done.stderr.splitlines())
    assert len(said[0]) == 1 and said[0][0].startswith("paratrain: PARATRAIN_SECRET is not set"), said
    assert said[1] == []


def test_torchrun_convention_runs_the_scheduler_inside_worker_0(tmp_path):
    script = tmp_path / "torchrun_job.py"
    script.write_text(
        "import paratrain\nctx = paratrain.init()\nctx.barrier()\n"
        "print('rank', ctx.rank, 'of', ctx.num_workers)\n"
    )
    master_port = free_port_run(2)  # the scheduler listens at MASTER_PORT+1
    base = {k: v for k, v in os.environ.items() if not k.startswith("PARATRAIN_")}
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        WORLD_SIZE="2",
        PARATRAIN_SECRET="ab" * 32,
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**base, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, err
        assert out.strip() == f"rank {rank} of 2"
    assert_all_gone([p.pid for p in procs])
    assert master_port + 1 not in listening_ports()


def test_config_differences_name_each_field():
    a, b = JobConfig().as_dict(), JobConfig(heartbeat_timeout_s=9.0).as_dict()
    assert config_differences(a, b) == ["heartbeat_timeout_s: 9.0 on that node, 5.0 here"]
    assert config_differences(a, a) == []


@pytest.mark.parametrize(
    "field, value",
    [("heartbeat_interval_s", 0), ("heartbeat_timeout_s", -1.0), ("start_timeout_s", "x")],
)
def test_bad_job_config_names_the_field_and_value(field, value):
    with pytest.raises(ValueError, match=f"JobConfig.{field}={value!r}"):
        JobConfig(**{field: value})


def test_heartbeat_timeout_must_exceed_the_interval():
    with pytest.raises(ValueError, match="heartbeat_timeout_s=1.0 must be larger"):
        JobConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=1.0)


KV_THEN_WORLD = """
import os, runpy, sys, torch, torch.distributed as dist, paratrain
from paratrain.cluster.rendezvous import init_torch_distributed
sys.argv = sys.argv[1:]  # kv_exact.py and its arguments
runpy.run_path(sys.argv[0], run_name="__main__")  # a server serves in there until the job ends
ctx = paratrain.init()  # the workers' context kv_exact.py joined with
init_torch_distributed(ctx)
total = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(total)
# One write per line: torchrun's processes share its stdout, and print() writes piece by piece.
os.write(1, f"world {ctx.rank} {dist.get_rank()} {dist.get_world_size()} {total.item()}\\n".encode())
dist.destroy_process_group()
"""


@pytest.mark.timeout(240)
def test_torchrun_with_servers_runs_an_exact_parameter_server_job_and_a_world_of_workers(tmp_path):
    """Real torchrun, 4 processes, PARATRAIN_NUM_SERVERS=1: global rank 3 serves, ranks 0-2 are
    workers 0-2; the kvstore job checks every value, then a collective world holds the 3 workers
    (one torchrun for both: each start costs 5 processes' `import torch`)."""
    (tmp_path / "kv_then_world.py").write_text(KV_THEN_WORLD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARATRAIN_")}
    env.update(PARATRAIN_NUM_SERVERS="1", PARATRAIN_SECRET="cd" * 32)
    torchrun = [
        str(Path(sys.executable).parent / "torchrun"),
        "--nnodes",
        "1",
        "--nproc_per_node",
        "4",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port_run(2)),  # paratrain's scheduler listens at MASTER_PORT+1
    ]
    kv_exact = [str(Path(__file__).parent / "jobs" / "kv_exact.py"), "dist_sync", "2", "tcp"]
    cmd = [*torchrun, str(tmp_path / "kv_then_world.py"), *kv_exact]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert done.stdout.count("all exact") == 3, done.stdout  # three workers, each checked
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("world"))
    assert lines == [f"world {r} {r} 3 6.0" for r in range(3)], done.stdout


def test_a_worker_that_exits_with_an_error_code_is_named_not_the_scheduler_it_let_go():
    """sys.exit(3) runs the exit hooks, which tell the scheduler this worker finished; the scheduler
    may then end the job cleanly before the worker's exit is seen. The report names the worker."""
    script = f"""
import sys, paratrain
ctx = paratrain.init({FAST})
ctx.barrier()
if ctx.rank == 1:
    sys.exit(3)
"""
    outcome = run_job(script, workers=2, servers=1, expect="failure", timeout_s=60)
    assert outcome.failure is not None, outcome.report
    assert (outcome.failure.role, outcome.failure.rank, outcome.failure.returncode) == ("worker", 1, 3)
