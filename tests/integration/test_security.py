"""Hostile input against real `gateway serve` processes: refused with a clear answer, unseen by the engine.

Most tests use the shared gateway (real vLLM engine, ``--allowed-media-dir`` = ``media_dir``).
"The engine saw nothing" is shown with two of the engine's own records: its access log (one
line per HTTP request it served, in ``<cache>/logs/engine.log``) and its request counter
(``vllm:request_success_total``, which the gateway's ``/metrics`` passes on). After the refused
requests, one good request must move each by exactly one: the witness works, and nothing else
got through.

The auth tests run one more gateway, with inference keys from flags and from a key file, in
front of the bench's instant fake engine (auth is the gateway's concern; no second vLLM boot).
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import stat
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway_process import ADMIN_KEY, GatewayProcess
from tools.bench.hostile_inputs import Canary, corpus, state_of

pytestmark = pytest.mark.engine

_ENGINE_INFERENCE_LINE = re.compile(r'"POST /v1/(?:chat/)?completions HTTP/1\.[01]"')
PASSWD_MARKERS = ("root:x:0:0", "root:*:0:0", base64.b64encode(b"root:").decode()[:6])


# ----- the witness: what the engine itself recorded ------------------------------------------


@dataclass(frozen=True)
class EngineRecord:
    served: int  # inference requests in the engine's access log
    succeeded: float  # vllm:request_success_total, all labels


def engine_record(gateway: GatewayProcess) -> EngineRecord:
    log = gateway.cache_dir / "logs" / "engine.log"
    served = len(_ENGINE_INFERENCE_LINE.findall(log.read_text(errors="replace")))
    return EngineRecord(served, engine_counter(gateway))


def engine_counter(gateway: GatewayProcess) -> float:
    """The engine's vllm:request_success_total, as the gateway's /metrics passes it on."""
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(f"{gateway.url}/metrics", timeout=30).text
        # A scrape whose engine part timed out says so (loragate_engine_metrics_up 0): ask again.
        if "vllm:request_success_total" in text or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "loragate_engine_metrics_up 1" in text, "the engine's metrics never came through"
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:request_success_total"
    )


def good_request(gateway: GatewayProcess) -> None:
    body = {
        "model": "loragate-demo",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    }
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text


def record_after(gateway: GatewayProcess, before: EngineRecord, served: int) -> EngineRecord:
    """The record once the access log shows ``served`` more requests (or after 10 s)."""
    deadline = time.monotonic() + 10
    after = engine_record(gateway)
    while after.served < before.served + served and time.monotonic() < deadline:
        time.sleep(0.1)  # the access log line is written just after the answer
        after = engine_record(gateway)
    return after


def assert_engine_saw_nothing_since(gateway: GatewayProcess, before: EngineRecord) -> None:
    """One good request now must be the only one the engine served since ``before``."""
    good_request(gateway)
    after = record_after(gateway, before, 1)
    assert after.served == before.served + 1, (before, after)
    assert after.succeeded == before.succeeded + 1, (before, after)


@pytest.fixture
def engine_untouched(gateway: GatewayProcess) -> Iterator[None]:
    before = engine_record(gateway)
    yield
    assert_engine_saw_nothing_since(gateway, before)


def test_the_engine_witness_counts_every_request_the_engine_serves(
    gateway: GatewayProcess,
) -> None:
    before = engine_record(gateway)  # asserts the engine's own metrics come through /metrics
    good_request(gateway)
    good_request(gateway)
    after = record_after(gateway, before, 2)
    assert (after.served, after.succeeded) == (before.served + 2, before.succeeded + 2)


# ----- refused requests ----------------------------------------------------------------------


def _png(width: int, height: int, mode: str = "1") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


def _chat(content: Any = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "loragate-demo", "messages": [{"role": "user", "content": content}], **extra}


def _image(url: str) -> dict[str, Any]:
    return _chat([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}])


@dataclass(frozen=True)
class Refusal:
    body: Any  # a JSON value, or raw bytes
    status: int
    code: str
    says: str
    path: str = "/v1/chat/completions"


REFUSALS: dict[str, Refusal] = {
    "body-over-32MiB": Refusal(
        _chat("x" * (32 * 1024 * 1024 + 10)),
        413,
        "request_too_large",
        "larger than 33554432 bytes (--max-body-bytes)",
    ),
    "malformed-json": Refusal(b'{"messages": [', 400, "invalid_json", "not valid JSON"),
    "json-array": Refusal(b"[1, 2]", 400, "invalid_json", "must be a JSON object"),
    "messages-not-array": Refusal(
        {"messages": "hi"}, 400, "invalid_request", "'messages' must be a non-empty array"
    ),
    "unknown-role": Refusal(
        {"messages": [{"role": "admin", "content": "hi"}]},
        400,
        "invalid_role",
        "messages[0].role is 'admin'; use one of assistant, developer",
    ),
    "role-not-a-string": Refusal(  # found by the fuzzer: an unhashable role was a 500
        {"messages": [{"role": ["user"], "content": "hi"}]},
        400,
        "invalid_role",
        "messages[0].role is ['user']; use one of",
    ),
    "content-number": Refusal(
        _chat(12), 400, "invalid_request", "must be a string or an array of parts"
    ),
    "max-tokens-string": Refusal(
        _chat(max_tokens="16"), 400, "invalid_value", "'max_tokens' must be a positive integer"
    ),
    "too-many-messages": Refusal(
        {"messages": [{"role": "user", "content": "hi"}] * 1025},
        400,
        "too_many_messages",
        "this gateway allows 1024 (--max-messages)",
    ),
    "image-not-base64": Refusal(
        _image("data:image/png;base64,%%%"), 400, "invalid_image", "not valid base64"
    ),
    "image-not-an-image": Refusal(
        _image("data:image/png;base64," + base64.b64encode(b"MZ\x90\x00 not a png").decode()),
        400,
        "invalid_image",
        "not a PNG, JPEG, GIF, BMP or WebP",
    ),
    "image-over-40M-pixels": Refusal(
        _image("data:image/png;base64," + base64.b64encode(_png(8000, 5001)).decode()),
        400,
        "image_too_large",
        "8000x5001 pixels; the limit is 40000000 (--max-image-pixels)",
    ),
    "image-over-20MiB": Refusal(
        _image("data:image/png;base64," + "A" * (28 * 1024 * 1024)),
        400,
        "image_too_large",
        "larger than 20971520 bytes (--max-image-bytes)",
    ),
    "image-ftp-url": Refusal(
        _image("ftp://example.com/cat.png"), 400, "invalid_image", "Unsupported image URL scheme"
    ),
    "image-url-at-this-machine": Refusal(
        _image("http://127.0.0.1:8000/v1/load_lora_adapter"),
        403,
        "image_url_forbidden",
        "start it with --private-image-urls",
    ),
    "image-url-at-cloud-metadata": Refusal(
        _image("http://169.254.169.254/latest/meta-data/"),
        403,
        "image_url_forbidden",
        "loopback, private or link-local address",
    ),
    "unknown-model": Refusal(
        _chat(model="gpt-4"), 404, "model_not_found", "Valid models: loragate-demo"
    ),
    "both-formats": Refusal(
        {"messages": [{"role": "user", "content": "hi"}], "user_prompt": "hi"},
        400,
        "ambiguous_request_format",
        "not both",
    ),
    "neither-format": Refusal({"model": "loragate-demo"}, 400, "missing_messages", "send one"),
    "completions-max-tokens-float": Refusal(
        {"model": "loragate-demo", "prompt": "hi", "max_tokens": 1.5},
        400,
        "invalid_value",
        "'max_tokens' must be a positive integer",
        path="/v1/completions",
    ),
}

# Generation parameters the gateway checks itself (loragate.gateway.requests.parameters).
PARAMETER_REFUSALS: dict[str, Refusal] = {
    "stream-not-bool": Refusal(_chat(stream="yes"), 400, "invalid_type", "'stream' must be true"),
    "temperature-string": Refusal(
        _chat(temperature="hot"), 400, "invalid_type", "'temperature' must be a number"
    ),
    "n-zero": Refusal(_chat(n=0), 400, "invalid_value", "'n' must be between 1 and 128"),
    "n-a-billion": Refusal(_chat(n=10**9), 400, "invalid_value", "'n' must be between 1 and 128"),
    "completions-without-prompt": Refusal(
        {"model": "loragate-demo", "max_tokens": 1},
        400,
        "missing_prompt",
        "needs a 'prompt'",
        path="/v1/completions",
    ),
}


def _send(gateway: GatewayProcess, refusal: Refusal) -> httpx.Response:
    url = f"{gateway.url}{refusal.path}"
    if isinstance(refusal.body, bytes):
        json_type = {"Content-Type": "application/json"}
        return httpx.post(url, content=refusal.body, headers=json_type, timeout=120)
    return httpx.post(url, json=refusal.body, timeout=120)


def _check_refusal(response: httpx.Response, refusal: Refusal) -> None:
    assert response.status_code == refusal.status, response.text[:500]
    error = response.json()["error"]
    assert error["code"] == refusal.code, error
    assert refusal.says in error["message"], error["message"]


@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_refused_requests_get_a_clear_error_and_never_reach_the_engine(
    gateway: GatewayProcess, engine_untouched: None, case: str
) -> None:
    refusal = REFUSALS[case]
    _check_refusal(_send(gateway, refusal), refusal)


@pytest.mark.parametrize(
    "case",
    list(PARAMETER_REFUSALS),
    ids=list(PARAMETER_REFUSALS),
)
def test_wrongly_typed_generation_parameters_never_reach_the_engine(
    gateway: GatewayProcess, case: str
) -> None:
    refusal = PARAMETER_REFUSALS[case]
    if case == "n-a-billion":
        refusal_body = {**refusal.body, "max_tokens": 1}  # bounded even if it got through
        refusal = Refusal(refusal_body, refusal.status, refusal.code, refusal.says, refusal.path)
    before = engine_record(gateway)
    _check_refusal(_send(gateway, refusal), refusal)
    assert_engine_saw_nothing_since(gateway, before)


# ----- local files -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traps(media_dir: Path) -> dict[str, str]:
    """Paths that lead to /etc/passwd, some through links planted inside the allowed dir."""
    planted = media_dir / "security-traps"
    planted.mkdir(exist_ok=True)
    for name, target in (("passwd.png", "/etc/passwd"), ("etc", "/etc")):
        (planted / name).unlink(missing_ok=True)
        (planted / name).symlink_to(target)
    up = len(media_dir.parts) + 2
    return {
        "absolute": "/etc/passwd",
        "relative-dotdot": "../" * up + "etc/passwd",
        "dotdot-from-inside": f"{media_dir}/" + "../" * up + "etc/passwd",
        "file-url": "file:///etc/passwd",
        "file-url-encoded-dotdot": f"file://{media_dir}/" + "%2e%2e/" * up + "etc/passwd",
        "symlink-to-file": "security-traps/passwd.png",
        "symlink-to-file-absolute": str(planted / "passwd.png"),
        "symlink-to-dir": "security-traps/etc/passwd",
        "home-relative": "~/../../etc/passwd",
    }


TRAP_NAMES = [
    "absolute",
    "relative-dotdot",
    "dotdot-from-inside",
    "file-url",
    "file-url-encoded-dotdot",
    "symlink-to-file",
    "symlink-to-file-absolute",
    "symlink-to-dir",
    "home-relative",
]


@pytest.mark.parametrize("shape", ["vi-source", "image-url"])
@pytest.mark.parametrize("trap", TRAP_NAMES)
def test_etc_passwd_cannot_be_read_through_an_image_path(
    gateway: GatewayProcess,
    traps: dict[str, str],
    engine_untouched: None,
    trap: str,
    shape: str,
) -> None:
    path = traps[trap]
    if shape == "vi-source":
        body: dict[str, Any] = {"model": "loragate-demo", "source": path, "user_prompt": "what?"}
    else:
        body = _image(path)
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == "media_path_forbidden"
    assert "outside the allowed media directory" in error["message"]
    assert "it was not read" in error["message"]
    assert error["param"] == (
        "source" if shape == "vi-source" else "messages[0].content[0].image_url.url"
    )
    for marker in PASSWD_MARKERS:
        assert marker not in response.text


# ----- the engine behind the gateway ---------------------------------------------------------


def _listeners(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of ``pids``."""
    found: set[tuple[str, int]] = set()
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        found |= {(c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN}
    return found


def _engine_socket(pid: int) -> Path:
    """The Unix socket the engine's API server was told to bind (``--uds PATH``)."""
    cmdline = psutil.Process(pid).cmdline()
    assert "--uds" in cmdline, cmdline
    return Path(cmdline[cmdline.index("--uds") + 1])


def test_the_engine_serves_http_only_on_a_private_socket_and_refuses_requests_without_its_key(
    gateway: GatewayProcess, demo_dir: Path
) -> None:
    # Whatever TCP the engine's processes open among themselves stays on loopback ...
    everything = _listeners(gateway.engine_tree_pids())
    assert {address for address, _ in everything} <= {"127.0.0.1"}, everything
    # ... and its API server has no TCP port at all: HTTP is on a Unix socket in a 0700
    # directory of the gateway's user.
    api_server = gateway.engine_info()["pid"]
    assert not _listeners([api_server]), _listeners([api_server])
    socket_path = _engine_socket(api_server)
    assert socket_path.is_socket(), socket_path
    directory = socket_path.parent.stat()
    assert stat.S_IMODE(directory.st_mode) == 0o700, oct(directory.st_mode)
    assert directory.st_uid == os.getuid()

    transport = httpx.HTTPTransport(uds=str(socket_path))
    with httpx.Client(transport=transport, base_url="http://engine", timeout=30) as engine:
        assert engine.get("/health").status_code == 200
        intruder = {"lora_name": "intruder", "lora_path": str(demo_dir / "adapters" / "pong")}
        for headers in (
            {},
            {"Authorization": "Bearer guessed-key"},
            {"Authorization": "Basic eDp5"},
        ):
            load = engine.post("/v1/load_lora_adapter", json=intruder, headers=headers)
            assert load.status_code == 401, load.text
            assert engine.get("/v1/models", headers=headers).status_code == 401
            chat = engine.post("/v1/chat/completions", json=_chat(), headers=headers)
            assert chat.status_code == 401
    served = httpx.get(f"{gateway.url}/v1/models", timeout=10).json()["data"]
    assert "intruder" not in {model["id"] for model in served}
    engine_models = gateway.admin("GET", "/admin/adapters").json()["data"]
    assert "intruder" not in {adapter["name"] for adapter in engine_models}


def test_the_engine_key_is_not_on_any_command_line(gateway: GatewayProcess) -> None:
    for pid in gateway.engine_tree_pids():
        with_key = [arg for arg in psutil.Process(pid).cmdline() if arg == "--api-key"]
        assert not with_key, f"pid {pid} carries --api-key on its command line"


# ----- adapters ------------------------------------------------------------------------------

ESCAPING_NAMES = [
    "..",
    "../escape",
    "../../../../tmp/escape",
    "/tmp/escape",
    "a/b",
    "..\\escape",
    ".hidden",
    "-dash-first",
    "with space",
    "nul\x00byte",
    "x" * 65,
    "",
]


def _tree(root: Path) -> set[Path]:
    return {path.relative_to(root) for path in root.rglob("*")}


def test_adapter_names_cannot_escape_the_cache_dir(gateway: GatewayProcess, demo_dir: Path) -> None:
    pong = str(demo_dir / "adapters" / "pong")
    before_files = _tree(gateway.cache_dir)
    before = gateway.admin("GET", "/admin/adapters").json()["data"]
    for name in ESCAPING_NAMES:
        load = gateway.admin(
            "POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": pong}
        )
        assert load.status_code == 400, (name, load.text)
        assert load.json()["error"]["code"] == "invalid_adapter_name", (name, load.text)
        assert "invalid adapter name" in load.json()["error"]["message"]
        if name and "\x00" not in name:
            quoted = httpx.URL(f"{gateway.url}/admin/adapters/").copy_with(
                raw_path=b"/admin/adapters/" + _quote(name)
            )
            put = httpx.put(
                quoted,
                json={"source": pong},
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                timeout=60,
            )
            # Names with a slash do not even match the route (404); the others are refused.
            assert put.status_code in (400, 404), (name, put.text)
    assert gateway.admin("GET", "/admin/adapters").json()["data"] == before
    new_files = _tree(gateway.cache_dir) - before_files
    assert not [p for p in new_files if "escape" in str(p)], new_files
    assert not Path("/tmp/escape").exists()


