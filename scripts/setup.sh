#!/usr/bin/env bash
# Creates .venv (if missing) and installs paratrain with its development tools (the `dev` extra: test
# tools, docs tools, every optional dependency). torch is pinned to the CPU build this project is tested
# with; users may run paratrain on any recent torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup_slurm.sh  # system packages the Slurm tests need (as root; quick when present)
bash scripts/setup_chromium.sh  # the browser the dashboard tests drive (as root; quick when present)
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -m pip install --quiet --disable-pip-version-check \
        "torch==2.13.0" -e ".[dev]" > .venv/pip.log 2>&1; then
    cat .venv/pip.log
    echo "setup: pip install failed (log above)" >&2
    exit 1
fi
.venv/bin/python -c "import torch, paratrain; print('paratrain', paratrain.__version__, 'torch', torch.__version__)"
