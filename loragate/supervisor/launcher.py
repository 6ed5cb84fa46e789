"""The engine's launcher: a tiny process between the gateway and vLLM that guarantees no orphans.

The gateway spawns ``python -m loragate.supervisor.launcher [--grace S] -- ENGINE_ARGV...`` as
the leader of a new process group. vLLM's EngineCore and Worker processes are spawned into
that group. What ends what, for every way one of them can die:

- the gateway dies (even by SIGKILL): the kernel sends the launcher its parent-death signal
  and the launcher SIGKILLs the whole group at once;
- the launcher dies (even by SIGKILL): the kernel SIGKILLs the engine (its parent-death
  signal), and the gateway sweeps every process of that boot before it spawns the next
  (``EngineSupervisor``, by the boot's ``LORAGATE_ENGINE_TAG``);
- SIGTERM or SIGINT to the launcher: forwarded to the engine for a graceful exit, and the
  group gets SIGKILL if the engine has not exited ``--grace`` seconds later;
- a process of the engine leaves the group, or the session (Ray's driver makes itself a group
  leader, ``os.setpgrp()`` in ``start_reaper`` of ray/_private/services.py, and its raylet,
  GCS server and workers live in that new group; a daemon calls setsid()): the launcher is a child subreaper, so such a process stays under the launcher
  even when its parent dies, and every "kill the group" below kills the launcher's
  descendants as well;
- the engine exits: whatever it left in the group gets SIGKILL at once (vLLM's EngineCore
  and Worker serve nothing without their API server, and a launcher that lingered would keep
  the gateway from seeing the exit: it would blame its health probes instead), and the
  launcher exits with the engine's status (128 + N for a signal N).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import psutil

from loragate.supervisor.process import REPORT_FD, set_child_subreaper, set_parent_death_signal

PARENT_DIED = signal.SIGUSR1
DEFAULT_GRACE = 20.0


def _others_in_group(group: int) -> list[psutil.Process]:
    me = os.getpid()
    members = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == group and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
    return members


def _descendants() -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process().children(recursive=True)
    return []


def end_leftovers(group: int) -> None:
    """SIGKILL every other member of ``group`` and every descendant (adopted ones included).
    No waiting: SIGKILL cannot be refused, and a process with gigabytes to unmap takes
    seconds to go on a busy machine, which the launcher must not spend before exiting (the
    supervisor sweeps the boot again anyway)."""
    for proc in [*_descendants(), *_others_in_group(group)]:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def wait_for_engine(engine: subprocess.Popen[bytes]) -> int:
    """Block until the engine exits; its ``Popen`` return code. Adopted orphans that exit
    meanwhile are reaped on the way, so none lingers as a zombie under the launcher."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)  # PEP 475: retried after a signal handler
        except ChildProcessError:  # pragma: no cover - the engine was reaped elsewhere
            return engine.wait()
        if pid == engine.pid:
            engine.returncode = os.waitstatus_to_exitcode(status)
            return engine.returncode


def _engine_preexec(launcher: int) -> None:
    # In the engine's child, before exec: die with the launcher, whatever kills it.
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != launcher:  # the launcher died before prctl took effect
        os._exit(1)


def parse(argv: list[str]) -> tuple[float, list[str]] | None:
    grace = DEFAULT_GRACE
    if argv[:1] == ["--grace"] and len(argv) >= 2:
        grace = float(argv[1])
        argv = argv[2:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    return (grace, argv) if argv else None


def main(argv: list[str]) -> int:
    parsed = parse(argv)
    if parsed is None:
        print(
            "usage: python -m loragate.supervisor.launcher [--grace SECONDS] -- ENGINE_ARGV...",
            file=sys.stderr,
        )
        return 2
    grace, engine_argv = parsed
    expected_parent = int(os.environ.pop("LORAGATE_PARENT_PID", "0"))
    group = os.getpgrp()
    me = os.getpid()

    def kill_group(signum: int, frame: object) -> None:
        end_leftovers(group)
        os.killpg(group, signal.SIGKILL)

    set_child_subreaper()
    signal.signal(PARENT_DIED, kill_group)
    signal.signal(signal.SIGALRM, kill_group)  # the grace after a forwarded SIGTERM ran out
    set_parent_death_signal(PARENT_DIED)
    # The parent may have died before prctl took effect.
    if expected_parent and os.getppid() != expected_parent:
        os.killpg(group, signal.SIGKILL)

    report = os.environ.pop(REPORT_FD, None)
    engine = subprocess.Popen(engine_argv, preexec_fn=lambda: _engine_preexec(me))
    if report is not None:  # the supervisor learns the API server's pid from us, not a guess
        with contextlib.suppress(OSError, ValueError):
            os.write(int(report), b"%d\n" % engine.pid)
            os.close(int(report))

    def forward(signum: int, frame: object) -> None:
        # os.kill, not Popen.send_signal: that would reap the engine (poll), which only
        # wait_for_engine may do.
        if engine.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine.pid, signum)
        if signal.getitimer(signal.ITIMER_REAL)[0] == 0:
            signal.setitimer(signal.ITIMER_REAL, grace)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = wait_for_engine(engine)
    # The engine is gone; anything it left in our group goes with it, by force if need be.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.setitimer(signal.ITIMER_REAL, 0)
    end_leftovers(group)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
