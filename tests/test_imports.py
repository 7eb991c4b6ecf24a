"""What a job's processes import: every process of every job imports paratrain afresh, so a library
imported where it is not used costs each of them its import time (numba about 0.25 CPU-s, scikit-learn
about 1 CPU-s). Optional and special-purpose libraries are imported where they are used."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "paratrain"

# What a worker, a server and the scheduler of a dense job import, besides the standard library.
EVERY_PROCESS = (
    "paratrain.node",
    "paratrain.train",
    "paratrain.data",
    "paratrain.collective",
    "paratrain.kvstore.worker.client",
    "paratrain.kvstore.server.server",
    "paratrain.metrics",
    "paratrain.checkpoint",
)
NOT_IMPORTED = ("numba", "sklearn", "scipy", "mlflow", "wandb", "tensorboard", "lightning", "transformers")


def test_the_modules_every_job_process_imports_leave_the_special_purpose_libraries_alone() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {EVERY_PROCESS!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({NOT_IMPORTED!r})))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
