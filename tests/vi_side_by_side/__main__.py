"""``python -m tests.vi_side_by_side``: run the corpus through both servers and report;
``--write-docs`` writes the table into docs/vi-sdk.md when every difference is listed."""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

from tests.vi_side_by_side.run import (
    BEGIN,
    DOCS,
    END,
    UNLISTED,
    counts,
    docs_table,
    render_table,
    run_corpus,
    unlisted_report,
    unseen_rows,
)


def main(argv: list[str]) -> int:
    logging.disable(logging.CRITICAL)  # the Vi server logs every failure it answers
    with tempfile.TemporaryDirectory() as root:
        outcomes = run_corpus(Path(root))
    print(", ".join(f"{kind}: {count}" for kind, count in counts(outcomes).items()))
    if any(o.kind == UNLISTED for o in outcomes) or unseen_rows(outcomes):
        print(unlisted_report(outcomes))
        print("rows no case needed:", ", ".join(unseen_rows(outcomes)) or "none")
        return 1
    if "--write-docs" in argv:
        text = DOCS.read_text(encoding="utf-8")
        current = docs_table(text)
        if current is None:
            print(f"{DOCS} has no {BEGIN} ... {END} block to write into")
            return 1
        DOCS.write_text(text.replace(current, render_table(outcomes)), encoding="utf-8")
        print(f"wrote the table into {DOCS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
