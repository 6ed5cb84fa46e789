"""Runs the engine command it is given, after writing down where it will listen and its key.

The bench gives ``gateway serve`` this as its engine command (``engine_command`` in a config
file): ``python -m tools.bench.engine_tap RECORD_FILE -- python -m vllm.entrypoints...``.
The supervisor appends the engine's flags (``--uds``, ...) and puts the per-boot key in
``VLLM_API_KEY``; the tap writes the socket path (or ``--port``, for engines started by
hand) and the key to RECORD_FILE (created 0600, in the bench's private
temporary directory) so the bench can send the same requests to the engine directly, then
becomes the engine with ``exec``: same pid, so the supervisor's process handling is
untouched. Nothing here is part of the gateway, and nothing in the gateway exposes the
engine's key.

``LORAGATE_BENCH_ENGINE_CPUS=0,1`` pins the engine to those CPUs first.
"""

from __future__ import annotations

import json
import os
import sys


def flag(argv: list[str], name: str) -> str | None:
    for index, arg in enumerate(argv[:-1]):
        if arg == name:
            return argv[index + 1]
    return None


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(
            "usage: python -m tools.bench.engine_tap RECORD_FILE -- ENGINE_ARGV...",
            file=sys.stderr,
        )
        return 2
    record, engine = argv[0], argv[2:]
    port = flag(engine, "--port")
    uds = flag(engine, "--uds")
    fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as handle:
        # The supervisor hands the key over in VLLM_API_KEY (older versions: --api-key).
        key = os.environ.get("VLLM_API_KEY") or flag(engine, "--api-key")
        json.dump({"port": int(port) if port else None, "uds": uds, "api_key": key}, handle)
    cpus = os.environ.pop("LORAGATE_BENCH_ENGINE_CPUS", "")
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    os.execvp(engine[0], engine)
    return 127  # not reached


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