def _quote(name: str) -> bytes:
    from urllib.parse import quote

    return quote(name, safe="").encode()


@pytest.mark.parametrize(
    "source",
    [
        "ftp://example.com/adapter.tar",
        "gopher://example.com/a",
        "s3://bucket/adapter",
        "javascript:alert(1)",
    ],
)
def test_adapter_sources_other_than_local_http_hf_and_tinker_are_refused(
    gateway: GatewayProcess, source: str
) -> None:
    response = gateway.admin("PUT", "/admin/adapters/from-elsewhere", json={"source": source})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "adapter_source_error"
    assert "hf://, https:// or tinker://" in error["message"]
    names = {a["name"] for a in gateway.admin("GET", "/admin/adapters").json()["data"]}
    assert "from-elsewhere" not in names


def test_a_local_adapter_dir_with_a_dangling_symlink_is_not_a_server_error(
    gateway: GatewayProcess, demo_dir: Path, tmp_path: Path
) -> None:
    adapter = tmp_path / "with-dangling-link"
    shutil.copytree(demo_dir / "adapters" / "pong", adapter)
    (adapter / "notes.txt").symlink_to(tmp_path / "gone")
    response = gateway.admin("PUT", "/admin/adapters/dangling", json={"source": str(adapter)})
    try:
        assert response.status_code < 500, response.text
    finally:
        gateway.admin("DELETE", "/admin/adapters/dangling")


