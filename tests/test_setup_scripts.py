"""The set-up scripts: the main job's installs only what the main job needs; the tests' the rest."""

from __future__ import annotations

import re
from pathlib import Path

SCRIPTS = Path(__file__).parent.parent / "scripts"


def _chain(name: str) -> dict[str, str]:
    """The text of `name` and of every script it runs with `bash scripts/...`, by file name."""
    texts: dict[str, str] = {}
    todo = [name]
    while todo:
        current = todo.pop()
        if current not in texts:
            texts[current] = (SCRIPTS / current).read_text()
            todo += re.findall(r"^\s*(?:exec )?bash scripts/([\w.]+\.sh)", texts[current], re.MULTILINE)
    return texts


def _extras(texts: dict[str, str]) -> set[str]:
    return {extra for text in texts.values() for extra in re.findall(r'-e "\.\[([\w,-]+)\]"', text)}


def test_the_main_jobs_set_up_installs_only_what_the_main_job_needs():
    texts = _chain("main.sh")
    assert "setup.sh" in texts
    assert not {"setup_slurm.sh", "setup_chromium.sh", "setup_test.sh"} & texts.keys(), sorted(texts)
    assert not any("apt-get" in text for text in texts.values())
    assert _extras(texts) == {"examples"}


def test_the_tests_set_up_installs_the_dev_extra_and_the_system_packages():
    texts = _chain("test.sh")
    assert {"setup.sh", "setup_test.sh", "setup_slurm.sh", "setup_chromium.sh"} <= texts.keys()
    assert "dev" in _extras(texts)
