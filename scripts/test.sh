#!/usr/bin/env bash
# Sets everything up for the tests (scripts/setup_test.sh), then runs the linter, the type checker, the
# docs build and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_test.sh
.venv/bin/ruff check src tests benchmarks examples docs/examples docs/hooks.py
.venv/bin/ruff format --check src tests benchmarks examples docs/examples docs/hooks.py
.venv/bin/mypy  # the packages listed in pyproject.toml's [tool.mypy]
# The docs site (mkdocs.yml): a broken link, page or API reference fails the build.
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"
exec .venv/bin/python -m pytest "$@"
