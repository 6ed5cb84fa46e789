"""Image URLs in requests: the gateway resolves, checks and fetches them itself; the engine never does.

No test here sends a packet beyond this machine: names are answered by an injected resolver
(or a stand-in for ``getaddrinfo``), "public" addresses are reached only through a recording
transport, and the one real listener is on 127.0.0.1 and counts what reaches it.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import socket
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.chat import ChatRequest, normalize_chat_request
from loragate.gateway.requests.images import pools as media_pools
from loragate.gateway.requests.images import resolve as media
from loragate.gateway.requests.images.resolve import MediaPolicy
from loragate.settings import Settings


def png_bytes(color: tuple[int, int, int] = (10, 200, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 6), color).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = png_bytes()
PNG_URI = f"data:image/png;base64,{base64.b64encode(PNG).decode()}"


class CountingServer:
    """A listener on 127.0.0.1 that serves a PNG and counts every request that reaches it."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        hits = self.hits

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(PNG)))
                self.end_headers()
                self.wfile.write(PNG)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def loopback() -> Iterator[CountingServer]:
    server = CountingServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(cache_dir=tmp_path / "cache")


class FakeDNS:
    """An injected resolver: fixed answers per name, or a sequence consumed one per lookup."""

    def __init__(self, answers: dict[str, list[str] | list[list[str]]]) -> None:
        self.answers = answers
        self.lookups: list[str] = []

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.lookups.append(host)
        answer = self.answers.get(host)
        if answer is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if answer and isinstance(answer[0], list):
            return answer.pop(0) if len(answer) > 1 else answer[0]  # type: ignore[return-value]
        return answer  # type: ignore[return-value]


Answer = tuple[int, dict[str, str], bytes]
OK: Answer = (200, {"Content-Type": "image/png"}, PNG)


class RecordingTransport(httpx.AsyncBaseTransport):
    """Stands in for the network: records each request and answers from ``routes``."""

    def __init__(self, routes: dict[str, Answer] | None = None) -> None:
        self.routes = routes or {}
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        status, headers, body = self.routes.get(f"{request.url.host}{request.url.path}", OK)
        # Streamed, as a real transport answers.
        return httpx.Response(status, headers=headers, stream=httpx.ByteStream(body))


def inject(
    monkeypatch: pytest.MonkeyPatch, resolver: FakeDNS, transport: RecordingTransport
) -> None:
    """Every policy ``normalize_chat_request`` builds uses this resolver and transport."""

    def policy(*args: Any) -> MediaPolicy:
        return MediaPolicy(*args, resolver=resolver, transport=transport)

    monkeypatch.setattr(media, "_media_policy", policy)


def image_request(*urls: str, kind: str = "image_url") -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": kind, "image_url": {"url": url}} for url in urls]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}]}


async def refused(payload: dict[str, Any], settings: Settings, status: int) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        await normalize_chat_request(payload, settings)
    assert caught.value.status == status, caught.value.message
    return caught.value


def first_image(body: ChatRequest) -> str:
    url: str = body["messages"][0]["content"][0]["image_url"]["url"]
    return url


# ----- defect 1: SSRF through numeric host forms and names -----------------------------------


@pytest.mark.parametrize(
    "host",
    ["0x7f000001", "2130706433", "127.1", "0", "017700000001", "[::ffff:7f00:1]"],
)
async def test_numeric_forms_of_loopback_are_refused_and_nothing_is_fetched(
    settings: Settings, loopback: CountingServer, host: str
) -> None:
    url = f"http://{host}:{loopback.port}/a.png"
    error = await refused(image_request(url), settings, 403)
    assert error.code == "image_url_forbidden", error.message
    assert "--private-image-urls" in error.message
    assert loopback.hits == []


