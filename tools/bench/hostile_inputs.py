"""A corpus of hostile requests: each must get a clear 4xx and read, fetch or change nothing.

One entry per way in that issue 15's review found or that its fixes close: numeric and
named loopback hosts in image URLs (SSRF), part types the engine could fetch, files outside
the media directory, cross-site and DNS-rebinding requests, unauthenticated and oversized
bodies, the engine's own admin routes, escaping adapter names, an archive bomb, credentials
in a source URL. ``tests/integration/test_hostile_inputs.py`` sends the whole corpus to a
real gateway and checks that nothing moved; ``scripts/soak.py`` mixes it into its load.

A ``Canary`` is a loopback HTTP server that counts what it is asked for: any hit outside
``/admin-source/`` (the sources an admin configures, fetched by design) is a request that
escaped. It also serves the archive bomb and answers 404 elsewhere.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import tarfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

ADMIN_SOURCE_PREFIX = "/admin-source/"
SECRET = "corpus-secret-password"
PASSWD_MARKERS = ("root:x:0:0", "root:*:0:0", base64.b64encode(b"root:x:0:0").decode()[:8])
FOREIGN_ORIGIN = "http://evil.example"
REBOUND_HOST = "evil.example"


@dataclass(frozen=True)
class Hostile:
    """One hostile request and the answer it must get."""

    name: str
    method: str
    path: str
    status: int
    code: str  # the OpenAI error's code
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    admin: bool = False  # send the admin key (the attack is not about the key)

    def send(self, http: httpx.Client, admin_key: str | None) -> httpx.Response:
        headers = dict(self.headers)
        if self.admin and admin_key:
            headers["Authorization"] = f"Bearer {admin_key}"
        return http.request(self.method, self.path, content=self.body, headers=headers)

    async def send_async(self, http: httpx.AsyncClient, admin_key: str | None) -> httpx.Response:
        headers = dict(self.headers)
        if self.admin and admin_key:
            headers["Authorization"] = f"Bearer {admin_key}"
        return await http.request(self.method, self.path, content=self.body, headers=headers)

    def judge(self, response: httpx.Response) -> str:
        """Empty when ``response`` is the clear refusal expected, else what is wrong with it."""
        problems = []
        if response.status_code != self.status:
            problems.append(f"HTTP {response.status_code}, expected {self.status}")
        try:
            error = response.json()["error"]
            if not isinstance(error.get("message"), str) or not error["message"]:
                problems.append("the error has no message")
            if error.get("code") != self.code:
                problems.append(f"code {error.get('code')!r}, expected {self.code!r}")
        except (ValueError, KeyError, TypeError):
            problems.append(f"not an OpenAI-shaped error: {response.text[:200]!r}")
        leaked = [m for m in (*PASSWD_MARKERS, SECRET) if m in response.text]
        if leaked:
            problems.append(f"the answer leaks {leaked}")
        return "; ".join(problems)


# ----- the corpus ------------------------------------------------------------------------------

JSON = {"Content-Type": "application/json"}


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _chat(content: Any, model: str) -> bytes:
    return _json({"model": model, "messages": [{"role": "user", "content": content}]})


def _image_part(url: str) -> list[dict[str, Any]]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]


def corpus(
    canary_port: int, model: str = "loragate-demo", keyless: bool = True, media_dir: bool = True
) -> list[Hostile]:
    """Every hostile request, aimed at a gateway whose canary listens on ``canary_port``;
    ``keyless``: the gateway has no inference keys (so the rebinding cases apply);
    ``media_dir``: it has an ``--allowed-media-dir`` (else local files are off altogether)."""
    port = canary_port
    cases: list[Hostile] = []

    def chat(name: str, content: Any, status: int, code: str, **extra: Any) -> None:
        cases.append(
            Hostile(name, "POST", "/v1/chat/completions", status, code, _chat(content, model), JSON)
        )

    # 1. SSRF: loopback in every spelling the engine's URL parser or resolver accepts.
    for host in (
        "127.0.0.1",
        "0x7f000001",
        "2130706433",
        "127.1",
        "0",
        "017700000001",
        "[::1]",
        "[::ffff:127.0.0.1]",
        "localhost",
    ):
        url = f"http://{host}:{port}/ssrf.png"
        chat(f"image-url-{host}", _image_part(url), 403, "image_url_forbidden")
    chat(
        "image-url-metadata",
        _image_part("http://169.254.169.254/latest/meta-data/"),
        403,
        "image_url_forbidden",
    )
    # 2. Every part type the engine could fetch.
    chat(
        "input-image-part",
        [{"type": "input_image", "image_url": f"http://127.1:{port}/ssrf.png"}],
        403,
        "image_url_forbidden",
    )
    for kind in ("video_url", "audio_url"):
        part = {"type": kind, kind: {"url": f"http://127.0.0.1:{port}/ssrf.bin"}}
        chat(f"{kind}-part", [part, {"type": "text", "text": "?"}], 400, "unsupported_content_part")
    # Files outside the media directory (or any file, where the gateway has none).
    status, code = (403, "media_path_forbidden") if media_dir else (400, "local_media_disabled")
    chat("file-url-etc-passwd", _image_part("file:///etc/passwd"), status, code)
    for source in ("/etc/passwd", "../../../../etc/passwd"):
        body = _json({"model": model, "source": source, "user_prompt": "what?"})
        cases.append(
            Hostile(f"vi-source-{source}", "POST", "/v1/chat/completions", status, code, body, JSON)
        )
    # 11. More image parts than a request may carry.
    tiny_png = (
        "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAAAAAA6fptVAAAACklEQVR4nGNg"
        "AAAAAgABSK+kcQAAAABJRU5ErkJggg=="
    )
    many = [{"type": "image_url", "image_url": {"url": tiny_png}}] * 17
    chat("seventeen-images", [*many, {"type": "text", "text": "?"}], 400, "too_many_images")
    # 3. Cross-site: a web page's simple requests, foreign origins, a rebound Host.
    restart = "/admin/engine/restart"
    cases += [
        Hostile(
            "inference-text-plain",
            "POST",
            "/v1/chat/completions",
            415,
            "unsupported_media_type",
            _chat("hi", model),
            {"Content-Type": "text/plain"},
        ),
        Hostile(
            "inference-foreign-origin",
            "POST",
            "/v1/chat/completions",
            403,
            "origin_not_allowed",
            _chat("hi", model),
            {**JSON, "Origin": FOREIGN_ORIGIN},
        ),
        Hostile(
            "restart-foreign-origin",
            "POST",
            restart,
            403,
            "origin_not_allowed",
            b"{}",
            {**JSON, "Origin": FOREIGN_ORIGIN},
            admin=True,
        ),
        Hostile(
            "load-adapter-from-a-page",
            "POST",
            "/v1/load_lora_adapter",
            403,
            "origin_not_allowed",
            _json({"lora_name": "intruder", "lora_path": f"http://127.0.0.1:{port}/x"}),
            {"Content-Type": "text/plain", "Origin": FOREIGN_ORIGIN},
            admin=True,
        ),
        Hostile(
            "load-adapter-text-plain",
            "POST",
            "/v1/load_lora_adapter",
            415,
            "unsupported_media_type",
            _json({"lora_name": "intruder", "lora_path": f"http://127.0.0.1:{port}/x"}),
            {"Content-Type": "text/plain"},
            admin=True,
        ),
        Hostile(
            "admin-rebound-host",
            "GET",
            "/admin/adapters",
            403,
            "host_not_allowed",
            headers={"Host": f"{REBOUND_HOST}:8000"},
            admin=True,
        ),
    ]
    if keyless:  # after a DNS rebinding, a page may read what a keyless gateway answers
        rebound = {"Host": f"{REBOUND_HOST}:8000"}
        cases += [
            Hostile(
                "models-rebound-host", "GET", "/v1/models", 403, "host_not_allowed", headers=rebound
            ),
            Hostile(
                "chat-rebound-host",
                "POST",
                "/v1/chat/completions",
                403,
                "host_not_allowed",
                _chat("hi", model),
                {**JSON, **rebound},
            ),
        ]
    # 4. Bodies: unauthenticated ones are refused before a byte is read; all are capped.
    big = b'{"source": "' + b"x" * (8 * 1024 * 1024) + b'"}'
    cases += [
        Hostile(
            "put-adapter-no-key-8MiB",
            "PUT",
            "/admin/adapters/intruder",
            401,
            "invalid_admin_key",
            big,
            JSON,
        ),
        Hostile(
            "put-adapter-wrong-key",
            "PUT",
            "/admin/adapters/intruder",
            403,
            "invalid_admin_key",
            _json({"source": f"http://127.0.0.1:{port}{ADMIN_SOURCE_PREFIX}a.tar.gz"}),
            {**JSON, "Authorization": "Bearer guessed-key"},
        ),
        Hostile(
            "put-adapter-2MiB",
            "PUT",
            "/admin/adapters/intruder",
            413,
            "request_too_large",
            big[: 2 * 1024 * 1024 + 2] + b'"}',
            JSON,
            admin=True,
        ),
        Hostile("restart-no-key", "POST", restart, 401, "invalid_admin_key", b"{}", JSON),
    ]
    # 7. The engine's own routes are not the gateway's; its LoRA routes are admin routes here.
    for path in (
        "/invocations",
        "/abort_requests",
        "/collective_rpc",
        "/start_profile",
        "/sleep",
        "/reset_prefix_cache",
        "/scale_elastic_ep",
    ):
        cases.append(Hostile(f"engine-route-{path}", "POST", path, 404, "unknown_url", b"{}", JSON))
    unload = _json({"lora_name": "pong"})
    cases.append(
        Hostile(
            "unload-no-key",
            "POST",
            "/v1/unload_lora_adapter",
            401,
            "invalid_admin_key",
            unload,
            JSON,
        )
    )
    # Adapter names that would escape the cache directory ('/' never reaches the route).
    for name, status, code in (
        ("..%2F..%2Fescape", 404, "unknown_url"),
        ("%2E%2E", 400, "invalid_adapter_name"),
        (".hidden", 400, "invalid_adapter_name"),
        ("-dash", 400, "invalid_adapter_name"),
        ("x" * 65, 400, "invalid_adapter_name"),
    ):
        cases.append(
            Hostile(
                f"adapter-name-{name[:12]}",
                "PUT",
                f"/admin/adapters/{name}",
                status,
                code,
                _json({"source": f"http://127.0.0.1:{port}{ADMIN_SOURCE_PREFIX}a.tar.gz"}),
                JSON,
                admin=True,
            )
        )
    # 9. An archive bomb (many members in a small download) and 12. a source with credentials.
    cases += [
        Hostile(
            "archive-bomb",
            "PUT",
            "/admin/adapters/bomb",
            400,
            "adapter_source_error",
            _json({"source": f"http://127.0.0.1:{port}{ADMIN_SOURCE_PREFIX}bomb.tar.gz"}),
            JSON,
            admin=True,
        ),
        Hostile(
            "source-with-credentials",
            "PUT",
            "/admin/adapters/leaky",
            400,
            "adapter_source_error",
            _json(
                {"source": f"http://user:{SECRET}@127.0.0.1:{port}{ADMIN_SOURCE_PREFIX}none.tgz"}
            ),
            JSON,
            admin=True,
        ),
    ]
    return cases


# ----- the canary ------------------------------------------------------------------------------


def archive_bomb(members: int = 20_000) -> bytes:
    """A small .tar.gz with more members than any adapter has (empty files)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for index in range(members):
            tar.addfile(tarfile.TarInfo(f"f{index}"), io.BytesIO(b""))
    return gzip.compress(raw.getvalue(), compresslevel=9)