# ----- headers, CORS ---------------------------------------------------------------------------


def test_security_headers_are_set_and_cors_is_off_by_default(gateway: GatewayProcess) -> None:
    origin = {"Origin": "https://evil.example"}
    for response in (
        httpx.get(f"{gateway.url}/health", headers=origin, timeout=10),
        httpx.post(f"{gateway.url}/v1/chat/completions", content=b"{", headers=origin, timeout=10),
        httpx.options(
            f"{gateway.url}/v1/chat/completions",
            headers={**origin, "Access-Control-Request-Method": "POST"},
            timeout=10,
        ),
    ):
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-frame-options"] == "DENY"
        assert "access-control-allow-origin" not in response.headers


# ----- keys: one more gateway, in front of the instant fake engine -------------------------

FLAG_KEYS = ["sk-flag-key-one", "sk-flag-key-two"]
FILE_KEYS = ["sk-file-key-three", "sk-file-key-four"]
WRONG_KEYS = ["sk-wrong-key", "sk-flag-key-on", "sk-flag-key-one2"]


@pytest.fixture(scope="module")
def keyed_gateway(
    tmp_path_factory: pytest.TempPathFactory, demo_dir: Path
) -> Iterator[GatewayProcess]:
    workdir = tmp_path_factory.mktemp("keyed-gateway")
    key_file = workdir / "keys.txt"
    key_file.write_text("# inference keys, one a line\n" + "\n".join(FILE_KEYS) + "\n")
    key_file.chmod(0o600)
    config = workdir / "gateway.yaml"
    engine = [sys.executable, "-m", "tools.bench.fake_engine"]
    config.write_text(json.dumps({"engine_command": engine}))  # JSON is YAML
    args = [f"--api-key={key}" for key in FLAG_KEYS]
    process = GatewayProcess(
        cache_dir=workdir / "cache",
        args=[*args, "--api-key-file", str(key_file), "--config", str(config)],
    ).start()
    try:
        process.wait_ready(timeout=120)
        yield process
    finally:
        process.stop()


