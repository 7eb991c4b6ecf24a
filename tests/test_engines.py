"""Launch engines are plug-ins: a new engine is one class plus one registry line.

`ToyEngine` below is the whole of an engine that runs a job as one process of this machine (the
script in single-process mode): `paratrain launch --backend toy` dispatches to it, `paratrain
submit --dry-run --backend toy` asks it what would run, and nothing outside the registry compares
an engine's name.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
from click.testing import CliRunner

from paratrain.launch import engines
from paratrain.launch.api import IDENTITY_VARS, LaunchConfig
from paratrain.launch.cli import main
from paratrain.launch.engines.api import DrivenEngine, LaunchArgs
from paratrain.launch.jobspec import SpecError, load_spec
from paratrain.launch.report import ChildRecord, JobResult

SRC = Path(__file__).resolve().parent.parent / "src" / "paratrain"


@dataclass(frozen=True)
class ToyOptions:
    """The toy engine's options: none but where its processes run, in words."""

    where: str = "one process of this machine"


class ToyEngine(DrivenEngine):
    """Runs the job's script as one process here, with no cluster identity (paratrain.init() makes
    it a single process), whatever the job's counts."""

    options_type = ToyOptions

    def options(self, args: LaunchArgs) -> ToyOptions:
        return ToyOptions()

    def launch(self, config: LaunchConfig, options: Any) -> int:
        return self._run(config).exit_code

    def job_options(self, spec: Any, job_id: str, folder: Path, dry_run: bool) -> ToyOptions:
        return ToyOptions()

    def where(self, spec: Any) -> str:
        return ToyOptions().where

    def drive(self, spec: Any, config: LaunchConfig, out: IO[str]) -> JobResult:
        return self._run(config)

    def _run(self, config: LaunchConfig) -> JobResult:
        env = {k: v for k, v in os.environ.items() if k not in IDENTITY_VARS}
        done = subprocess.run([config.python, config.script, *config.args], env={**env, **config.job_env()})
        return JobResult(done.returncode, None, "", [ChildRecord("worker", 0, 0, done.returncode)])


@pytest.fixture
def toy() -> Any:
    engines.register("toy", ToyEngine)  # the one registry line
    yield engines.get("toy")
    engines.unregister("toy")


@pytest.mark.jobs
def test_a_registered_engine_runs_a_job_through_paratrain_launch(toy: Any, tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\n"
        "from pathlib import Path\n"
        "Path(sys.argv[1]).write_text(os.environ['PARATRAIN_STRATEGY'] + ' ' + sys.argv[2])\n"
    )
    marker = tmp_path / "ran"
    args = ["launch", "--backend", "toy", "-w", "1", "-s", "0", "--strategy", "collective"]
    done = CliRunner().invoke(main, [*args, str(script), str(marker), "$(touch pwned)"])
    assert done.exit_code == 0, done.output
    assert marker.read_text() == "collective $(touch pwned)"
    assert not (tmp_path / "pwned").exists()


def test_the_job_platform_asks_a_registered_engine(toy: Any, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    spec = tmp_path / "job.yaml"
    spec.write_text("name: demo\nentry: {script: train.py}\nworkers: 3\nservers: 1\noutput_dir: out\n")
    done = CliRunner().invoke(main, ["submit", "--dry-run", "--backend", "toy", str(spec)])
    assert done.exit_code == 0, done.output
    assert re.search(
        r"^job demo-\S+: 3 worker\(s\), 1 server\(s\) on one process of this machine$", done.output, re.M
    )
    with pytest.raises(
        SpecError, match="evaluator: an evaluator runs on the local, ray and toy backends, not slurm"
    ):
        load_spec(spec, overrides={"backend": "slurm", "evaluator": 1})


def test_an_unknown_engine_is_refused_naming_the_known_ones(toy: Any, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    done = CliRunner().invoke(main, ["launch", "--backend", "tyo", str(tmp_path / "train.py")])
    assert done.exit_code == 2
    assert "'tyo' is not one of 'local', 'ray', 'slurm', 'k8s', 'toy'" in done.output
    with pytest.raises(ValueError, match="no launch engine 'tyo'; known: local, ray, slurm, k8s, toy"):
        engines.get("tyo")


def test_an_engine_without_restarts_refuses_them_by_its_own_word(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    done = CliRunner().invoke(main, ["launch", "--backend", "k8s", "--dry-run", "--elastic", "train.py"])
    assert done.exit_code == 2
    assert "--elastic and --max-restarts work with --backend local, ray, slurm; not k8s" in done.output


def test_no_engine_name_is_compared_outside_the_registry() -> None:
    """`backend == "k8s"` and the like are questions for the engine (engines/api.py)."""
    compared = re.compile(r"""backend\s*(==|!=|\bin\b)|["'](local|ray|slurm|k8s)["']\s*(==|!=)""")
    found = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in SRC.rglob("*.py")
        if path != SRC / "launch" / "engines" / "__init__.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if compared.search(line)
    ]
    assert not found, "\n".join(found)
