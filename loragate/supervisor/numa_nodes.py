"""NUMA nodes this process may run on: vLLM's CPU build binds one worker to each."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def numa_node_count() -> int:
    """NUMA nodes with a CPU this process may run on (vLLM's CPU build binds one worker to each)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    nodes = 0
    for cpulist in Path("/sys/devices/system/node").glob("node[0-9]*/cpulist"):
        with contextlib.suppress(OSError, ValueError):
            if _cpu_ids(cpulist.read_text()) & allowed:
                nodes += 1
    return max(nodes, 1)


def _cpu_ids(text: str) -> set[int]:
    ids: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            low, high = part.split("-")
            ids.update(range(int(low), int(high) + 1))
        elif part:
            ids.add(int(part))
    return ids