def test_every_key_from_flags_and_from_the_key_file_is_accepted(
    keyed_gateway: GatewayProcess,
) -> None:
    before = engine_counter(keyed_gateway)
    for key in [*FLAG_KEYS, *FILE_KEYS, ADMIN_KEY]:
        headers = {"Authorization": f"Bearer {key}"}
        models = httpx.get(f"{keyed_gateway.url}/v1/models", headers=headers, timeout=10)
        assert models.status_code == 200
        chat = httpx.post(
            f"{keyed_gateway.url}/v1/chat/completions",
            json=_chat(max_tokens=2),
            headers=headers,
            timeout=30,
        )
        assert chat.status_code == 200, chat.text
    assert engine_counter(keyed_gateway) == before + 5


def test_requests_without_a_valid_key_are_401_and_never_reach_the_engine(
    keyed_gateway: GatewayProcess,
) -> None:
    before = engine_counter(keyed_gateway)
    attempts: list[dict[str, str]] = [{}, {"Authorization": "Bearer"}, {"X-API-Key": ""}]
    attempts += [{"Authorization": f"Bearer {key}"} for key in WRONG_KEYS]
    for headers in attempts:
        for path, body in (
            ("/v1/chat/completions", _chat(max_tokens=2)),
            ("/v1/completions", {"model": "loragate-demo", "prompt": "hi", "max_tokens": 2}),
        ):
            response = httpx.post(
                f"{keyed_gateway.url}{path}", json=body, headers=headers, timeout=30
            )
            assert response.status_code == 401, (headers, response.text)
            assert response.headers["www-authenticate"] == 'Bearer realm="loragate"'
            assert response.json()["error"]["message"] == (
                "Missing or invalid API key: send 'Authorization: Bearer <key>'."
            )
        assert (
            httpx.get(f"{keyed_gateway.url}/v1/models", headers=headers, timeout=10).status_code
            == 401
        )
    assert engine_counter(keyed_gateway) == before


