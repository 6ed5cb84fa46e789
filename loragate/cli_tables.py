"""The house table style of the CLI's reports (``gateway status``, ``plan``, ``cache``): plain
columns two spaces apart as ``docker ps`` and ``ollama ps`` print them, a reason wrapped beneath
the row it explains, each cell one word (``-`` for nothing), and no line wider than a person
reads comfortably, however wide the terminal."""

from __future__ import annotations

import shutil
import textwrap
from typing import Any

WIDEST = 100  # past this, lines get hard to read however wide the terminal
GAP = "  "


def terminal_width() -> int:
    """The width to print at: the terminal's, at most ``WIDEST``."""
    return min(shutil.get_terminal_size().columns, WIDEST)


def columns(header: list[str], rows: list[list[str]]) -> list[str]:
    """``header`` and ``rows`` left-aligned in columns two spaces apart; the last column is
    not padded, so a long source or path only lengthens its own line."""
    widths = [max(len(str(cells[i])) for cells in [header, *rows]) for i in range(len(header))]
    return [
        GAP.join(str(cell).ljust(w) for cell, w in zip(cells, widths, strict=True)).rstrip()
        for cells in [header, *rows]
    ]


def beneath(text: str, width: int, indent: str = "  ") -> list[str]:
    """A reason or an error, under the row it explains: wrapped, never cut (it is what the
    operator acts on), its later lines two spaces further in than its first."""
    return textwrap.wrap(
        " ".join(text.split()),
        width=max(width, 40),
        initial_indent=indent,
        subsequent_indent=indent + "  ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def count(value: Any) -> str:
    return "-" if value is None else str(value)


def duration(seconds: Any) -> str:
    """``45s``, ``12m``, ``2h13m``, ``3d4h``: as ``docker ps`` says how long, in one word."""
    if seconds is None:
        return "-"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600}h"


def size(nbytes: Any) -> str:
    """``1.5 GiB``, ``300 MiB``: memory, in one word (``-`` for none)."""
    if not nbytes:
        return "-"
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.1f} GiB"
    return f"{nbytes / (1 << 20):.0f} MiB"
