#!/usr/bin/env python
"""Soak the gateway: mixed load, adapter swaps, hostile requests, one engine kill.

See tools/bench/soak.py for what is sent and judged. It starts its own gateway on the
tiny demo (whose adapters answer fixed words, which is how it tells who answered):

.venv/bin/python scripts/soak.py                       # 150 s
.venv/bin/python scripts/soak.py --duration 1200 --concurrency 4   # the 20-minute soak
.venv/bin/python scripts/soak.py --url http://127.0.0.1:8000 \
    --admin-key "$(cat ~/.cache/loragate/admin-token)" --no-kill   # a running tiny-demo gateway

CI runs a 90-second version (tests/integration/test_soak.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/ is not installed

from tools.bench.soak_command import main

if __name__ == "__main__":
    raise SystemExit(main())
