"""Hostile names, paths and arguments through every engine's dry run: the generated sbatch script
passes `bash -n`, hands srun exactly the values given, and runs none of them; the manifests carry
them exactly (Kubernetes' `$(VAR)` escaped); what no script can carry is refused naming the field.
Every value goes through one function, launch/quoting.py."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from paratrain.launch.cli import main
from paratrain.launch.quoting import quote


def hostile(tmp_path: Path) -> list[str]:
    """Words that run `touch PWNED` if any shell, sbatch or Kubernetes ever expands them."""
    pwned = tmp_path / "PWNED"
    return [
        f"$(touch {pwned})",
        f"`touch {pwned}`",
        f"a'; touch {pwned}; echo '",
        f'"; touch {pwned}; echo "',
        f"line one\ntouch {pwned}",
        "$(VAR) ${HOME} $HOME # not a comment",
        "",
    ]


@pytest.fixture
def hostile_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory whose name, like its script's, holds quotes, `$()` and backticks."""
    folder = tmp_path / 'it\'s $(touch PWNED) `touch PWNED` "q" #c'
    folder.mkdir()
    (folder / "train $(x).py").write_text("print('hi')\n")
    monkeypatch.chdir(folder)
    return folder


@pytest.mark.parametrize("into", ["bash", "sbatch", "k8s"])
def test_a_nul_byte_is_refused_naming_the_field(into: str) -> None:
    with pytest.raises(ValueError, match=r"args\[3\] holds a NUL byte"):
        quote("a\0b", into, "args[3]")  # type: ignore[arg-type]


def test_slurm_dry_run_gives_srun_exactly_the_values_and_runs_none(hostile_dir: Path, tmp_path: Path) -> None:
    args = hostile(tmp_path)
    done = CliRunner().invoke(main, ["launch", "--backend", "slurm", "--dry-run", "train $(x).py", *args])
    assert done.exit_code == 0, done.output
    script = done.stdout
    syntax = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr
    output = next(line for line in script.splitlines() if line.startswith("#SBATCH --output="))
    assert shlex.split(output.split("=", 1)[1]) == [str(hostile_dir / "paratrain-train___x_-%j.out")]
    argv = _run_with_fake_slurm(script, tmp_path)
    assert argv[-len(args) - 1 :] == [str(hostile_dir / "train $(x).py"), *args]
    assert not list(tmp_path.rglob("PWNED"))


def _run_with_fake_slurm(script: str, tmp_path: Path) -> list[str]:
    """Runs the batch script as Slurm would on its first node, with an srun that only records the
    command it was given (NUL-separated) and a scontrol that names this machine."""
    bin_dir = tmp_path / "fake-slurm"
    bin_dir.mkdir()
    record = tmp_path / "srun-argv"
    (bin_dir / "srun").write_text(f"#!/bin/bash\nprintf '%s\\0' \"$@\" > {shlex.quote(str(record))}\n")
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "localhost"}
    env["SLURM_JOB_ID"] = "1"
    done = subprocess.run(["bash", "-s"], input=script, text=True, capture_output=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return record.read_text().split("\0")[:-1]


def test_slurm_refuses_a_folder_that_no_sbatch_line_can_carry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "two\nlines"
    folder.mkdir()
    (folder / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(folder)
    done = CliRunner().invoke(main, ["launch", "--backend", "slurm", "--dry-run", "train.py"])
    assert done.exit_code == 2, done.output
    assert "output holds a line break, which an #SBATCH line cannot carry" in done.output


def test_k8s_dry_run_carries_the_values_exactly(hostile_dir: Path, tmp_path: Path) -> None:
    args = hostile(tmp_path)
    done = CliRunner().invoke(main, ["launch", "--backend", "k8s", "--dry-run", "train $(x).py", *args])
    assert done.exit_code == 0, done.output
    jobs = [m for m in yaml.safe_load_all(done.stdout) if m["kind"] == "Job"]
    for job in jobs:
        command = job["spec"]["template"]["spec"]["containers"][0]["command"]
        assert [word.replace("$$", "$") for word in command] == ["python", "-u", "train $(x).py", *args]
    assert not list(tmp_path.rglob("PWNED"))


@pytest.mark.parametrize("backend", ["local", "ray", "slurm", "k8s"])
def test_submit_dry_run_of_a_hostile_spec_runs_nothing(
    backend: str, hostile_dir: Path, tmp_path: Path
) -> None:
    args = hostile(tmp_path)
    spec = {
        "name": "demo",
        "entry": {"script": "train $(x).py", "args": args},
        "output_dir": str(hostile_dir / "out $(y)") if backend != "k8s" else "/out/$(y) `z`",
        "env": {"HOSTILE": args[0], "MULTI": args[4]},
        "k8s": {"output_pvc": "claim"},
    }
    spec_file = hostile_dir / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    done = CliRunner().invoke(main, ["submit", "--dry-run", "--backend", backend, str(spec_file)])
    assert done.exit_code == 0, done.output
    if backend == "slurm":
        syntax = subprocess.run(["bash", "-n"], input=done.stdout, text=True, capture_output=True)
        assert syntax.returncode == 0, syntax.stderr
    if backend == "k8s":
        assert len(list(yaml.safe_load_all(done.stdout))) >= 4
    assert not list(tmp_path.rglob("PWNED"))
    assert not (hostile_dir / "out $(y)").exists()  # a dry run makes nothing


def test_the_sbatch_directive_reader_reads_back_what_quote_wrote() -> None:
    """sbatch strips quotes as a shell does (quoting.py): shlex.split stands in for it here."""
    for value in ["/a b/c-%j.out", "it's", 'say "hi"', "$(x) `y` #z"]:
        assert shlex.split(quote(value, "sbatch", "output")) == [value]
