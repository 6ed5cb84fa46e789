"""Why a boot failed, read from the engine's log: its root-cause line, and whether another
attempt could fix it by itself."""

from __future__ import annotations

import re
from pathlib import Path

from loragate.supervisor.engine_exit import ExitInfo
from loragate.supervisor.engine_log import tail_lines


class BootFailed(Exception):
    """A boot that did not reach ready; ``permanent`` when another attempt would fail the same
    way (a configuration error: bad flag, too little memory, unsupported model, missing files)."""

    def __init__(self, reason: str, permanent: bool = False) -> None:
        super().__init__(reason)
        self.permanent = permanent


_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b:")
# Lines that only point elsewhere: vLLM's API server says these after the real error.
_WRAPPER_ERRORS = (
    "See root cause above",
    "Engine core initialization failed",
    "Engine process failed to start",
)
_BOOT_BANNER = "===== loragate: engine boot at"
# Start-up errors that another attempt can fix by itself (the next boot removes a stale socket).
_TRANSIENT_ERRORS = ("Address already in use", "EADDRINUSE")


def last_boot_lines(log_path: Path) -> list[str]:
    """The current boot's part of the log's last 400 lines (what failure reports read)."""
    return current_boot(tail_lines(log_path, 400, max_bytes=256 * 1024))


def current_boot(lines: list[str]) -> list[str]:
    """The lines of ``lines`` written since the last boot banner (all of them if none)."""
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].startswith(_BOOT_BANNER):
            return lines[index + 1 :]
    return lines


def root_cause(lines: list[str], limit: int = 600) -> str | None:
    """The engine's own root-cause line: the last ``SomethingError: ...`` line that is not a
    wrapper pointing at another, with the indented lines that continue it (pydantic puts the
    actual reason there). None when the log holds no error line."""
    found: int | None = None
    for index in range(len(lines) - 1, -1, -1):
        line = lines[index]
        if not _ERROR_LINE.search(line):
            continue
        if found is None:
            found = index
        if not any(wrapper in line for wrapper in _WRAPPER_ERRORS):
            found = index
            break
    if found is None:
        return None
    parts = [lines[found].strip()]
    for follow in lines[found + 1 : found + 3]:
        if follow.startswith((" ", "\t")):
            parts.append(follow.strip())
    text = " ".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
