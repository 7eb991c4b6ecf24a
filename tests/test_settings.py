"""What a user sees when a setting is wrong: checked by the launcher before any process starts, a
misspelt name answered with the nearest valid one, the cause of a failed job printed once and first.

Tables without processes; one end-to-end run of `paratrain launch`.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from paratrain.cluster.spec import EXIT_ABORTED
from paratrain.data import digits
from paratrain.errors import MissingExtraError
from paratrain.launch.api import LaunchConfig, check_strategy
from paratrain.launch.cli import main
from paratrain.launch.lines import Fold
from paratrain.launch.report import ChildFailure, _exception_line, _failure_report, interrupted_exit_code
from paratrain.metrics import TensorBoardMetrics
from paratrain.train.strategy import Strategy, idle_servers_warning

PARATRAIN = str(Path(sys.executable).parent / "paratrain")


# ---- the strategy's own errors: field, value, and the nearest valid one ----------------------


@pytest.mark.parametrize(
    "name, says",
    [
        ("dist_synk", "strategy 'dist_synk' is not one of local, device, collective, ps, dist_sync,"),
        ("dist_synk", "did you mean 'dist_sync'?"),
        ("colective", "did you mean 'collective'?"),
        ("collective:acumulation_steps=4", "Strategy has no field 'acumulation_steps' (its fields: "),
        ("collective:acumulation_steps=4", "did you mean 'accumulation_steps'?"),
        ("ps:consistency=bounded,stalenes=2", "did you mean 'staleness'?"),
        (
            "ps:consistency=asink",
            "Strategy.consistency='asink' is not one of sync, async, bounded, backup; did you",
        ),
        ("ps:update_on=workers", "did you mean 'worker'?"),
        ("collective:compression=fp61", "did you mean 'fp16'?"),
        ("collective:pipeline_schedule=1fb1", "did you mean '1f1b'?"),
        ("ps:staleness", "strategy setting 'staleness' is not field=value"),
        ("ps:staleness=x", "staleness='x' is not a number"),
    ],
)
def test_a_misspelt_strategy_gets_the_valid_choices_and_the_nearest(name, says):
    with pytest.raises(ValueError) as caught:
        Strategy.parse(name)
    assert says in str(caught.value)


@pytest.mark.parametrize("name", ["zzz", "ps:qqq=1", "ps:consistency=xyz"])
def test_nothing_near_gets_no_guess(name):
    with pytest.raises(ValueError) as caught:
        Strategy.parse(name)
    assert "did you mean" not in str(caught.value)


# ---- the launcher's checks, before any process starts ------------------------------------------


@pytest.mark.parametrize(
    "strategy, workers, servers, error",
    [
        ("dist_synk", 2, 1, "strategy='dist_synk': strategy 'dist_synk' is not one of"),
        ("ps", 2, 0, "strategy='ps' is a ps strategy and needs servers, but num_servers=0 (-s 0)"),
        ("hybrid", 2, 0, "is a hybrid strategy and needs servers"),
        ("dist_async", 4, 0, "needs servers"),
        ("collective:pipeline_stages=3", 2, 0, "pipeline_stages=3 does not divide the job's 2 worker(s)"),
        ("collective:pipeline_stages=2", 3, 0, "launch with -w 2, 4, 6, ..."),
        ("ps:pipeline_stages=4", 6, 1, "does not divide the job's 6 worker(s) (-w 6)"),
        ("collective:local_sgd_period=2,compression=bf16", 2, 0, "Strategy.compression='bf16' does nothing"),
    ],
)
def test_the_launcher_refuses_a_strategy_that_cannot_run(strategy, workers, servers, error):
    with pytest.raises(ValueError) as caught:
        LaunchConfig("train.py", num_workers=workers, num_servers=servers, strategy=strategy)
    assert error in str(caught.value)


@pytest.mark.parametrize(
    "strategy, workers, servers, warned",
    [
        ("dist_sync", 2, 1, None),
        ("collective", 2, 0, None),
        ("collective:pipeline_stages=2", 4, 0, None),
        ("hybrid", 2, 1, None),  # the servers hold embedding tables, if the model has any (the Trainer says)
        ("collective", 2, 1, "uses no servers: the job's 1 server(s) will be idle (launch with -s 0)"),
        ("local", 3, 2, "strategy='local' is a local strategy and uses no servers"),
    ],
)
def test_the_launcher_warns_about_idle_servers(strategy, workers, servers, warned):
    warnings = check_strategy(strategy, servers, workers)
    if warned is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warned in warnings[0]


@pytest.mark.parametrize(
    "tables, servers, architecture, warned",
    [(0, 1, "hybrid", True), (2, 1, "hybrid", False), (0, 0, "hybrid", False), (0, 1, "ps", False)],
)
def test_hybrid_without_embedding_tables_says_the_servers_are_idle(tables, servers, architecture, warned):
    message = idle_servers_warning(Strategy(architecture=architecture), servers, tables)
    assert (message is not None) == warned
    if warned:
        assert f"the job's {servers} server(s) are idle" in message
        assert "DistributedEmbedding" in message


# ---- the command line: each mistake is one short error, exit 2, no process started -------------


@pytest.mark.parametrize(
    "args, env, says",
    [
        (["--strategy", "dist_synk"], {}, "Error: --strategy 'dist_synk': strategy 'dist_synk' is not one"),
        (["--strategy", "collective:acumulation_steps=4"], {}, "did you mean 'accumulation_steps'?"),
        (["-s", "0", "--strategy", "ps"], {}, "--strategy 'ps' is a ps strategy and needs servers"),
        (["-w", "2", "--strategy", "collective:pipeline_stages=3"], {}, "does not divide the job's 2 worker"),
        ([], {"PARATRAIN_STRATEGY": "dist_asink"}, "PARATRAIN_STRATEGY (from the environment) 'dist_asink'"),
        (["--stratgy", "ps"], {}, "No such option '--stratgy'. Did you mean '--strategy'?"),
        (["-w", "0"], {}, "Invalid value for '-w' / '--workers'"),
    ],
)
def test_the_command_line_refuses_before_starting_anything(tmp_path, monkeypatch, args, env, says):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never run')\n")
    monkeypatch.delenv("PARATRAIN_STRATEGY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(main, ["launch", *args, str(script)])
    assert result.exit_code == 2, result.output
    assert says in result.output
    assert "Traceback" not in result.output and "starting" not in result.output
    assert len(result.output.splitlines()) <= 4


def test_an_idle_server_is_a_warning_not_an_error(tmp_path):
    config = LaunchConfig(str(tmp_path / "train.py"), num_workers=2, num_servers=1, strategy="collective")
    assert config.warnings() == [check_strategy("collective", 1, 2)[0]]
    assert LaunchConfig("train.py", strategy=None).warnings() == []


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (None, 130)])
def test_an_interrupted_launch_exits_as_a_shell_says(signum, code):
    assert interrupted_exit_code(signum) == code


# ---- the children's output, folded: abort notices out, a repeated traceback as one line -----------

TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "train.py", line 3, in <module>',
    "    trainer = paratrain.Trainer(model, optimizer, strategy='dist_synk')",
    "ValueError: strategy 'dist_synk' is not one of ...; did you mean 'dist_sync'?",
]


def _shown(lines_by_child: list[tuple[str, str]]) -> list[str]:
    fold, streams, shown = Fold(), {}, []
    for label, line in lines_by_child:
        stream = streams.setdefault(label, fold.lines(label))
        shown += [f"[{label}] {text}" for text in stream.feed(line)]
    for label, stream in streams.items():
        shown += [f"[{label}] {text}" for text in stream.close()]
    return shown


def test_folding_prints_the_cause_once_and_drops_the_knock_on_lines():
    lines = [("worker 0", "train step 1 loss 2.3")]
    lines += [("worker 0", line) for line in TRACEBACK]
    lines += [
        (
            "scheduler 0",
            "2026-11-24 08:15:25,101 ERROR [scheduler 0] paratrain.cluster.scheduler: aborting "
            "the job: worker 0 (host 127.0.0.1, pid 2830) lost its connection to the scheduler",
        ),
        ("scheduler 0", "paratrain: job aborted: worker 0 (host 127.0.0.1, pid 2830) lost its connection"),
        (
            "server 0",
            "paratrain: server stopping: the scheduler aborted the job: worker 0 lost its connection",
        ),
    ]
    lines += [("worker 1", line) for line in TRACEBACK]  # the same bad line, run by every worker
    lines += [("worker 2", line) for line in TRACEBACK[:2]]  # cut short by its end (aborted)
    lines += [("worker 1", "paratrain: worker stopping: lost the connection to the scheduler: closed")]

    shown = _shown(lines)

    assert shown[:5] == ["[worker 0] train step 1 loss 2.3", *(f"[worker 0] {line}" for line in TRACEBACK)]
    assert shown[5] == f"[worker 1] (the same traceback as worker 0, ending: {TRACEBACK[-1]})"
    assert shown[6] == "[worker 1] paratrain: worker stopping: lost the connection to the scheduler: closed"
    assert shown[7:] == ["[worker 2] (the same traceback as worker 0, cut short)"]
    assert not any("aborted the job" in line or "aborting" in line for line in shown)


def test_a_traceback_written_after_an_abort_notice_on_the_same_line_is_still_folded():
    # A child's abort notice and its traceback, written by two threads at once, share a line.
    notice = "paratrain: worker stopping: the scheduler aborted the job: worker 0 exited with code 1"
    lines = [("worker 0", line) for line in TRACEBACK]
    lines += [("worker 1", notice + TRACEBACK[0]), *(("worker 1", line) for line in TRACEBACK[1:])]
    shown = _shown(lines)
    assert shown == [
        *(f"[worker 0] {line}" for line in TRACEBACK),
        f"[worker 1] (the same traceback as worker 0, ending: {TRACEBACK[-1]})",
    ]


def test_a_traceback_cut_short_is_printed_as_far_as_it_came_unless_another_child_printed_it():
    other = [TRACEBACK[0], '  File "other.py", line 1, in <module>']
    assert _shown([("worker 1", line) for line in other]) == [f"[worker 1] {line}" for line in other]
    lines = [("worker 0", line) for line in TRACEBACK] + [("worker 1", TRACEBACK[0])]
    assert _shown(lines)[-1] == "[worker 1] (the same traceback as worker 0, cut short)"


@pytest.mark.parametrize("where", ["a line of its own", "the end of a line"])
def test_an_abort_notice_written_inside_a_traceback_is_left_out_of_it(where):
    # The abort notice of another thread of the child lands between the lines of its traceback, or
    # (written without the traceback's newline yet) at the end of one, with an empty line after it.
    notice = "paratrain: worker stopping: the scheduler aborted the job: worker 0 lost its connection"
    if where == "a line of its own":
        inside = [TRACEBACK[0], TRACEBACK[1], notice, *TRACEBACK[2:]]
    else:
        inside = [TRACEBACK[0], TRACEBACK[1] + notice, "", *TRACEBACK[2:]]
    lines = [("worker 0", line) for line in TRACEBACK] + [("worker 1", line) for line in inside]
    assert _shown(lines) == [
        *(f"[worker 0] {line}" for line in TRACEBACK),
        f"[worker 1] (the same traceback as worker 0, ending: {TRACEBACK[-1]})",
    ]


def test_torchs_rank_prefix_is_dropped_and_its_tracebacks_fold():
    """torch.distributed's excepthook writes "[rankN]: " before each line of a traceback."""
    lines = [("worker 0", f"[rank0]: {line}") for line in TRACEBACK]
    lines += [("worker 1", f"[rank1]: {line}") for line in TRACEBACK]
    assert _shown(lines) == [
        *(f"[worker 0] {line}" for line in TRACEBACK),
        f"[worker 1] (the same traceback as worker 0, ending: {TRACEBACK[-1]})",
    ]
    assert _exception_line([f"[rank1]: {line}" for line in TRACEBACK]) == TRACEBACK[-1]


