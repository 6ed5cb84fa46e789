"""An idle client connection outlives the client's own pool expiry, so a client never sends a
request on a connection the gateway is closing at that very moment.

CI once saw the official ``openai`` client (``max_retries=0``) get "Server disconnected without
sending a response" in a burst: uvicorn's 5 s keep-alive and httpx's 5 s pool expiry ran out
together on a reused connection.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import openai

from loragate.gateway.app import create_app
from loragate.gateway.server.serve import KEEP_ALIVE_SECONDS, GatewayServer
from tests.backend_double import RecordingBackend, serving, settings_for


def _request() -> bytes:
    body = b'{"model":"base","messages":[{"role":"user","content":"hi"}]}'
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    return head + body


def _read_answer(sock: socket.socket) -> bytes:
    """One whole answer (the double's answers carry a content-length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head


def _still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True  # nothing to read, and no end of stream: open
    finally:
        sock.setblocking(True)


def test_keep_alive_outlasts_the_clients_pool_expiry(tmp_path: Path) -> None:
    client_expiry = httpx.Limits().keepalive_expiry
    assert openai.DEFAULT_CONNECTION_LIMITS.keepalive_expiry in (None, client_expiry)
    assert client_expiry is not None
    assert 2 * client_expiry <= KEEP_ALIVE_SECONDS
    assert KEEP_ALIVE_SECONDS <= 120  # idle connections still end, and free their slot
    app = create_app(settings_for(tmp_path), backend=RecordingBackend())
    assert GatewayServer(app, app.state.gateway.settings).state.keep_alive == KEEP_ALIVE_SECONDS


def test_an_idle_connection_is_still_served_after_the_client_expiry(tmp_path: Path) -> None:
    """On the hot path as ``gateway serve`` runs it: answer, stay idle past 5 s (uvicorn's default
    keep-alive would have closed the connection by then), answer again on the same socket."""
    app = create_app(settings_for(tmp_path), backend=RecordingBackend())
    with serving(app, as_served=True) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(_request())
            assert _read_answer(sock).startswith(b"HTTP/1.1 200")
            time.sleep(httpx.Limits().keepalive_expiry + 1.5)  # type: ignore[operator]
            assert _still_open(sock), "the gateway closed an idle connection a client would reuse"
            sock.sendall(_request())
            assert _read_answer(sock).startswith(b"HTTP/1.1 200")
