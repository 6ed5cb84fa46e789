"""Logging set-up: readable lines by default, JSON lines with ``--log-json``; and what may be
written in a log line at all.

Log lines quote what clients send (paths, model names, request ids) and what the engine
prints. A client string holding a line feed would start a line of its own in the log, the
``/admin/logs`` tail and the status page (a forged entry), and an ANSI escape would recolour
or rewrite the terminal of whoever reads it; so every line written goes through ``loggable``:
control characters become visible escapes (``printable``) and the secrets given on the
command line (``hide_secrets``) become ``***``. A URL a user gave (an adapter's source, a
manifest's or an upstream's address) may carry its own credentials: messages that quote one
pass it through ``redact`` (one URL) or ``redact_urls`` (every URL in a text).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlsplit

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
HIDDEN = "***"
# C0 (CR, LF, tab, ESC...), DEL and C1; and the two Unicode line breaks ``str.splitlines``
# also splits on (the log tail does).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Shorter values are not hidden: replacing every "1" in a log would hide more than the secret.
_MIN_SECRET_LENGTH = 4
_secrets: set[str] = set()
# Whether ``configure_logging`` chose JSON lines: the lines copied from the engine's output
# to stderr (``echo_line``) take the same form as the gateway's own.
_json_lines = False
# The ids of the request being served (the gateway sets them as it admits one): every JSON
# line written for it carries them, not only the access log's.
request_ids: ContextVar[Mapping[str, str] | None] = ContextVar("loragate_log_ids", default=None)


def _escape(match: re.Match[str]) -> str:
    char = match.group(0)
    named = _NAMED_ESCAPES.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with control characters written as escapes (``\\n``, ``\\x1b``): one line,
    and no terminal escapes. A backslash is left alone, so escaping twice changes nothing."""
    return _CONTROL.sub(_escape, text)


def hide_secrets(values: Iterable[str]) -> None:
    """From now on, ``without_secrets`` (and so every log line) shows these values as ``***``."""
    _secrets.update(value for value in values if len(value) >= _MIN_SECRET_LENGTH)


def without_secrets(text: str) -> str:
    for secret in sorted(_secrets, key=len, reverse=True):  # a secret inside another: the longer
        if secret in text:
            text = text.replace(secret, HIDDEN)
    return text


def loggable(text: str) -> str:
    """``text`` as a log line, the ``/admin/logs`` tail or the status page may show it."""
    return printable(without_secrets(text))


def loggable_in(value: Any) -> Any:
    """A JSON-like value (``/health``, ``/admin/engine``: the status page and ``gateway
    status`` show them) with ``loggable`` applied to each string in it."""
    if isinstance(value, str):
        return loggable(value)
    if isinstance(value, dict):
        return {key: loggable_in(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [loggable_in(item) for item in value]
    return value


def redact(url: str) -> str:
    """``url`` for logs, errors and the API: user:password@ and the query string (where
    signed URLs carry their credentials) become ``***``, so one can tell they were there."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:  # a malformed port or IPv6 host: show nothing of the address part
        return f"{url.split(':', 1)[0]}://***"
    if ":" in host:
        host = f"[{host}]"
    userinfo = "***@" if "@" in parts.netloc else ""
    query = "?***" if parts.query else ""
    return f"{parts.scheme}://{userinfo}{host}{port}{parts.path}{query}"


# A URL in prose: up to whitespace or a quote, less trailing punctuation.
_URL = re.compile(r"(?i)\bhttps?://[^\s'\"<>]*[^\s'\"<>.,;:!?)\]]")


def redact_urls(text: str) -> str:
    """``text`` with every http(s) URL in it redacted (see ``redact``): for messages that
    may quote a source."""
    return _URL.sub(lambda match: redact(match.group(0)), text)


class SafeFormatter(logging.Formatter):
    """A formatter whose message is ``loggable``; a traceback keeps its lines, each escaped."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = loggable(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: logging._SysExcInfoType) -> str:
        return _each_line_loggable(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _each_line_loggable(super().formatStack(stack_info))


def _each_line_loggable(text: str) -> str:
    return "\n".join(loggable(line) for line in text.split("\n"))


def _timestamp(created: float, msecs: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(msecs):03d}Z"


class JsonFormatter(SafeFormatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": _timestamp(record.created, record.msecs),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": loggable(record.getMessage()),
        }
        for key in (
            "request_id",
            "trace_id",
            "model",
            "version",
            "status",
            "prompt_tokens",
            "completion_tokens",
            "duration_ms",
        ):
            value = getattr(record, key, None)
            if value is not None:
                entry[key] = loggable(value) if isinstance(value, str) else value
        for key, value in (request_ids.get() or {}).items():
            entry.setdefault(key, loggable(value))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def echo_line(source: str, text: str) -> str:
    """A line another process printed (the engine's), as the gateway's stderr shows it: after
    ``source | ``, or with ``--log-json`` as a JSON line whose logger is ``source``."""
    if not _json_lines:
        return f"{source} | {loggable(text)}"
    now = time.time()
    message = {"ts": _timestamp(now, (now % 1) * 1000), "level": "info", "logger": source}
    return json.dumps({**message, "message": loggable(text)})


def configure_logging(level: str = "info", as_json: bool = False) -> None:
    global _json_lines
    _json_lines = as_json
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if as_json else SafeFormatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("httpx").setLevel(logging.WARNING)
