"""The code blocks of the README and of docs/*.md, so that tests run them as written and the
pages cannot drift.

Each fenced block with a language is preceded by an HTML comment saying how it is tested:
``<!-- readme-test: KIND -->``, where KIND is ``demo`` (runs against the real demo
gateway), ``vision`` (against the vision demo), ``backend`` (starts its own server),
``config`` (a settings file that must load), ``manifest`` (an adapters manifest that must
parse), or ``skip: WHY`` (needs a GPU, the network, systemd, ...). A block without one fails
``test_every_readme_block_says_how_it_is_tested``. A fence without a language holds text (a
file tree, a diagram), never code, and needs no mark. A block moved from the README into
docs/ is still found by ``blocks_of`` and run by the same tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
KINDS = ("demo", "vision", "backend", "config", "manifest", "skip")
_MARK = re.compile(r"<!--\s*readme-test:\s*(\w+)(?::\s*(.*?))?\s*-->")
_DEFAULT_URLS = ("http://127.0.0.1:8000", "http://localhost:8000", "localhost:8000")


def pages() -> list[Path]:
    """The README, then every page of docs/, in name order."""
    return [README, *sorted(DOCS.glob("*.md"))]


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository's root
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    kind: str | None
    why: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}:{self.lang}"


def readme_blocks(path: Path | None = None) -> list[Block]:
    """The fenced blocks of ``path``; without one, of every page (``pages()``)."""
    if path is None:
        return [block for page in pages() for block in readme_blocks(page)]
    page = path.resolve().relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("```"):
            lang = line[3:].strip()
            end = index + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            previous = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
            mark = _MARK.search(previous)
            blocks.append(
                Block(
                    page=page,
                    line=index + 1,
                    lang=lang,
                    code="\n".join(lines[index + 1 : end]) + "\n",
                    kind=mark.group(1) if mark else None,
                    why=mark.group(2) if mark else None,
                )
            )
            index = end + 1
        else:
            index += 1
    return blocks


def blocks_of(kind: str) -> list[Block]:
    return [block for block in readme_blocks() if block.kind == kind]


def pointed_at(code: str, url: str) -> str:
    """``code`` with the pages' default address replaced by ``url`` (http://host:port)."""
    for default in _DEFAULT_URLS:
        replacement = url if default.startswith("http") else url.removeprefix("http://")
        code = code.replace(default, replacement)
    return code


def run_block(
    block: Block, url: str, timeout: float = 600, env: dict[str, str] | None = None
) -> str:
    """Run ``block`` against the gateway at ``url`` from the repository root; its stdout. The
    pages' ``.venv/bin/`` (where the scripts install) is the venv the suite runs in, which
    ``LORAGATE_VENV`` may have put elsewhere."""
    venv_bin = str(Path(sys.executable).parent)
    code = pointed_at(block.code, url).replace(".venv/bin/", f"{venv_bin}/")
    full_env = {
        **os.environ,
        "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
        "LORAGATE_URL": url,  # where the `gateway adapters ...` commands talk to by default
        **(env or {}),
    }
    if block.lang == "python":
        command = [sys.executable, "-c", code]
    elif block.lang == "bash":
        command = ["bash", "-euo", "pipefail", "-c", code]
    else:
        raise ValueError(f"{block.id}: cannot run a {block.lang!r} block")
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env
    )
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout
