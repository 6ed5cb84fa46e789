"""How long to wait before booting the engine again after a failure."""

from __future__ import annotations

import random


def restart_delay(failures: int, base: float, cap: float) -> float:
    """Exponential in the recent ``failures`` (``base``, twice that, ... up to ``cap``), with
    ±20 % jitter so that several gateways on one machine do not restart in step."""
    delay = min(base * 2 ** (failures - 1), cap)
    return delay * random.uniform(0.8, 1.2)