def test_admin_routes_refuse_inference_keys_and_the_engine_keeps_running(
    keyed_gateway: GatewayProcess,
) -> None:
    pid = keyed_gateway.engine_info()["pid"]
    routes = [
        ("GET", "/admin/adapters", None),
        ("PUT", "/admin/adapters/pong", {"source": "/nowhere"}),
        ("DELETE", "/admin/adapters/pong", None),
        ("POST", "/admin/adapters/pong/rollback", None),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "pong"}),
        ("GET", "/admin/engine", None),
        ("POST", "/admin/engine/restart", None),
    ]
    for method, path, body in routes:
        url = f"{keyed_gateway.url}{path}"
        missing = httpx.request(method, url, json=body, timeout=30)
        assert missing.status_code == 401, (path, missing.text)
        for key in (FLAG_KEYS[0], FILE_KEYS[0]):
            wrong = httpx.request(
                method, url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
            )
            assert wrong.status_code == 403, (path, wrong.text)
            assert wrong.json()["error"]["code"] == "invalid_admin_key"
    info = keyed_gateway.engine_info()
    assert (info["pid"], info["restarts"], info["state"]) == (pid, 0, "ready")
    listed = {a["name"] for a in keyed_gateway.admin("GET", "/admin/adapters").json()["data"]}
    assert {"pong", "fox", "owl"} <= listed