@pytest.mark.parametrize(
    ("name", "address"),
    [
        ("169.254.169.254.nip.io", "169.254.169.254"),
        ("intranet.example", "10.1.2.3"),
        ("router.example", "192.168.0.1"),
        ("cgnat.example", "100.64.0.9"),
        ("multicast.example", "224.0.0.251"),
        ("reserved.example", "240.0.0.1"),
        ("nothing.example", "0.0.0.0"),
        ("v6-loopback.example", "::1"),
        ("v6-link-local.example", "fe80::1"),
        ("v6-unique-local.example", "fd00::1"),
        ("nat64-loopback.example", "64:ff9b::7f00:1"),
        ("6to4-private.example", "2002:a01:203::1"),
    ],
)
async def test_names_resolving_to_forbidden_addresses_are_refused_before_any_connection(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, name: str, address: str
) -> None:
    # The operating system's resolver, as the gateway (and any engine) would ask it.
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == name:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            return [(family, socket.SOCK_STREAM, 6, "", (address, port))]
        return real_getaddrinfo(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    never = RecordingTransport()
    monkeypatch.setattr(
        media,
        "_media_policy",
        lambda *args: MediaPolicy(*args, transport=never),
    )
    error = await refused(image_request(f"http://{name}/cat.png"), settings, 403)
    assert error.code == "image_url_forbidden" and address in error.message
    assert never.requests == []


async def test_a_name_with_one_forbidden_answer_among_public_ones_is_refused(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    dns = FakeDNS({"mixed.example": ["93.184.216.34", "127.0.0.1"]})
    transport = RecordingTransport()
    inject(monkeypatch, dns, transport)
    error = await refused(image_request("https://mixed.example/cat.png"), settings, 403)
    assert error.code == "image_url_forbidden"
    assert transport.requests == []


async def test_image_url_is_fetched_once_from_the_checked_address_and_sent_as_a_data_uri(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DNS rebinding: the first answer is public, every later one points at this machine.
    dns = FakeDNS({"images.example": [["93.184.216.34"], ["127.0.0.1"]]})
    transport = RecordingTransport()
    inject(monkeypatch, dns, transport)
    body = await normalize_chat_request(
        image_request("https://images.example:8443/cat.png?sig=abc"), settings
    )
    assert first_image(body) == PNG_URI  # the engine gets the bytes, never the URL
    assert dns.lookups == ["images.example"]  # resolved once, and that answer was used
    [request] = transport.requests
    assert str(request.url) == "https://93.184.216.34:8443/cat.png?sig=abc"
    assert request.headers["Host"] == "images.example:8443"
    assert request.extensions["sni_hostname"] == "images.example"  # TLS checks the name


async def test_each_redirect_hop_is_checked_like_the_first(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, loopback: CountingServer
) -> None:
    dns = FakeDNS({"images.example": ["93.184.216.34"], "cdn.example": ["93.184.216.35"]})
    transport = RecordingTransport(
        {
            "93.184.216.34/good.png": (302, {"Location": "http://cdn.example/real.png"}, b""),
            "93.184.216.34/evil.png": (
                302,
                {"Location": f"http://127.0.0.1:{loopback.port}/admin"},
                b"",
            ),
        }
    )
    inject(monkeypatch, dns, transport)
    body = await normalize_chat_request(image_request("http://images.example/good.png"), settings)
    assert first_image(body) == PNG_URI
    assert [r.url.host for r in transport.requests] == ["93.184.216.34", "93.184.216.35"]
    error = await refused(image_request("http://images.example/evil.png"), settings, 403)
    assert error.code == "image_url_forbidden"
    assert loopback.hits == []


async def test_an_unresolvable_or_failing_url_is_a_400_naming_it(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    dns = FakeDNS({"images.example": ["93.184.216.34"]})
    transport = RecordingTransport({"93.184.216.34/gone.png": (404, {}, b"")})
    inject(monkeypatch, dns, transport)
    error = await refused(image_request("http://no-such-host.example/cat.png"), settings, 400)
    assert error.code == "image_fetch_failed" and "resolved" in error.message
    error = await refused(image_request("http://images.example/gone.png"), settings, 400)
    assert error.code == "image_fetch_failed" and "HTTP 404" in error.message


async def test_a_fetched_image_is_checked_like_a_data_uri(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dns = FakeDNS({"images.example": ["93.184.216.34"]})
    transport = RecordingTransport({"93.184.216.34/notes.png": (200, {}, b"just text")})
    inject(monkeypatch, dns, transport)
    small = Settings(cache_dir=tmp_path, max_image_bytes=len(PNG) - 1)
    error = await refused(image_request("http://images.example/cat.png"), small, 400)
    assert error.code == "image_too_large"
    settings = Settings(cache_dir=tmp_path)
    error = await refused(image_request("http://images.example/notes.png"), settings, 400)
    assert "not a PNG, JPEG" in error.message


async def test_private_image_urls_lets_the_gateway_fetch_from_this_machine(
    tmp_path: Path, loopback: CountingServer
) -> None:
    allowed = Settings(cache_dir=tmp_path, private_image_urls=True)
    body = await normalize_chat_request(
        image_request(f"http://127.0.0.1:{loopback.port}/a.png"), allowed
    )
    assert first_image(body) == PNG_URI
    assert loopback.hits == ["/a.png"]


async def test_a_url_that_trickles_is_cut_off_at_the_fetch_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Trickle(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:
            while True:
                yield b"\x89"
                await asyncio.sleep(0.05)

    class Slow(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, stream=Trickle())

    policy = MediaPolicy(
        None,
        1 << 20,
        1 << 20,
        resolver=FakeDNS({"slow.example": ["93.184.216.34"]}),
        transport=Slow(),
        fetch_timeout=0.3,
    )
    with pytest.raises(OpenAIError) as caught:
        await asyncio.wait_for(policy.image("http://slow.example/a.png", "p"), 5)
    assert caught.value.code == "image_fetch_failed" and "0.3 s" in caught.value.message


def test_the_engine_is_told_to_fetch_no_url_itself() -> None:
    from loragate.supervisor.command import EngineSpec, engine_argv, engine_env

    spec = EngineSpec("m", "m", max_loras=1, max_lora_rank=8, socket_path=Path("/tmp/e.sock"))
    argv = engine_argv(spec)
    assert argv[argv.index("--allowed-media-domains") + 1] == "loragate.invalid"
    assert engine_env(spec)["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"


# ----- defect 2: every part type the engine could fetch ---------------------------------------


@pytest.mark.parametrize("kind", ["video_url", "audio_url"])
async def test_audio_and_video_urls_are_refused_naming_the_type(
    settings: Settings, loopback: CountingServer, kind: str
) -> None:
    url = f"http://127.0.0.1:{loopback.port}/clip"
    payload = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": kind, kind: {"url": url}}, {"type": "text", "text": "?"}],
            }
        ]
    }
    error = await refused(payload, settings, 400)
    assert kind in error.message and error.param == f"messages[0].content[0].{kind}"
    # The same media inline is the engine's to decode: nothing to fetch.
    inline = {"url": "data:audio/wav;base64,UklGRg=="}
    payload["messages"][0]["content"][0][kind] = inline
    body = await normalize_chat_request(payload, settings)
    assert body["messages"][0]["content"][0][kind] == inline
    assert loopback.hits == []


async def test_responses_style_input_image_is_policed_like_image_url(
    settings: Settings, loopback: CountingServer
) -> None:
    payload = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": f"http://127.1:{loopback.port}/"}],
            }
        ]
    }
    error = await refused(payload, settings, 403)
    assert error.code == "image_url_forbidden"
    payload["messages"][0]["content"][0]["image_url"] = PNG_URI
    body = await normalize_chat_request(payload, settings)
    assert body["messages"][0]["content"][0] == {"type": "image_url", "image_url": {"url": PNG_URI}}
    assert loopback.hits == []


@pytest.mark.parametrize("field", ["image_url", "audio_url", "video_url"])
async def test_a_url_field_hidden_in_another_part_type_is_refused(
    settings: Settings, loopback: CountingServer, field: str
) -> None:
    # vLLM reads a part with a "uuid" by its keys, whatever its type says.
    part = {
        "type": "text",
        "text": "?",
        "uuid": "u1",
        field: {"url": f"http://127.0.0.1:{loopback.port}/x"},
    }
    error = await refused({"messages": [{"role": "user", "content": [part]}]}, settings, 400)
    assert field in error.message and error.code == "unsupported_content_part"
    assert loopback.hits == []


# ----- defect 11: image count cap and the decode pool ----------------------------------------


async def test_more_images_than_the_cap_is_a_400_before_any_is_fetched(
    tmp_path: Path, loopback: CountingServer
) -> None:
    allowed = Settings(cache_dir=tmp_path, private_image_urls=True, max_images_per_request=3)
    urls = [f"http://127.0.0.1:{loopback.port}/{i}.png" for i in range(4)]
    error = await refused(image_request(*urls), allowed, 400)
    assert error.code == "too_many_images" and "4 images" in error.message
    assert loopback.hits == []
    assert Settings(cache_dir=tmp_path).max_images_per_request == 16
    body = await normalize_chat_request(image_request(*urls[:3]), allowed)
    assert len(loopback.hits) == 3 and first_image(body) == PNG_URI


async def test_images_are_decoded_in_a_bounded_pool_of_their_own(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    real_check = MediaPolicy._check_image

    def spy(self: MediaPolicy, data: bytes, param: str) -> str:
        threads.append(threading.current_thread().name)
        return real_check(self, data, param)

    monkeypatch.setattr(MediaPolicy, "_check_image", spy)
    await normalize_chat_request(image_request(PNG_URI, PNG_URI), settings)
    assert len(threads) == 2
    assert all(name.startswith("loragate-media") for name in threads), threads
    assert media_pools.pool("media")._max_workers <= 4


async def test_images_fetched_for_one_request_count_against_its_body_cap(
    tmp_path: Path, loopback: CountingServer
) -> None:
    # Two of these images fit as data URIs; a short request naming three must not cost more.
    allowed = Settings(
        cache_dir=tmp_path, private_image_urls=True, max_body_bytes=2 * len(PNG_URI) + 10
    )
    urls = [f"http://127.0.0.1:{loopback.port}/{i}.png" for i in range(3)]
    error = await refused(image_request(*urls), allowed, 400)
    assert error.code == "images_too_large" and "--max-body-bytes" in error.message
    assert error.param == "messages[0].content[2].image_url.url"
    body = await normalize_chat_request(image_request(*urls[:2]), allowed)
    assert first_image(body) == PNG_URI


async def test_a_part_type_that_is_not_a_string_is_a_400_when_images_are_counted(
    settings: Settings,
) -> None:
    payload = {"messages": [{"role": "user", "content": [{"type": ["image_url"]}]}]}
    error = await refused(payload, settings, 400)
    assert "'type'" in error.message
