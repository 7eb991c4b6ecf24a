#!/usr/bin/env bash
# What the tests need beyond scripts/setup.sh: the dev extra (test tools, type checker, docs tools, every
# optional dependency the tests exercise) and, as root on Debian, the system packages some tests
# start (Slurm and munge; the headless browser of the dashboard tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_slurm.sh  # system packages the Slurm tests need (as root; quick when present)
bash scripts/setup_chromium.sh  # the browser the dashboard tests drive (as root; quick when present)
if ! .venv/bin/python -m pip install --quiet --disable-pip-version-check \
        "torch==2.13.0" -e ".[dev]" > .venv/pip-test.log 2>&1; then
    cat .venv/pip-test.log
    echo "setup: pip install of the dev extra failed (log above)" >&2
    exit 1
fi
