"""loragate installs from a wheel, not only from a clone: build one from the checkout, install
it into a fresh virtual environment and run what an operator runs first (`gateway --version`,
`gateway serve --help`, one request through `gateway serve` to a stand-in engine).

The fresh environment gets the project's dependencies from the test's own environment (a
``.pth`` line after its own site-packages, so nothing is downloaded), but never the checkout:
the loragate it imports is the wheel's. Builds offline (``--no-build-isolation``), with the
setuptools and wheel of the test's environment.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loragate import __version__

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _checkout_copy(target: Path) -> Path:
    """The project's files as git sees them (tracked, and new files not ignored): no build/,
    egg-info, caches or virtual environment, and no clash with a build running in the tree."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing to list the project's files with")
    for name in listed.decode().split("\0"):
        source = ROOT / name
        if name and source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = _checkout_copy(tmp_path_factory.mktemp("source"))
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "--wheel-dir", str(dist), str(source)],
        check=True, timeout=300, env=_outside_env(),
    )  # fmt: skip
    (built,) = dist.glob("loragate-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh environment holding the wheel; the test environment's packages after it."""
    env_dir = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--quiet", str(wheel)],
        check=True, timeout=300, env=_outside_env(),
    )  # fmt: skip
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, env=_outside_env(),
    ).stdout.strip()  # fmt: skip
    # A plain path line: the test environment's own .pth files (the checkout's editable
    # install among them) are not run for a directory added this way.
    (Path(purelib) / "zz-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env_dir


def _outside_env() -> dict[str, str]:
    """This environment without what would put the checkout on the path (the suite's
    conftest adds it to PYTHONPATH) or configure the gateway."""
    drop = ("LORAGATE_", "VLLM_", "PYTHONPATH", "PYTHONHOME")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONUNBUFFERED": "1"}


def _clean_env(home: Path) -> dict[str, str]:
    return {**_outside_env(), "HOME": str(home)}


def _run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        cwd=cwd, capture_output=True, text=True, timeout=120, env=_clean_env(cwd),
    )  # fmt: skip


def test_the_wheel_holds_the_package_its_status_page_and_license_only(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    ui = sorted(p.name for p in (ROOT / "loragate" / "gateway" / "ui").iterdir() if p.is_file())
    assert ui and all(f"loragate/gateway/ui/{name}" in names for name in ui)
    assert not [n for n in names if n.startswith(("tools/", "tests/", "scripts/", "deploy/"))]
    assert {n.split("/")[0] for n in names} == {"loragate", f"loragate-{__version__}.dist-info"}
    info = f"loragate-{__version__}.dist-info"
    assert any(n.startswith(f"{info}/") and n.endswith("/LICENSE") for n in names), names
    entry_points = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert "gateway = loragate.cli:main" in entry_points
    metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert "Project-URL: Changelog" in metadata and "Apache-2.0" in metadata


def test_the_installed_wheel_is_imported_not_the_checkout(venv: Path, tmp_path: Path) -> None:
    done = _run(venv, "python", "-c", "import loragate; print(loragate.__file__)", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_relative_to(venv), done.stdout


def test_gateway_version_and_serve_help_from_the_wheel(venv: Path, tmp_path: Path) -> None:
    version = _run(venv, "gateway", "--version", cwd=tmp_path)
    assert (version.returncode, version.stdout.strip()) == (0, f"loragate {__version__}")
    helped = _run(venv, "gateway", "serve", "--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert "Usage:" in helped.stdout and "--upstream-url" in helped.stdout
    assert _run(venv, "gateway", "demo", "--help", cwd=tmp_path).returncode == 0


@contextlib.contextmanager
def _process(argv: list[str], cwd: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=_clean_env(cwd)
        )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _wait_for(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}: {log.read_text()[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2, trust_env=False).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"{url} never answered 200: {log.read_text()[-3000:]}")


def test_the_installed_gateway_serves_a_request_to_a_stand_in_engine(
    venv: Path, tmp_path: Path
) -> None:
    engine_port, gateway_port = _free_port(), _free_port()
    engine = [sys.executable, "-m", "tools.bench.fake_engine", "--port", str(engine_port),
              "--served-model-name", "base"]  # fmt: skip
    gateway = [
        str(venv / "bin" / "gateway"), "serve",
        "--upstream-url", f"http://127.0.0.1:{engine_port}/v1",
        "--port", str(gateway_port), "--cache-dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{gateway_port}"
    with (
        _process(engine, ROOT, tmp_path / "engine.log") as engine_proc,
        _process(gateway, tmp_path, tmp_path / "gateway.log") as gateway_proc,
    ):
        _wait_for(f"http://127.0.0.1:{engine_port}/health", engine_proc, tmp_path / "engine.log")
        _wait_for(f"{url}/health", gateway_proc, tmp_path / "gateway.log")
        response = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "base",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
            timeout=30,
            trust_env=False,
        )
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == " x x x"
        # The status page's static files came with the wheel.
        page = httpx.get(f"{url}/ui", timeout=10, trust_env=False)
        assert page.status_code == 200 and "<html" in page.text.lower()
