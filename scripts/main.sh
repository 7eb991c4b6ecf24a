#!/usr/bin/env bash
# Sets up what the main job needs (scripts/setup.sh), then runs it: a distributed run on local processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/paratrain launch -w 2 -s 1 -- examples/digits.py "$@"
