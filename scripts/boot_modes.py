#!/usr/bin/env python3
"""An engine boot in each engine_boot_mode, spawn to /health: see tools/bench/boot_modes.py.

.venv/bin/python scripts/boot_modes.py                 # the tiny demo base, 2 boots a mode
.venv/bin/python scripts/boot_modes.py --runs 3 --model DIR
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/ is not installed

from tools.bench.boot_modes import main

if __name__ == "__main__":
    raise SystemExit(main())
