"""How a boot ended and why: the launcher's exit (waited for without blocking the event loop),
the root-cause line read from the engine's log, and whether another attempt could fix it by
itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from loragate.supervisor.output import BOOT_BANNER, tail_lines


@dataclass(frozen=True)
class ExitInfo:
    returncode: int
    at: float

    def describe(self) -> str:
        # The launcher reports a signal death of the engine as 128 + signal number.
        code = self.returncode
        if code < 0 or code > 128:
            signum = -code if code < 0 else code - 128
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(signum).name}"
        return f"exit code {code}"

    @property
    def is_error_exit(self) -> bool:
        """Exited with an error status of its own, not killed by a signal."""
        return 0 < self.returncode < 128


def exit_future(proc: subprocess.Popen[bytes]) -> asyncio.Future[int]:
    """A future for ``proc``'s exit code, from a daemon thread (never blocks interpreter exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()

    def settle(code: int) -> None:
        if not future.done():
            future.set_result(code)

    def wait() -> None:
        code = proc.wait()
        with contextlib.suppress(RuntimeError):  # the loop may be closed by now
            loop.call_soon_threadsafe(settle, code)

    threading.Thread(target=wait, name=f"engine-wait-{proc.pid}", daemon=True).start()
    return future


class BootFailed(Exception):
    """A boot that did not reach ready; ``permanent`` when another attempt would fail the same
    way (a configuration error: bad flag, too little memory, unsupported model, missing files)."""

    def __init__(self, reason: str, permanent: bool = False) -> None:
        super().__init__(reason)
        self.permanent = permanent


# An exception's own line, as a traceback ends: ``package.module.SomethingError: message``.
_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b:")
# Any line naming an error, for logs whose cause is not a traceback's last line.
_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b:")
# vLLM's record prefix on each line a process logs: "(Worker pid=12) ERROR 12-01 21:18:58
# [multiproc_executor.py:953] ". The worker, the engine core and the API server each write
# their own records (and the API server's last traceback without one).
_RECORD_PREFIX = re.compile(
    r"^\((?:[\w ]+) pid=\d+\)\s+(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+"
    r"\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s?)?"
)
# Errors that only point elsewhere: an engine core or API server raising because a process
# below it failed says this after the real error (which a worker logged above it).
_WRAPPER_ERRORS = re.compile(
    r"root cause|see above|see stack trace|see the (?:log|error)|initialization failed|"
    r"failed to start|Failed core proc",
    re.IGNORECASE,
)
# Start-up errors that another attempt can fix by itself (the next boot removes a stale socket).
_TRANSIENT_ERRORS = ("Address already in use", "EADDRINUSE")


def last_boot_lines(log_path: Path) -> list[str]:
    """The current boot's part of the log's last 400 lines (what failure reports read; from
    the rotated file too when the boot's banner went there)."""
    return current_boot(tail_lines(log_path, 400, max_bytes=256 * 1024))


def current_boot(lines: list[str]) -> list[str]:
    """The lines of ``lines`` written since the last boot banner (all of them if none)."""
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].startswith(BOOT_BANNER):
            return lines[index + 1 :]
    return lines


def root_cause(lines: list[str], limit: int = 600) -> str | None:
    """The engine's own root-cause line, from whichever of its processes logged it.

    The last exception line (a traceback's ``SomethingError: ...``) that is not a wrapper
    pointing at another ("See root cause above", "See stack trace for root cause"), with the
    lines that continue its message (pydantic and transformers put the actual reason there);
    the record prefix each vLLM process writes is left out. Failing any exception line, the last
    line naming an error. None when the log holds no error line.
    """
    bare = [_RECORD_PREFIX.sub("", line) for line in lines]
    found = _last_cause(bare, _EXCEPTION_LINE)
    if found is None:
        found = _last_cause(bare, _ERROR_LINE)
    if found is None:
        return None
    parts = [bare[found].strip()]
    process = _process_of(lines[found])
    after_colon = parts[0].endswith(":")
    following = zip(lines[found + 1 : found + 6], bare[found + 1 : found + 6], strict=True)
    for raw, follow in following:
        if _process_of(raw) != process or not _continues(follow, after_colon):
            break
        parts.append(follow.strip())
    text = " ".join(part for part in parts if part)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _last_cause(lines: list[str], pattern: re.Pattern[str]) -> int | None:
    """The index of the last line matching ``pattern`` that is not a wrapper (else of the
    last wrapper: it is all there is)."""
    wrapper: int | None = None
    for index in range(len(lines) - 1, -1, -1):
        line = lines[index].strip() if pattern is _EXCEPTION_LINE else lines[index]
        if not pattern.search(line):
            continue
        if not _WRAPPER_ERRORS.search(line):
            return index
        if wrapper is None:
            wrapper = index
    return wrapper


def _process_of(line: str) -> str:
    """The vLLM process that wrote ``line`` ("Worker pid=12"), "" for a line without a prefix."""
    return line[1 : line.index(")")] if _RECORD_PREFIX.match(line) else ""


def _continues(line: str, after_colon: bool) -> bool:
    """Whether ``line`` continues an exception's message: indented, or any line after a message
    that ended with a colon; never a traceback frame, a new traceback or an empty line."""
    text = line.strip()
    if not text or text.startswith(('File "', "Traceback", "During handling", "The above ")):
        return False
    if _EXCEPTION_LINE.search(text):
        return False
    return after_colon or line.startswith((" ", "\t"))


def summarize_failure(lines: list[str], limit: int = 600) -> str:
    """The most telling line of an engine log tail: its root cause, else its last line."""
    cause = root_cause(lines, limit)
    if cause is not None:
        return cause
    return lines[-1].strip()[:limit] if lines else "no output"


def exited_during_boot(info: ExitInfo, log_path: Path) -> BootFailed:
    """The failure of a boot whose engine exited before it answered /health: permanent when the
    engine exited with an error of its own and named a cause another attempt would not fix."""
    lines = last_boot_lines(log_path)
    cause = root_cause(lines)
    return BootFailed(
        f"engine exited during start-up ({info.describe()}): {cause or summarize_failure(lines)}",
        permanent=info.is_error_exit
        and cause is not None
        and not any(text in cause for text in _TRANSIENT_ERRORS),
    )
