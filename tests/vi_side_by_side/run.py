"""The whole corpus through both servers, each case's verdict, and the table they make.

``run_corpus`` sends every case of ``corpus`` to the Vi SDK's server and to loragate;
``classify`` lets each row of ``differences`` settle its difference and says what is left;
``render_table`` writes the generated part of docs/vi-sdk.md from the verdicts.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from vi.deployment.local import server as vi_server

import loragate
from tests.vi_side_by_side.corpus import CASES, PNG, Case
from tests.vi_side_by_side.differences import DIFFERENCES
from tests.vi_side_by_side.recognise import Seen
from tests.vi_side_by_side.servers import RecordingViBackend, fill, observe, serving, serving_files

IDENTICAL, LISTED, REFUSED, UNLISTED = "identical", "listed", "refused", "unlisted"


@dataclass
class Outcome:
    """One case's verdict: ``IDENTICAL`` (the same status, body and backend calls; headers
    apart only as the rows in ``keys`` say), different with every difference listed
    (``LISTED``, or ``REFUSED`` when loragate's answer is a 4xx), or ``UNLISTED``, with what
    is left of the two observations once the rows in ``keys`` settled theirs."""

    case: Case
    kind: str
    keys: list[str]
    vi: Seen
    lg: Seen


def classify(case: Case, sent: Any, vi: Seen, lg: Seen) -> Outcome:
    answer = ("status", "body", "calls")
    same_answer = all(vi[aspect] == lg[aspect] for aspect in answer)
    refused = 400 <= lg["status"] < 500
    vi, lg = copy.deepcopy(vi), copy.deepcopy(lg)
    sent = sent if isinstance(sent, dict) else {}
    keys = [row.key for row in DIFFERENCES if vi != lg and row.explain(sent, vi, lg)]
    if vi != lg:
        return Outcome(case, UNLISTED, keys, vi, lg)
    return Outcome(case, IDENTICAL if same_answer else REFUSED if refused else LISTED, keys, vi, lg)


def run_corpus(root: Path, cases: list[Case] = CASES) -> list[Outcome]:
    """Every case sent to the Vi SDK's server and to loragate, each on its own recording
    backend; loragate reads local images from ``root/media`` and fetches loopback URLs (as a
    Vi user moving over would set it up), so the media forms are served, not refused."""
    media, outside = root / "media", root / "outside"
    for folder in (media, outside):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "pic.png").write_bytes(PNG)
    (media / "notes.txt").write_text("not an image\n")
    vi_backend, lg_backend = RecordingViBackend(), RecordingViBackend()
    vi_app = vi_server.create_server(backend=vi_backend)
    lg_app = loragate.create_server(
        backend=lg_backend,
        cache_dir=root / "cache",
        allowed_media_dir=media,
        private_image_urls=True,
    )
    outcomes = []
    with (
        serving_files(media) as media_url,
        serving(vi_app) as vi_url,
        serving(lg_app) as lg_url,
        httpx.Client(timeout=30) as client,
    ):
        places = {"MEDIA_URL": media_url, "MEDIA_DIR": str(media), "OUTSIDE_DIR": str(outside)}
        for case in cases:
            vi = observe(client, vi_url, case, vi_backend, places)
            lg = observe(client, lg_url, case, lg_backend, places)
            outcomes.append(classify(case, fill(case.body, places), vi, lg))
    return outcomes


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    kinds = [outcome.kind for outcome in outcomes]
    return {"corpus": len(kinds), **{kind: kinds.count(kind) for kind in KINDS}}


KINDS = (IDENTICAL, LISTED, REFUSED, UNLISTED)


def unlisted_report(outcomes: list[Outcome]) -> str:
    """What each unlisted difference is: the aspects still apart, Vi's then loragate's."""
    lines = []
    for outcome in outcomes:
        if outcome.kind != UNLISTED:
            continue
        lines.append(f"{outcome.case.name} (rows that applied: {', '.join(outcome.keys) or '-'})")
        for aspect in ("status", "headers", "body", "calls"):
            if outcome.vi[aspect] != outcome.lg[aspect]:
                lines.append(f"  {aspect} vi: {json.dumps(outcome.vi[aspect])[:600]}")
                lines.append(f"  {aspect} lg: {json.dumps(outcome.lg[aspect])[:600]}")
    return "\n".join(lines)


def unseen_rows(outcomes: list[Outcome]) -> list[str]:
    seen = {key for outcome in outcomes for key in outcome.keys}
    return [row.key for row in DIFFERENCES if row.key not in seen]


# ----- the table in docs/vi-sdk.md ----------------------------------------------------------

DOCS = Path(__file__).resolve().parents[2] / "docs" / "vi-sdk.md"
BEGIN = "<!-- vi-differences: written by `python -m tests.vi_side_by_side --write-docs` -->"
END = "<!-- /vi-differences -->"


def render_table(outcomes: list[Outcome]) -> str:
    """The generated part of docs/vi-sdk.md: the counts, then one row per difference with the
    cases it was seen in."""
    n = counts(outcomes)
    lines = [
        BEGIN,
        f"The last run: {n['corpus']} requests; {n[IDENTICAL]} identical, {n[LISTED]} "
        f"different and listed, {n[REFUSED]} different and refused.",
        "",
        "| difference | Vi SDK server | loragate | why | seen in |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in DIFFERENCES:
        names = [o.case.name for o in outcomes if row.key in o.keys]
        shown = ", ".join(f"`{name}`" for name in names[:3]) + (", ..." if len(names) > 3 else "")
        count = f"{len(names)} case{'s' if len(names) != 1 else ''}"
        lines.append(
            f"| `{row.key}` | {row.vi} | {row.loragate} | {row.reason} | {count}: {shown} |"
        )
    return "\n".join([*lines, END])


def docs_table(text: str) -> str | None:
    start, end = text.find(BEGIN), text.find(END)
    return text[start : end + len(END)] if 0 <= start < end else None
