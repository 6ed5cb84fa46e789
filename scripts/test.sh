#!/usr/bin/env bash
# Quick start, command 2: set everything up and run the whole test suite (lint, types, unit
# tests, and integration tests against a real vLLM engine serving the demo model).
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not engine".
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
echo "==> building the demo models and adapters (cached after the first run)"
.venv/bin/python -m loragate.demo.build          # the tiny test model: seconds
.venv/bin/python -m loragate.demo.build_smollm   # the real demo: a few minutes the first time
echo "==> ruff"
.venv/bin/ruff check loragate tools tests scripts
.venv/bin/ruff format --check loragate tools tests scripts
echo "==> mypy"
.venv/bin/mypy
echo "==> pytest"
exec .venv/bin/pytest -p no:cacheprovider --durations=25 "$@"
