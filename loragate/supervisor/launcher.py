"""The engine's launcher: a tiny process between the gateway and vLLM that guarantees no orphans.

The gateway spawns ``python -m loragate.supervisor.launcher -- ENGINE_ARGV...`` as the leader of
a new process group. The launcher asks the kernel for a signal when the gateway dies (even by
SIGKILL), starts the engine in its own group, and on that signal kills the whole group at once.
vLLM's EngineCore and Worker processes are spawned into that group, so nothing survives.
A normal stop (SIGTERM from the gateway) is forwarded to the engine for a graceful exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from loragate.supervisor.parent_death import set_parent_death_signal

PARENT_DIED = signal.SIGUSR1


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("usage: python -m loragate.supervisor.launcher -- ENGINE_ARGV...", file=sys.stderr)
        return 2
    expected_parent = int(os.environ.pop("LORAGATE_PARENT_PID", "0"))
    group = os.getpgrp()

    def kill_group(signum: int, frame: object) -> None:
        os.killpg(group, signal.SIGKILL)

    signal.signal(PARENT_DIED, kill_group)
    set_parent_death_signal(PARENT_DIED)
    # The parent may have died before prctl took effect.
    if expected_parent and os.getppid() != expected_parent:
        os.killpg(group, signal.SIGKILL)

    engine = subprocess.Popen(argv)

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            engine.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        try:
            code = engine.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for clarity
            time.sleep(0.01)
    # The engine is gone; anything it left in our group goes with it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(group, signal.SIGTERM)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