class Canary:
    """A loopback HTTP server that counts every request it gets, by path."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._bomb = archive_bomb()
        canary = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with canary._lock:
                    canary.hits[self.path] += 1
                if self.path == ADMIN_SOURCE_PREFIX + "bomb.tar.gz":
                    self._answer(200, canary._bomb, "application/gzip")
                else:
                    self._answer(404, b"not here", "text/plain")

            do_POST = do_HEAD = do_GET

            def _answer(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Canary:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def escaped(self) -> dict[str, int]:
        """Hits on paths no hostile request may make the gateway or engine fetch."""
        with self._lock:
            return {p: n for p, n in self.hits.items() if not p.startswith(ADMIN_SOURCE_PREFIX)}


# ----- what must not change ----------------------------------------------------------------------


def state_of(http: httpx.Client, admin_key: str | None) -> dict[str, Any]:
    """The adapters (name -> active version) and the engine (pid, restarts) as the admin API says."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    adapters = http.get("/admin/adapters", headers=headers).json()["data"]
    engine = http.get("/admin/engine", headers=headers).json()
    return {
        "adapters": {
            a["name"]: (a["version"], a["previous_version"], a["state"]) for a in adapters
        },
        "engine": (engine.get("pid"), engine.get("restarts"), engine.get("state")),
    }
