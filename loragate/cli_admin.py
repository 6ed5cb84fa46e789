"""How the `gateway` commands reach a running gateway's admin API: the --url, --admin-key and
--cache-dir options they share, and one request helper that finds the key and turns an error
answer into the command's error (`gateway chat` words the errors of its own requests the same
way)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from loragate.cli_errors import FAILURE, fail

DEFAULT_URL = "http://127.0.0.1:8000"
UrlOption = Annotated[
    str,
    typer.Option("--url", envvar="LORAGATE_URL", metavar="URL", help="The running gateway."),
]
AdminKeyOption = Annotated[
    str | None,
    typer.Option(
        "--admin-key",
        envvar="LORAGATE_ADMIN_KEY",
        metavar="KEY",
        help="The gateway's admin key (default: a gateway on this machine's per-start token).",
    ),
]
CacheDirOption = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        envvar="LORAGATE_CACHE_DIR",
        metavar="PATH",
        help="The gateway's cache dir, where it keeps its per-start admin token.",
    ),
]


def admin_request(
    url: str,
    admin_key: str | None,
    method: str,
    path: str,
    body: Any = None,
    cache_dir: Path | None = None,
) -> Any:
    """One admin API call: its JSON answer, or the command fails with the gateway's message."""
    import httpx

    if admin_key is None:
        admin_key = local_admin_token(url, cache_dir)
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    try:
        # The admin key goes to the gateway itself, never to an HTTP(S)_PROXY from the env.
        with httpx.Client(timeout=None, trust_env=False) as client:
            response = client.request(method, url.rstrip("/") + path, json=body, headers=headers)
    except httpx.HTTPError as exc:
        fail(unreachable(url, exc), FAILURE)
    if response.status_code >= 400:
        fail(error_answer(response), FAILURE)
    return _json_of(response)


def read_quietly(url: str, path: str, key: str | None = None) -> Any:
    """A GET whose answer is a courtesy (``/health``, ``/metrics/recent`` for `gateway
    status`'s table): its JSON whatever its status (a gateway not ready answers 503 with its
    reason), or None when there is none."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(timeout=10, trust_env=False) as client:
            payload = client.get(url.rstrip("/") + path, headers=headers).json()
    except (httpx.HTTPError, ValueError):
        return None
    return payload if isinstance(payload, dict) else None


def error_answer(response: Any) -> str:
    """An error answer (an ``httpx.Response``, read) in one line: its status and the
    gateway's message, from the OpenAI error shape when it has it."""
    payload = _json_of(response)
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    message = error.get("message", error) if isinstance(error, dict) else error
    return f"{response.status_code}: {message}"


def unreachable(url: str, exc: Exception) -> str:
    return f"cannot reach the gateway at {url}: {exc}"


def _json_of(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return {"message": response.text}


def local_admin_token(url: str, cache_dir: Path | None) -> str | None:
    """The per-start token of a gateway on this machine started without --admin-key.

    Only ever sent to a loopback URL: the token opens this machine's gateway, not another's.
    """
    import httpx

    from loragate.demo.layout import default_cache_dir
    from loragate.gateway.access.admin_token import read_admin_token
    from loragate.gateway.access.cross_site import is_loopback

    try:
        host = httpx.URL(url).host
    except httpx.InvalidURL:
        return None
    if not is_loopback(host):
        return None
    return read_admin_token(cache_dir or default_cache_dir())