def test_keys_appear_in_no_log_and_file_keys_in_no_command_line(
    keyed_gateway: GatewayProcess,
) -> None:
    # Every key has been used (or tried) by the tests above; make sure of it here too.
    for key in [*FLAG_KEYS, *FILE_KEYS, *WRONG_KEYS, ADMIN_KEY]:
        httpx.get(
            f"{keyed_gateway.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
        )
    logs = [keyed_gateway.log_path, keyed_gateway.cache_dir / "logs" / "engine.log"]
    texts = {path.name: path.read_text(errors="replace") for path in logs}
    texts["GET /admin/engine"] = keyed_gateway.admin("GET", "/admin/engine").text
    assert all(texts.values())
    for where, text in texts.items():
        for key in [*FLAG_KEYS, *FILE_KEYS, *WRONG_KEYS, ADMIN_KEY]:
            assert key not in text, f"{key} appears in {where}"
    assert keyed_gateway.proc is not None
    gateway_tree = [psutil.Process(keyed_gateway.proc.pid), *keyed_gateway_children(keyed_gateway)]
    for process in gateway_tree:
        command_line = " ".join(process.cmdline())
        for key in FILE_KEYS:
            assert key not in command_line, (
                f"{key} is visible in the command line of pid {process.pid}"
            )


def keyed_gateway_children(gateway: GatewayProcess) -> list[psutil.Process]:
    assert gateway.proc is not None
    return list(psutil.Process(gateway.proc.pid).children(recursive=True))


# ----- the whole corpus at once ---------------------------------------------------------------


def test_every_hostile_input_gets_a_clear_4xx_and_nothing_is_read_fetched_or_changed(
    gateway: GatewayProcess, engine_untouched: None
) -> None:
    """tools.bench.hostile_inputs: SSRF spellings, fetchable part types, files outside the
    media dir, cross-site and rebinding requests, unauthenticated and oversized bodies, the
    engine's own routes, escaping names, an archive bomb, credentials in a source."""
    with Canary() as canary, httpx.Client(base_url=gateway.url, timeout=120) as http:
        before = state_of(http, ADMIN_KEY)
        cases = corpus(canary.port)
        problems = {case.name: case.judge(case.send(http, ADMIN_KEY)) for case in cases}
        assert {name: why for name, why in problems.items() if why} == {}
        assert canary.escaped() == {}, "a hostile request made the gateway or engine fetch"
        assert state_of(http, ADMIN_KEY) == before
    assert len(cases) >= 40
