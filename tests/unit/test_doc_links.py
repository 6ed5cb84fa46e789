"""Every relative link in the README and docs/*.md resolves: to a file that exists and, for
a ``#anchor``, to a heading of that page (GitHub's anchor for it)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.readme_blocks import ROOT, pages

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose(path: Path) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in prose(path):
        match = _HEADING.match(line)
        if match:
            base = anchor(match.group(1))
            name, n = base, 0
            while name in found:  # GitHub numbers repeated headings: name, name-1, ...
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def broken_links(path: Path) -> list[str]:
    """``path``'s relative links whose file or heading is missing, one line each."""
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    broken = []
    for line in prose(path):
        for target in _LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, fragment = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{name}: {target} (no such file)")
            elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
                broken.append(f"{name}: {target} (no such heading)")
    return broken


def test_anchor_follows_githubs_rules() -> None:
    assert anchor("LoRA on vLLM's CPU build") == "lora-on-vllms-cpu-build"
    assert anchor("Embedding: any ASGI server, or mounted in a larger app") == (
        "embedding-any-asgi-server-or-mounted-in-a-larger-app"
    )
    assert anchor("The `gateway adapters` commands") == "the-gateway-adapters-commands"
    assert anchor("LiteLLM SDK (`pip install litellm`)") == "litellm-sdk-pip-install-litellm"


def test_a_missing_file_or_heading_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](#title) [also](other.md#part) `[code](x.md)`\n"
        "[gone](missing.md) [bad](#nothing) [far](other.md#elsewhere) [web](https://x.org)\n"
        "```\n[in a block](nowhere.md)\n# not a heading\n```\n",
        encoding="utf-8",
    )
    (tmp_path / "other.md").write_text("## Part\n", encoding="utf-8")
    assert broken_links(page) == [
        "page.md: missing.md (no such file)",
        "page.md: #nothing (no such heading)",
        "page.md: other.md#elsewhere (no such heading)",
    ]


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    checked = pages()
    assert len(checked) > 5
    broken = [problem for page in checked for problem in broken_links(page)]
    assert not broken, "\n".join(broken)
