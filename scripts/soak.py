#!/usr/bin/env python
"""Soak the gateway: mixed load, adapter swaps and one engine kill; see loragate/bench/soak.py.

.venv/bin/python scripts/soak.py                       # its own gateway on the demo, 150 s
.venv/bin/python scripts/soak.py --duration 600 --concurrency 8
.venv/bin/python scripts/soak.py --url http://127.0.0.1:8000 --admin-key KEY --no-kill
"""

from loragate.bench.soak import main

if __name__ == "__main__":
    raise SystemExit(main())
