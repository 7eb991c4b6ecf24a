"""Jobs that several test files check, run once per session."""

from __future__ import annotations

import inspect
import multiprocessing.process
import os
import re
import subprocess
import types
from pathlib import Path
from typing import Any

import pytest

from paratrain.testing import JobOutcome, run_job

EXAMPLES = Path(__file__).parent.parent / "examples"

DIGITS_SYNC_ARGS = ("--strategy", "dist_sync", "--epochs", "6")
DIGITS_SYNC_ENV = {"OMP_NUM_THREADS": "1"}
"""One torch thread per process: the sums and the steps are the same on every run (0.958 after 6
epochs, measured), wherever the processes run (test_hosts runs the same job on three hosts)."""


@pytest.fixture(scope="session")
def digits_dist_sync() -> JobOutcome:
    """The README's main job (2 workers, 1 server, dist_sync) on this machine: test_examples checks
    that it learns, test_hosts that three hosts reach the same accuracy."""
    digits = EXAMPLES / "digits.py"
    return run_job(digits, workers=2, servers=1, args=DIGITS_SYNC_ARGS, env=DIGITS_SYNC_ENV, timeout_s=280)


# ---- the fast tier: `pytest -m "not jobs"` runs the tests that start no process --------------------
#
# A test belongs to the `jobs` tier when it starts processes: a paratrain job (run_job and friends),
# a launcher, a subprocess of any kind. It is marked here, before the run, by reading its code: the
# test function, the functions and fixtures it uses from the tests (followed to any depth), searched
# for the calls below; a test can also say so itself with @pytest.mark.jobs. While the `jobs` tier
# is deselected, a test that starts a process anyway fails at once, naming itself, so the rule
# cannot quietly let a slow test into the fast tier (mark such a test, or add its call here).
STARTS_PROCESSES = re.compile(
    r"\b(run_job|run_local_job|run_ray|run_slurm_job|subprocess|Popen|multiprocessing|spawn|"
    r"SimulatedHosts|os\.fork|sbatch|kubectl|RoleProcess|digits_dist_sync)\b"
)
TESTS = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "jobs: the test starts processes (a job, a launcher, a subprocess)")
    config.addinivalue_line("markers", "cuda: the test needs a CUDA device (benchmarks/gpu.py runs them)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and _starts_processes(item):
            item.add_marker(pytest.mark.jobs)


def _starts_processes(item: pytest.Function) -> bool:
    if item.get_closest_marker("jobs") is not None:
        return True
    seen: set[int] = set()  # by id: a callable global may be unhashable (a pytest MarkDecorator)
    todo: list[object] = [item.function]
    for name in item.fixturenames:
        if name == "_fast_tier_starts_no_process":  # the guard itself names what it refuses
            continue
        for fixture in item._fixtureinfo.name2fixturedefs.get(name, ()):
            todo.append(fixture.func)
    while todo:
        func = inspect.unwrap(todo.pop())  # type: ignore[arg-type]
        if id(func) in seen or not _in_tests(func):
            continue
        seen.add(id(func))
        try:
            source = inspect.getsource(func)
        except (OSError, TypeError):
            continue
        if STARTS_PROCESSES.search(source):
            return True
        module_globals = getattr(func, "__globals__", {})
        code = getattr(func, "__code__", None)
        names = _names(code) if code is not None else set()
        todo += [module_globals[name] for name in names if callable(module_globals.get(name))]
    return False


def _in_tests(func: object) -> bool:
    try:
        return Path(inspect.getfile(func)).resolve().is_relative_to(TESTS)  # type: ignore[arg-type]
    except TypeError:
        return False


def _names(code: types.CodeType) -> set[str]:
    """The global names a function's code (and the code of functions defined in it) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the `jobs` tier is deselected, a test that starts a process fails naming itself."""
    if "not jobs" not in (request.config.getoption("markexpr") or ""):
        return
    if request.node.get_closest_marker("jobs") is not None:
        return

    def refuse(*args: Any, **kwargs: Any) -> None:
        pytest.fail(
            f"{request.node.nodeid} started a process but is not in the `jobs` tier: mark it "
            "@pytest.mark.jobs, or teach tests/conftest.py's STARTS_PROCESSES the call that starts it"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)
