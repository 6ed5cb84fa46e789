"""Progress of a long call, shown while it runs: ``gateway adapters add``, ``gateway pull``.

The gateway keeps one record per adapter add (stage, bytes, percent: see
``loragate.fetching.progress``) and serves it at ``GET /admin/adapters/{name}``; the status
page shows the same record. While the ``PUT`` runs in a thread, this polls that record and
prints each change on stderr: one line per stage, and the download's percent on one
rewritten line when stderr is a terminal.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

POLL_SECONDS = 0.5


def progress_line(record: dict[str, Any] | None) -> str | None:
    """What to show for an add's progress record; None before it starts or once it ended."""
    if not record or record.get("finished"):
        return None
    stage = str(record.get("stage", ""))
    if record.get("steps_total"):  # a dequantization's tensors
        done, steps = int(record.get("steps_done") or 0), int(record["steps_total"])
        return f"  {stage} {record.get('percent') or 0:.0f}% ({done} of {steps})"
    if stage != "download":
        return f"  {stage}..."
    done, total = int(record.get("bytes_done") or 0), record.get("bytes_total")
    if total:
        return f"  download {record.get('percent', 0):.0f}% ({_mib(done)} of {_mib(int(total))})"
    return f"  download {_mib(done)}" if done else "  download..."


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def run_showing_progress(
    call: Callable[[], Any],
    poll: Callable[[], dict[str, Any] | None],
    started_at: float,
    echo: Callable[[str], None],
) -> Any:
    """``call()`` in a thread; meanwhile ``poll()`` the add's record every ``POLL_SECONDS``
    and ``echo`` each change ("" at the end, once anything was shown). Whatever ``call``
    raises is raised here."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # typer.Exit included: re-raised in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="admin-call", daemon=True)
    thread.start()
    shown: str | None = None
    while True:
        thread.join(POLL_SECONDS)
        if not thread.is_alive():
            break
        try:
            record = poll()
        except Exception:  # progress is a courtesy: the call's own answer is what counts
            continue
        if record is not None and float(record.get("started_at") or 0) < started_at - 1:
            record = None  # an earlier add of the same name
        line = progress_line(record)
        if line is not None and line != shown:
            echo(line)
            shown = line
    if shown is not None:
        echo("")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def stderr_echo(line: str) -> None:
    """On a terminal, each change rewrites one line (ended by ""); elsewhere, a line each."""
    if sys.stderr.isatty():
        sys.stderr.write("\r\x1b[2K" + line if line else "\n")
        sys.stderr.flush()
    elif line:
        sys.stderr.write(line + "\n")
