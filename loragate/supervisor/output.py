"""The engine's log: the file under the cache dir (rotated by size), its copy on the gateway's
stderr, and reading its last lines for error reports.

The engine writes into a pipe that the gateway reads (``EngineOutput``), not into the file
itself: so its lines can also go where operators look (the gateway's stderr: a terminal,
journald, ``kubectl logs``), and the file can be rotated while the engine runs. Reading the
pipe never waits for stderr: a slow reader there loses lines (counted, and said so), never
the engine's time; the file gets every line.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import sys
import threading
import time
from pathlib import Path
from typing import IO, BinaryIO

from loragate.logs import echo_line

ROTATED_FILES = 3  # engine.log.1 .. engine.log.3 are kept; the oldest goes
BOOT_BANNER = "===== loragate: engine boot at"
# Lines waiting for stderr; past this many, lines are dropped for stderr (counted) instead.
_ECHO_BACKLOG = 4096
# A line longer than this goes to stderr in pieces (it has no end yet: a tqdm bar, say).
_LONGEST_LINE = 16 * 1024
_READ_SIZE = 64 * 1024


def rotated(path: Path, number: int) -> Path:
    return path.with_suffix(f"{path.suffix}.{number}")


class EngineLogFile:
    """The engine's log file, shared by every boot: a banner at each boot's start, and
    rotation once past ``max_bytes`` (at a line's end, while the engine runs too)."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._handle: BinaryIO | None = None
        self._lock = threading.Lock()  # a boot's leftovers may still write as the next begins

    def start_boot(self) -> None:
        with self._lock:
            if self._handle is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._handle = self.path.open("ab", buffering=0)
            if self._handle.tell() > self.max_bytes:
                self._rotate()
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            self._write(f"\n{BOOT_BANNER} {stamp} =====\n".encode())

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._handle is None:
                return
            if self._handle.tell() + len(data) > self.max_bytes:
                # Rotated after the last whole line: a line is never cut across two files.
                end = data.rfind(b"\n") + 1
                if end:
                    self._write(data[:end])
                    self._rotate()
                    data = data[end:]
            self._write(data)

    def _write(self, data: bytes) -> None:
        assert self._handle is not None
        with contextlib.suppress(OSError):  # a full disk loses lines, never the engine
            self._handle.write(data)

    def _rotate(self) -> None:
        assert self._handle is not None
        self._handle.close()
        for number in range(ROTATED_FILES, 1, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(rotated(self.path, number - 1), rotated(self.path, number))
        with contextlib.suppress(FileNotFoundError):
            os.replace(self.path, rotated(self.path, 1))
        self._handle = self.path.open("ab", buffering=0)

    def close(self) -> None:
        with self._lock:
            if self._handle is not None:
                self._handle.close()
                self._handle = None


class EngineOutput:
    """One boot's output pipe, read by a thread into the log file and, when ``to_stderr``,
    queued for another thread that copies it (each line ``loggable``, prefixed) to stderr."""

    def __init__(self, pipe: IO[bytes], log_file: EngineLogFile, *, to_stderr: bool) -> None:
        self._pipe = pipe
        self._file = log_file
        self._echo: queue.Queue[str | None] | None = queue.Queue() if to_stderr else None
        self._partial = ""
        self.dropped = 0  # lines stderr did not get since the last notice (reader thread only)
        self._reader = threading.Thread(target=self._read, name="engine-output", daemon=True)
        self._writer = threading.Thread(
            target=self._copy_to_stderr, name="engine-echo", daemon=True
        )

    def start(self) -> None:
        self._reader.start()
        if self._echo is not None:
            self._writer.start()

    def join(self, timeout: float) -> None:
        """Wait (up to ``timeout`` s) until every line the boot wrote is in the file."""
        self._reader.join(timeout)

    def _read(self) -> None:
        fd = self._pipe.fileno()
        try:
            while data := os.read(fd, _READ_SIZE):
                self._file.write(data)
                if self._echo is not None:
                    self._split(data.decode("utf-8", errors="replace"))
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                self._pipe.close()
            if self._echo is not None:
                if self._partial:
                    self._queue_line(self._partial)
                self._queue_line(None)

    def _split(self, text: str) -> None:
        # A carriage return ends a line here too: a progress bar's updates, one line each.
        *complete, self._partial = re.split(r"\r\n|\r|\n", self._partial + text)
        for line in complete:
            if line:
                self._queue_line(line)
        while len(self._partial) > _LONGEST_LINE:
            self._queue_line(self._partial[:_LONGEST_LINE])
            self._partial = self._partial[_LONGEST_LINE:]

    def _queue_line(self, line: str | None) -> None:
        """Queue ``line`` for stderr, or count it as dropped when the backlog is full; None
        ends the copy. Never waits: only this thread adds, so the backlog stays bounded."""
        assert self._echo is not None
        if line is None:  # the end: the count of what was dropped last, and the sentinel
            if self.dropped:
                self._echo.put_nowait(self._drop_notice())
            self._echo.put_nowait(None)
            return
        if self._echo.qsize() >= _ECHO_BACKLOG - (1 if self.dropped else 0):
            self.dropped += 1
            return
        if self.dropped:
            self._echo.put_nowait(self._drop_notice())
            self.dropped = 0
        self._echo.put_nowait(line)

    def _drop_notice(self) -> str:
        return f"({self.dropped} lines not shown here, stderr was slow: see {self._file.path})"

    def _copy_to_stderr(self) -> None:
        assert self._echo is not None
        while (line := self._echo.get()) is not None:
            with contextlib.suppress(Exception):  # a closed or broken stderr: the file has it
                sys.stderr.write(echo_line("engine", line) + "\n")
                sys.stderr.flush()


def tail_lines(path: Path, count: int = 40, max_bytes: int = 64 * 1024) -> list[str]:
    """The last ``count`` lines of ``path`` (from the last ``max_bytes`` only), or [] if absent;
    continued from the file rotated before it when ``path`` itself holds fewer."""
    lines = _tail_of(path, max_bytes)
    if lines is not None and len(lines[0]) < count and lines[1]:
        earlier = _tail_of(rotated(path, 1), max_bytes)
        if earlier is not None:
            lines = (earlier[0] + lines[0], earlier[1])
    return lines[0][-count:] if lines is not None else []


def _tail_of(path: Path, max_bytes: int) -> tuple[list[str], bool] | None:
    """The lines of ``path``'s last ``max_bytes``, and whether that was the whole file."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return None
    return data.decode("utf-8", errors="replace").splitlines(), size <= max_bytes


# What a vLLM boot is doing, from the last of its log lines that says so (newest first wins).
_BOOT_PHASES = (
    ("Supported tasks", "opening its API"),
    ("init engine (profile, create kv cache", "warmed up, opening its API"),
    ("KV cache", "allocating the KV cache and warming up"),
    ("Loading weights took", "weights loaded, setting up LoRA and the KV cache"),
    ("Starting to load model", "loading the model's weights"),
    ("Loading safetensors checkpoint", "loading the model's weights"),
    ("Initializing a V1 LLM engine", "starting its engine core and workers"),
    ("non-default args", "reading the model's configuration"),
)
_VLLM_PREFIX = re.compile(r"^\(\S+ pid=\d+\)\s+[A-Z]+\s+\S+\s+\S+\s+\[[^\]]*\]\s*")


def boot_phase(lines: list[str]) -> str:
    """A short account of how far an engine boot has come, from its log's last ``lines``."""
    for line in reversed(lines):
        for marker, phase in _BOOT_PHASES:
            if marker in line:
                return phase
    for line in reversed(lines):
        message = _VLLM_PREFIX.sub("", line).strip()
        if message and _VLLM_PREFIX.match(line):
            return message[:120]
    return "starting Python and importing vLLM"
