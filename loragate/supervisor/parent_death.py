"""Linux parent-death signal: the kernel signals us when the process that spawned us dies."""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` when our parent exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0


def set_child_subreaper() -> bool:
    """Adopt our orphaned descendants (Linux >= 3.4): a process whose parent dies is
    reparented to us instead of to init, so it stays in our tree even if it left our process
    group or session. False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
