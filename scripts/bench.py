#!/usr/bin/env python
"""loragate side by side with the engine alone and with nginx: see tools/bench/run.py.

.venv/bin/python scripts/bench.py            # demo engine + pure proxy, ~5 minutes
.venv/bin/python scripts/bench.py --quick    # a smoke run
.venv/bin/python scripts/bench.py --url http://gpu-box:8000 --api-key KEY --no-proxy
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/ is not installed

from tools.bench.run import main

if __name__ == "__main__":
    raise SystemExit(main())