def test_different_tracebacks_are_each_printed():
    other = [*TRACEBACK[:-1], "RuntimeError: something else"]
    shown = _shown([("worker 0", line) for line in TRACEBACK] + [("worker 1", line) for line in other])
    assert len(shown) == len(TRACEBACK) + len(other)


# ---- the report: who failed and why, first, in a few lines --------------------------------------


@pytest.mark.parametrize(
    "tail, cause",
    [
        (TRACEBACK, TRACEBACK[-1]),
        ([*TRACEBACK, "paratrain: worker stopping: whatever"], TRACEBACK[-1]),
        (TRACEBACK[1:], TRACEBACK[-1]),  # the traceback's head fell out of the tail
        (["worker 1 is about to fail"], None),
        ([], None),
        (["    indented", "2026-11-24 08:15:25,101 WARNING a log line"], None),
        (["    indented", "paratrain: worker stopping: the launcher (pid 7) is gone"], None),
    ],
)
def test_the_exception_is_found_in_a_stderr_tail(tail, cause):
    assert _exception_line(tail) == cause


def _child(label: str, pid: int, returncode: int, reason: str) -> SimpleNamespace:
    role, rank = label.split()
    return SimpleNamespace(
        role=role, rank=int(rank), label=label, pid=pid, returncode=returncode, failure_reason=reason
    )


