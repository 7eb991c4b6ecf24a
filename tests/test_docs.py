"""The docs' code runs: the README's example, the tutorials' and the migration guides' scripts
(docs/examples/, included in the pages by pymdownx.snippets), and the front door stays short and
free of lab-notebook words. `mkdocs build --strict` itself runs in scripts/test.sh."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_serve import start_cli

from paratrain.testing import run_job

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
EXAMPLES = DOCS / "examples"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def finals(outcome, pattern: str) -> list[float]:  # noqa: ANN001
    """The figure `pattern` finds in each worker's last line."""
    return [float(re.search(pattern, outcome.lines("worker", r, "stdout")[-1]).group(1)) for r in (0, 1)]


def test_the_readme_is_a_short_front_door_whose_example_is_the_tested_file():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "bash scripts/main.sh" in readme and "bash scripts/test.sh" in readme
    block = re.search(r"```python\n(# train\.py.*?)```\n", readme, re.S)
    assert block is not None and block.group(1) == (EXAMPLES / "train.py").read_text()


def test_no_development_process_words_where_users_and_maintainers_read():
    found = subprocess.run(
        # What git tracks: a local build's egg-info copies an older README and is not the project's.
        ["git", "grep", "-nE", r"stop [0-9]+|in turns|a stop later", "--", "README.md", "docs", "src"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert found.returncode == 1 and found.stdout == "", found.stdout or found.stderr  # 1: no line found


def test_every_snippet_a_page_includes_exists_and_every_docs_example_is_run_here():
    included = set()
    for page in DOCS.rglob("*.md"):
        for path in re.findall(r'--8<-- "([^":]+)(?::[^"]*)?"', page.read_text()):
            assert (ROOT / path).is_file(), f"{page}: {path}"
            included.add(path)
    this_file = Path(__file__).read_text()
    for example in EXAMPLES.glob("*.py"):
        assert f"docs/examples/{example.name}" in included, f"no page includes {example.name}"
        assert f'"{example.name}"' in this_file, f"no test runs {example.name}"


@pytest.mark.timeout(200)
def test_the_first_job_learns_under_dist_sync_on_two_workers():
    outcome = run_job(EXAMPLES / "train.py", workers=2, servers=1, env=ONE_THREAD, timeout_s=180)
    accuracy = finals(outcome, r"accuracy ([0-9.]+)")
    assert accuracy[0] == accuracy[1] >= 0.95, accuracy  # one set of weights, pulled by both


# The "after" of each migration guide: (script, servers, what each worker's last line reports, least).
MIGRATIONS = [
    ("migrate_ddp.py", 0, r"final loss ([0-9.]+)", None),
    ("migrate_horovod.py", 0, r"accuracy ([0-9.]+)", 0.95),
    ("migrate_tf.py", 1, r"accuracy ([0-9.]+)", 0.9),
    ("migrate_paddle.py", 1, r"accuracy ([0-9.]+)", 0.95),
]
NAMES = [m[0] for m in MIGRATIONS]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("script", "servers", "pattern", "least"), MIGRATIONS, ids=[m[0] for m in MIGRATIONS]
)
def test_each_migration_guides_paratrain_script_trains(script, servers, pattern, least):
    outcome = run_job(EXAMPLES / script, workers=2, servers=servers, env=ONE_THREAD, timeout_s=180)
    figures = finals(outcome, pattern)
    if least is None:  # a regression to y = x @ w + 0.5: the loss goes to about zero
        assert all(f < 0.01 for f in figures) and figures[0] == figures[1], figures
    else:
        assert all(f >= least for f in figures), figures


def _post(url: str, rows: list[list[float]]) -> dict:
    body = json.dumps({"inputs": rows}).encode()
    request = urllib.request.Request(url + "/predict", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.load(reply)


@pytest.mark.timeout(300)
def test_the_serving_tutorial_trains_serves_and_answers(tmp_path):
    pytest.importorskip("uvicorn")
    import torch

    from paratrain.serve import load

    model_file = EXAMPLES / "serving_model.py"
    ckpt = str(tmp_path / "ckpt")
    outcome = run_job(model_file, workers=2, servers=1, args=[ckpt], env=ONE_THREAD, timeout_s=180)
    assert all("trained 64 steps" in outcome.lines("worker", r, "stdout")[-1] for r in (0, 1))
    server, url = start_cli("--model", f"{model_file}:make_model", "--input", "inputs:float32:20", ckpt)
    try:
        client = subprocess.run(
            [sys.executable, str(EXAMPLES / "serving_client.py"), url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert client.returncode == 0, client.stderr
        assert "classes [1, 0]" in client.stdout, client.stdout  # the rule: the sign of the first ten
        # The answer is the trained model's: the same outputs from the checkpoint loaded here.
        sys.path.insert(0, str(EXAMPLES))
        try:
            import serving_model
        finally:
            sys.path.remove(str(EXAMPLES))
        model = serving_model.make_model()
        load(ckpt, model)
        rows = [[0.5] * 20, [-0.5] * 20]
        with torch.no_grad():
            expected = model(torch.tensor(rows)).tolist()
        assert torch.allclose(torch.tensor(_post(url, rows)["outputs"]), torch.tensor(expected), atol=1e-5)
    finally:
        server.terminate()
        server.wait(60)
