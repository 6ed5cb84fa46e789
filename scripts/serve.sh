#!/usr/bin/env bash
# Quick start, command 1: set everything up, build the demo model and adapters (cached), and
# serve them on http://127.0.0.1:8000. Extra arguments go to `gateway serve`, e.g.
#   scripts/serve.sh --model /path/to/model --lora mine=/path/to/adapter
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/gateway serve "$@"
