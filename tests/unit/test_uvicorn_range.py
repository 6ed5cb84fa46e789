"""The fast path and the connection guard on every uvicorn loragate may meet.

``gateway/connection_guard.py`` subclasses uvicorn's httptools protocol, which is not public
API, and ``gateway/hot_protocol.py`` that subclass; pyproject.toml sets only a lower bound on
uvicorn, and ``gateway/uvicorn_fit.py`` decides at start-up what the installed one allows:
the fast path, plain ASGI behind the guard (one log line saying why), or a refusal to start
when even the guard cannot hook in. ``scripts/setup.sh --test`` puts the oldest uvicorn
pyproject.toml allows in ``.venv/uvicorn-lowest`` and the newest the package index has in
``.venv/uvicorn-newest``; the hot-protocol and guard tests, and a real ``gateway serve``, run
again on each. A newer uvicorn than ``uvicorn_fit.TESTED_ON`` knows fails the newest's run on
purpose: its fast path is refused until someone checks the release and adds its fingerprints.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from loragate.gateway import hot_protocol, uvicorn_fit
from loragate.gateway.connection_guard import GuardedProtocol
from loragate.gateway.server_options import server_options
from tests.backend_double import RecordingBackend, free_port, serving
from tests.unit.test_hot_protocol import AUTH, chat, fake_engine, gateway_app
from tools.bench.fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parents[2]
LOWEST_DIR = Path(sys.prefix) / "uvicorn-lowest"
NEWEST_DIR = Path(sys.prefix) / "uvicorn-newest"


def lower_bound() -> tuple[int, ...]:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^\s*"uvicorn([^"]*)",', text, re.MULTILINE)
    assert match, "pyproject.toml no longer names uvicorn as a dependency"
    bound = re.fullmatch(r">=([0-9.]+)", match.group(1))
    assert bound, f"uvicorn{match.group(1)}: loragate asks only for a lower bound on uvicorn"
    return version(bound.group(1))


def version(text: str) -> tuple[int, ...]:
    parts = [int(part) for part in text.split(".")[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


def folder_version(folder: Path) -> str:
    found = list(folder.glob("uvicorn-*.dist-info"))
    assert found, f"no uvicorn in {folder}: run scripts/setup.sh --test"
    return found[0].name.removeprefix("uvicorn-").removesuffix(".dist-info")


def with_uvicorn(folder: Path | None) -> dict[str, str]:
    """The environment of a Python that imports the uvicorn in ``folder`` (None: the venv's)."""
    paths = [str(folder)] if folder is not None else []
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, str(ROOT)])}


def test_pyproject_bounds_uvicorn_from_below_only_and_the_installed_one_fits() -> None:
    assert version(uvicorn.__version__) >= lower_bound()
    assert uvicorn_fit.guard_unfit() is None
    assert uvicorn_fit.fast_path_unfit() is None
    assert uvicorn.__version__ in uvicorn_fit.TESTED_ON


@pytest.mark.parametrize("folder", [LOWEST_DIR, NEWEST_DIR], ids=["oldest", "newest"])
def test_the_hot_protocol_and_guard_tests_pass_on_the_oldest_and_newest_uvicorn(
    folder: Path,
) -> None:
    found = folder_version(folder)
    if folder == LOWEST_DIR:
        assert version(found) == lower_bound()
    else:  # the newest the index has: never older than the installed one
        assert version(found) >= version(uvicorn.__version__)
        if found == uvicorn.__version__:
            return  # the installed one: these very tests run on it in the suite itself
    env = with_uvicorn(folder)
    check = subprocess.run(
        [sys.executable, "-c", "import uvicorn; print(uvicorn.__version__)"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert check.stdout.strip() == found
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(ROOT / "tests/unit/test_hot_protocol.py"),
         str(ROOT / "tests/unit/test_connection_hygiene.py")],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


# ----- a real gateway serve -----------------------------------------------------------------

SERVE = """
import sys
{prelude}
from loragate.cli import main
sys.argv = ["gateway", "serve", *sys.argv[1:]]
main()
"""

DIFFERENT_TASK_START = """
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
_uvicorns = HttpToolsProtocol._start_asgi_task
def _start_asgi_task(self, cycle, app):  # a later uvicorn's: it names each request's task
    _uvicorns(self, cycle, app)
    for task in self.tasks:
        task.set_name("request")
HttpToolsProtocol._start_asgi_task = _start_asgi_task
"""


@contextlib.contextmanager
def gateway_serve(
    tmp_path: Path, upstream: str, folder: Path | None = None, prelude: str = ""
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``gateway serve --upstream-url upstream`` in a process of its own, with the uvicorn in
    ``folder``; yields its URL and the process (its log on stderr, once it ended)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE.format(prelude=prelude),
         "--upstream-url", f"{upstream}/v1", "--port", str(port),
         "--cache-dir", str(tmp_path), "--api-key", AUTH["Authorization"].split()[1]],
        env=with_uvicorn(folder), cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        process.wait(30)


def one_chat_request(
    tmp_path: Path, folder: Path | None = None, prelude: str = ""
) -> tuple[httpx.Response, str]:
    """One chat request to ``gateway serve`` in front of the stand-in engine: its answer and
    the gateway's log."""
    with (
        fake_engine(FakeEngine(api_key=None, models=["base"])) as engine,
        gateway_serve(tmp_path, engine, folder, prelude) as (url, process),
    ):
        answer = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=30,
                            json=chat("base", max_tokens=2))  # fmt: skip
    return answer, process.stderr.read() if process.stderr else ""


def path_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "fast path" in line or "plain ASGI" in line]