def test_the_report_names_the_cause_first_and_the_aborted_on_one_line():
    failure = ChildFailure("worker", 0, 11, "127.0.0.1", 1, None, "exited with code 1", [*TRACEBACK])
    aborted = [
        _child(name, pid, EXIT_ABORTED, "aborted") for name, pid in (("server 0", 12), ("worker 1", 13))
    ]
    failed = [_child("worker 0", 11, 1, "exited with code 1"), *aborted]

    report = _failure_report(failure, failed, []).splitlines()

    assert report == [
        "paratrain: job failed: worker 0 (pid 11, host 127.0.0.1) exited with code 1",
        f"  {TRACEBACK[-1]}",
        f"  also stopped, as the job was aborted (exit code {EXIT_ABORTED}): "
        "server 0 (pid 12), worker 1 (pid 13)",
    ]


def test_a_failure_without_a_traceback_keeps_its_stderr_tail():
    failure = ChildFailure(
        "worker", 1, 11, "h", -9, "SIGKILL", "was killed by signal SIGKILL", ["about to fail"]
    )
    report = _failure_report(failure, [_child("worker 1", 11, -9, "killed")], [])
    assert report.splitlines()[1:] == ["  last 1 stderr lines of worker 1:", "    about to fail"]


# ---- one real launch: a script that raises in every worker -----------------------------------------

