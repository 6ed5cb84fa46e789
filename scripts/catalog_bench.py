#!/usr/bin/env python3
"""A two-model catalog per engine_boot_mode: boot, a cold model's first token, and the same
while another model is evicted; see tools/bench/catalog_bench.py.

.venv/bin/python scripts/catalog_bench.py               # the tiny demo base, 2 runs a mode
.venv/bin/python scripts/catalog_bench.py --model DIR_A --model DIR_B
.venv/bin/python scripts/catalog_bench.py --quick       # stand-in engines, a smoke run
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/ is not installed

from tools.bench.catalog_bench import main

if __name__ == "__main__":
    raise SystemExit(main())
