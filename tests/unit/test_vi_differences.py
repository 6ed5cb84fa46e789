"""docs/vi-sdk.md's difference table is what a side-by-side run observes.

The whole request corpus (``tests/vi_side_by_side/corpus.py``) goes to the real Vi SDK server
and to loragate, each on its own recording backend. Every difference the run sees must be a row
of the table (``tests/vi_side_by_side/differences.py``), every row must have been seen, every
row says why, and the generated part of docs/vi-sdk.md must be the one this run writes
(``python -m tests.vi_side_by_side --write-docs``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vi.deployment.local.server", reason="needs vi-sdk")

from tests.vi_side_by_side.corpus import CASES, PARAMETERS
from tests.vi_side_by_side.differences import DIFFERENCES
from tests.vi_side_by_side.run import (
    DOCS,
    UNLISTED,
    Outcome,
    counts,
    docs_table,
    render_table,
    run_corpus,
    unlisted_report,
    unseen_rows,
)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    return run_corpus(tmp_path_factory.mktemp("vi-corpus"))


def test_the_corpus_covers_both_shapes_streamed_and_not_and_every_parameter() -> None:
    bodies = [case.body for case in CASES if isinstance(case.body, dict)]
    for shape in ("messages", "user_prompt"):
        for stream in (False, True):
            assert any(shape in b and bool(b.get("stream")) is stream for b in bodies)
    names = {case.name for case in CASES}
    for parameter in PARAMETERS:
        for prefix in ("openai", "vi"):
            assert {f"{prefix}-{parameter}", f"{prefix}-{parameter}-stream"} <= names
    assert len(CASES) >= 100


def test_every_difference_the_run_sees_is_a_row_of_the_table(outcomes: list[Outcome]) -> None:
    unlisted = [outcome.case.name for outcome in outcomes if outcome.kind == UNLISTED]
    assert not unlisted, "differences the table does not list:\n" + unlisted_report(outcomes)


def test_every_row_of_the_table_was_seen_in_the_run(outcomes: list[Outcome]) -> None:
    assert unseen_rows(outcomes) == [], "rows no case of the corpus showed (false rows)"


def test_every_row_says_what_each_server_does_and_why() -> None:
    keys = [row.key for row in DIFFERENCES]
    assert len(set(keys)) == len(keys)
    for row in DIFFERENCES:
        for text in (row.vi, row.loragate, row.reason):
            assert text.strip() and "|" not in text and "\n" not in text, row.key


def test_the_docs_table_is_the_one_the_run_writes(
    outcomes: list[Outcome], record_property: Callable[[str, object], None]
) -> None:
    found = counts(outcomes)
    record_property("vi_corpus_counts", found)
    print("vi corpus:", ", ".join(f"{kind} {count}" for kind, count in found.items()))
    written = docs_table(DOCS.read_text(encoding="utf-8"))
    assert written is not None, f"{DOCS} lost its generated table's markers"
    expected = render_table(outcomes)
    diff = "\n".join(
        difflib.unified_diff(
            written.splitlines(), expected.splitlines(), "docs", "run", lineterm=""
        )
    )
    assert written == expected, (
        f"{Path(DOCS).name} and the run disagree; run "
        f"`.venv/bin/python -m tests.vi_side_by_side --write-docs`:\n{diff}"
    )