@pytest.mark.parametrize(
    "folder", [None, LOWEST_DIR, NEWEST_DIR], ids=["installed", "oldest", "newest"]
)
def test_gateway_serve_answers_a_chat_request_and_logs_which_path_serves(
    tmp_path: Path, folder: Path | None
) -> None:
    found = uvicorn.__version__ if folder is None else folder_version(folder)
    if folder == NEWEST_DIR and found == uvicorn.__version__:
        folder = None  # the newest is the installed one: served as it is installed
    answer, log = one_chat_request(tmp_path, folder)
    assert answer.status_code == 200, log[-3000:]
    assert answer.json()["choices"][0]["message"]["content"] == " x x"
    lines = path_lines(log)
    assert len(lines) == 1, log[-3000:]
    if found in uvicorn_fit.TESTED_ON:
        assert f"serving the inference routes on the fast path (uvicorn {found})" in lines[0]
    else:
        assert "plain ASGI behind the connection guard" in lines[0] and found in lines[0]


def test_gateway_serve_on_a_uvicorn_whose_task_start_differs_serves_plain_asgi(
    tmp_path: Path,
) -> None:
    answer, log = one_chat_request(tmp_path, prelude=DIFFERENT_TASK_START)
    assert answer.status_code == 200, log[-3000:]
    assert answer.json()["choices"][0]["message"]["content"] == " x x"
    assert "x-frame-options" in answer.headers  # the ASGI middleware's security headers
    lines = path_lines(log)
    assert len(lines) == 1, log[-3000:]
    assert "WARNING" in lines[0] and "plain ASGI behind the connection guard" in lines[0]
    assert (
        f"uvicorn {uvicorn.__version__}'s HttpToolsProtocol._start_asgi_task differs" in (lines[0])
    )


def test_without_uvicorns_httptools_protocol_the_gateway_imports_and_serve_refuses(
    tmp_path: Path,
) -> None:
    hidden = "import sys; sys.modules['uvicorn.protocols.http.httptools_impl'] = None"
    imports = subprocess.run(
        [sys.executable, "-c", f"{hidden}\nimport loragate.gateway.server_options\n"
         "from loragate.gateway import uvicorn_fit; print(uvicorn_fit.guard_unfit())"],
        env=with_uvicorn(None), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert imports.returncode == 0, imports.stderr
    assert "its httptools protocol does not import" in imports.stdout
    with gateway_serve(tmp_path, "http://127.0.0.1:9", prelude=hidden) as (_, process):
        process.wait(60)
    log = process.stderr.read() if process.stderr else ""
    assert process.returncode == 1, log
    assert "error: loragate's connection guard" in log
    assert "cannot run on uvicorn" in log and "its httptools protocol does not import" in log


# ----- the same decisions in-process ---------------------------------------------------------


def test_a_task_start_that_differs_makes_the_fast_path_refuse_behind_the_same_guard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    uvicorns = HttpToolsProtocol._start_asgi_task

    def _start_asgi_task(self: Any, cycle: Any, app: Any) -> None:
        uvicorns(self, cycle, app)  # and then something the fast path does not do:
        self.tasks_started = getattr(self, "tasks_started", 0) + 1

    monkeypatch.setattr(HttpToolsProtocol, "_start_asgi_task", _start_asgi_task)
    answered_hot: list[str] = []

    async def answer_hot(self: Any, cycle: Any, route: str, endpoint: Any) -> None:
        answered_hot.append(route)

    monkeypatch.setattr(hot_protocol.HotRouteProtocol, "_answer", answer_hot)
    app = gateway_app(tmp_path, RecordingBackend(), max_header_bytes=4096)
    caplog.set_level(logging.INFO, "loragate.gateway")
    with serving(app, as_served=True) as url:
        answer = httpx.post(f"{url}/v1/chat/completions", json=chat(), headers=AUTH)
        too_large = httpx.get(f"{url}/health", headers={"X-Big": "x" * 8192})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    assert answered_hot == []
    assert too_large.status_code == 431  # the guard still holds on plain ASGI
    lines = [r for r in caplog.records if "plain ASGI" in r.message or "fast path" in r.message]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "HttpToolsProtocol._start_asgi_task differs" in lines[0].message
    protocol = server_options(app)["http"]
    assert issubclass(protocol, GuardedProtocol)
    assert not issubclass(protocol, hot_protocol.HotRouteProtocol)


def test_a_uvicorn_that_starts_requests_elsewhere_cannot_carry_the_guard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def on_headers_complete(self: Any) -> None:  # starts its requests some other way
        self.loop.create_task(self.cycle.run_asgi(self.app))

    monkeypatch.setattr(HttpToolsProtocol, "on_headers_complete", on_headers_complete)
    reason = uvicorn_fit.guard_unfit()
    assert reason is not None and "on_headers_complete" in reason
    with pytest.raises(uvicorn_fit.UnfitUvicorn, match="cannot run on uvicorn"):
        server_options(gateway_app(tmp_path, RecordingBackend()))
    assert server_options()["http"] == "httptools"  # no gateway: nothing to guard


def _plain(self: Any, cycle: Any) -> None:
    if self.config.reset_contextvars:
        self.start(cycle)


def _restyled(self: Any, cycle: Any) -> None:
    """Reworded, commented and laid out anew: the same code."""
    if (
        self.config.reset_contextvars  # opt-in
    ):
        self.start(
            cycle,
        )


def _changed(self: Any, cycle: Any) -> None:
    if not self.config.reset_contextvars:
        self.start(cycle)


def test_fingerprints_ignore_comments_docstrings_and_layout_but_not_code() -> None:
    assert uvicorn_fit.fingerprint(_plain) == uvicorn_fit.fingerprint(_restyled)
    assert uvicorn_fit.fingerprint(_plain) != uvicorn_fit.fingerprint(_changed)
    assert uvicorn_fit.fingerprint(len) is None  # no source to read: never a known one
