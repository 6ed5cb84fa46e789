"""Who holds a cache dir now: the gateway on each of its scopes, and the processes whose
command lines name its files.

A gateway holds an flock on ``gateway.lock`` in its cache dir for its whole life (a catalog's
model, on the model's own ``models/ID``), with its pid in the file (``GatewayLock``). Taking
that same lock is how ``gateway cache`` knows that no gateway runs there, and holding it while
it removes is what keeps one from starting meanwhile (a gateway started in that second is
refused, as with any other gateway on the cache dir). Where a gateway runs, only it can say
what it serves: ``listens_on`` ties the lock's pid to the ``--url`` its admin API is asked at,
so that the answer taken for it is never another gateway's.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from loragate.supervisor.process import CacheDirInUse, GatewayLock

_WILDCARDS = {"0.0.0.0", "::"}
_INET = (socket.AF_INET, socket.AF_INET6)


@dataclass
class ScopeLocks:
    """The gateway locks of a cache dir's scopes: each free one taken (until ``release``),
    each held one's gateway pid (0: the lock file does not say), and each one that could not
    be tried with why."""

    taken: list[GatewayLock] = field(default_factory=list)
    running: dict[Path, int] = field(default_factory=dict)
    untried: dict[Path, str] = field(default_factory=dict)

    def release(self) -> None:
        for lock in self.taken:
            lock.release()
        self.taken.clear()


@contextlib.contextmanager
def scope_locks(scopes: Iterable[Path]) -> Iterator[ScopeLocks]:
    """Try each scope's gateway lock; hold the free ones for the block."""
    locks = ScopeLocks()
    try:
        for scope in scopes:
            lock = GatewayLock(scope)
            try:
                lock.acquire()
            except CacheDirInUse:
                locks.running[scope] = _pid_in(lock.path)
            except OSError as exc:  # a cache dir of another user's, read-only to us
                locks.untried[scope] = f"cannot open {lock.path}: {exc.strerror}"
            else:
                locks.taken.append(lock)
        yield locks
    finally:
        locks.release()


def _pid_in(path: Path) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().strip())
    return 0


def listens_on(pid: int, url: str) -> bool | None:
    """Whether process ``pid`` is the server that ``url`` reaches on this machine (it listens
    on the URL's port, at its address or at every address, and the URL's host is this
    machine); None when the process's sockets cannot be seen (another user's)."""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    try:
        sockets = psutil.Process(pid).net_connections(kind="inet")
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return None
    listening = {
        c.laddr.ip for c in sockets if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }
    if not listening:
        return False
    host = _addresses(parts.hostname or "", port)
    if host & listening:
        return True
    return bool(listening & _WILDCARDS) and bool(host) and host <= _local_addresses()


def _addresses(host: str, port: int) -> set[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return set()
    return {str(info[4][0]).split("%")[0] for info in infos}


def _local_addresses() -> set[str]:
    found = {"127.0.0.1", "::1"}
    for addresses in psutil.net_if_addrs().values():
        found |= {a.address.split("%")[0] for a in addresses if a.family in _INET}
    return {a for a in found if _is_ip(a)}


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def processes_naming(paths: Iterable[Path]) -> dict[Path, list[str]]:
    """For each of ``paths``, the running processes whose command line names it or a file in
    it, as ``process PID (NAME)``: an engine serving a model or an adapter from the cache, a
    ``vllm serve`` of a snapshot, whoever started it. This process and those it runs under
    (the shell that typed the path) are not counted."""
    forms = {str(form): path for path in paths for form in (path, path.resolve())}
    if not forms:
        return {}
    alternatives = "|".join(re.escape(form) for form in sorted(forms, key=len, reverse=True))
    # A path ends where a name cannot go on: `/c/demo` is not named by `/c/demo-smollm2`.
    pattern = re.compile(f"(?:{alternatives})(?![\\w.-])")
    me = psutil.Process()
    skipped = {os.getpid(), *(parent.pid for parent in me.parents())}
    found: dict[Path, list[str]] = {}
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        info = proc.info
        if info["pid"] in skipped or not info.get("cmdline"):
            continue
        named = {forms[match.group(0)] for match in pattern.finditer("\0".join(info["cmdline"]))}
        for path in named:
            found.setdefault(path, []).append(f"process {info['pid']} ({info.get('name') or '?'})")
    return found
