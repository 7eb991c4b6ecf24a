#!/usr/bin/env bash
# Sets everything up for the tests (scripts/setup_test.sh), then runs the linter and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_test.sh
.venv/bin/ruff check src tests benchmarks examples
.venv/bin/ruff format --check src tests benchmarks examples
.venv/bin/mypy  # the packages listed in pyproject.toml's [tool.mypy]
exec .venv/bin/python -m pytest "$@"