RAISES = """
import paratrain
ctx = paratrain.init()
ctx.barrier()  # both workers raise at once
raise ValueError("every worker fails the same way")
"""


def test_a_launch_that_fails_prints_its_cause_once(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    proc = subprocess.run(
        [PARATRAIN, "launch", "-w", "2", "-s", "0", str(script)], capture_output=True, text=True, timeout=120
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert output.count("Traceback (most recent call last):") == 1, output
    assert "lost its connection" not in output and "aborted the job" not in output, output
    report = proc.stderr[proc.stderr.index("paratrain: job failed: worker ") :].splitlines()
    assert report[1] == "  ValueError: every worker fails the same way", output
    assert len(report) <= 3, output  # who, why, and those aborted (if they exited before being stopped)
    assert len(output.splitlines()) <= 14, output  # 4 about the start, 5 of traceback, 1 folded, 3 report


# ---- optional dependencies: an extra each, and an error that names it ----------------------------


def test_scikit_learn_and_tensorboard_are_extras_not_core_dependencies():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert "scikit-learn" not in core and "tensorboard" not in core
    extras = project["optional-dependencies"]
    assert extras["examples"] == ["scikit-learn>=1.2"] and extras["tensorboard"] == ["tensorboard>=2.10"]
    for needed in ("scikit-learn", "tensorboard", "mypy==", "ruff=="):
        assert any(spec.startswith(needed) for spec in extras["dev"]), needed


@pytest.mark.parametrize(
    "missing, use, extra",
    [
        (("sklearn", "sklearn.datasets"), lambda tmp: digits(), "paratrain[examples]"),
        (("torch.utils.tensorboard",), lambda tmp: TensorBoardMetrics(tmp), "paratrain[tensorboard]"),
    ],
)
def test_a_missing_extra_is_named_with_its_install_command(monkeypatch, tmp_path, missing, use, extra):
    for module in missing:
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it raises
    with pytest.raises(MissingExtraError, match=re.escape(f"which is not installed: pip install '{extra}'")):
        use(tmp_path)
