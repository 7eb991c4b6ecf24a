#!/usr/bin/env bash
# Creates .venv (if missing) and installs paratrain with what the main job needs (scripts/main.sh:
# examples/digits.py reads scikit-learn's bundled digits). torch is pinned to the CPU build this
# project is tested with; users may run paratrain on any recent torch. The tests' tools and system
# packages are scripts/setup_test.sh's.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -m pip install --quiet --disable-pip-version-check \
        "torch==2.13.0" -e ".[examples]" > .venv/pip.log 2>&1; then
    cat .venv/pip.log
    echo "setup: pip install failed (log above)" >&2
    exit 1
fi
.venv/bin/python -c "import torch, paratrain; print('paratrain', paratrain.__version__, 'torch', torch.__version__)"
