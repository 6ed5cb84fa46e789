"""The second bundled backend: an existing OpenAI-compatible server, by URL, without a supervisor.

``gateway serve --upstream-url http://host:8000/v1`` puts the gateway's checks, auth, Vi
format and image handling in front of any OpenAI-compatible server (vLLM, another loragate,
llama.cpp's server, ...). Nothing is started: the models are whatever the upstream's
``/v1/models`` lists, watched in the background, and ``/health`` follows the upstream's
``/health`` (or, where it has none, whether ``/v1/models`` answers). ``--model-name`` gives
the upstream's base model a public name; answers carry the name the client asked for.
The URL is shown (``/health``, errors, logs) with its credentials and query as ``***``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any
from urllib.parse import urlsplit

from starlette.responses import Response

from loragate.engine_states import listed_max_model_len
from loragate.gateway.backends.base import EngineCall, json_post
from loragate.gateway.errors import OpenAIError
from loragate.gateway.proxy import ProxyClient
from loragate.http import oneshot
from loragate.logs import redact, redact_urls
from loragate.serving.engine_names import Rename
from loragate.settings import Settings

log = logging.getLogger("loragate.gateway")


def split_upstream_url(url: str) -> tuple[str, str]:
    """(API base ending in /v1, server root) for an upstream URL given with or without /v1."""
    trimmed = url.strip().rstrip("/")
    parsed = urlsplit(trimmed)
    try:
        port_ok = parsed.port is None or parsed.port > 0
    except ValueError:  # not a number, or past 65535
        port_ok = False
    if parsed.scheme not in ("http", "https") or not parsed.hostname or not port_ok:
        raise ValueError(
            f"--upstream-url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {url!r}"
        )
    if trimmed.endswith("/v1"):
        return trimmed, trimmed[: -len("/v1")]
    return trimmed + "/v1", trimmed


class UpstreamBackend:
    def __init__(self, settings: Settings) -> None:
        assert settings.upstream_url is not None
        self.api_base, self.root = split_upstream_url(settings.upstream_url)
        self.shown_base = redact(self.api_base)  # for messages: never its credentials
        self.alias = settings.model_name
        self.aliased = settings.model  # which upstream id the alias names; default: its base model
        self.refresh_interval = settings.probe_interval
        self._headers = (
            {"Authorization": f"Bearer {settings.upstream_api_key}"}
            if settings.upstream_api_key
            else {}
        )
        self._timeout = settings.probe_timeout
        self.proxy = ProxyClient(
            silence_limit=settings.upstream_timeout or None,
            max_answer_bytes=settings.max_answer_bytes,
        )
        self._upstream_ids: list[str] = []
        self._max_model_len: int | None = None
        self._ready = False
        self._reason = "not asked yet"
        self._watch_task: asyncio.Task[None] | None = None

    # ----- life cycle ---------------------------------------------------------------------

    async def start(self) -> None:
        await self.refresh()
        if not self._ready:
            log.warning("upstream %s is not ready yet: %s", self.shown_base, self._reason)
        self._watch_task = asyncio.create_task(self._watch(), name="upstream-watch")

    async def stop(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        await self.proxy.aclose()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval)
            await self.refresh()

    async def refresh(self) -> None:
        """Ask the upstream for its models and health; keeps the last known models on failure."""
        ask = functools.partial(oneshot.request, "GET", timeout=self._timeout)
        try:
            models = await ask(self.api_base + "/models", headers=self._headers)
            health = await ask(self.root + "/health", headers=self._headers)
        except oneshot.PlainHTTPError as exc:
            self._not_ready(f"upstream {self.shown_base} unreachable: {exc}")
            return
        if models.status != 200:
            self._not_ready(
                f"upstream {self.shown_base}/models answered {models.status}: {models.text[:200]}"
            )
            return
        try:
            self._upstream_ids = _model_ids(models.json())
            self._max_model_len = listed_max_model_len(models.json())
        except ValueError as exc:
            self._not_ready(f"upstream {self.shown_base}/models: {exc}")
            return
        if health.status in (404, 405):  # no /health route: answering /v1/models is healthy
            self._ready, self._reason = bool(self._upstream_ids), "upstream lists no models"
        elif health.status == 200:
            self._ready, self._reason = True, ""
        else:
            self._not_ready(f"upstream /health answered {health.status}: {health.text[:200]}")

    def _not_ready(self, reason: str) -> None:
        """Not ready, and why: shown in the public ``/health``, so with no URL's secrets (the
        upstream's own answer, or an error about the URL, may quote them)."""
        self._ready, self._reason = False, redact_urls(reason)

    # ----- names ----------------------------------------------------------------------------

    def _aliased_id(self) -> str | None:
        if self.alias is None or not self._upstream_ids:
            return None
        if self.aliased is not None and self.aliased in self._upstream_ids:
            return self.aliased
        return self._upstream_ids[0]

    def _to_upstream(self, public: str) -> str:
        if public == self.alias:
            return self._aliased_id() or public
        return public

    def max_model_len(self) -> int | None:
        """The context length the upstream's model list gives, if it gives one."""
        return self._max_model_len

    def model_ids(self) -> list[str]:
        aliased = self._aliased_id()
        return [self.alias if m == aliased and self.alias else m for m in self._upstream_ids]

    # ----- what the routes ask --------------------------------------------------------------

    def health(self) -> tuple[bool, dict[str, Any]]:
        if self._ready:
            return True, {"status": "healthy", "models": self.model_ids()}
        return False, {"status": "starting", "reason": self._reason, "models": self.model_ids()}

    async def forward(
        self, path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
    ) -> Response:
        return await self.relay(json_post(path, payload, public_model, stream, request_id))

    async def relay(self, call: EngineCall) -> Response:
        upstream_id = None if call.public_model is None else self._to_upstream(call.public_model)
        # /v1/... routes hang off the API base; the others (/tokenize, /version) off the root.
        if call.path.startswith("/v1/"):
            url = self.api_base + call.path.removeprefix("/v1")
        else:
            url = self.root + call.path
        rename = None
        if upstream_id is not None and call.public_model is not None:
            rename = Rename.of(upstream_id, call.public_model)
        try:
            return await self.proxy.relay(
                call, url, call.body(upstream_id), self._headers, rename=rename
            )
        except OpenAIError as exc:
            exc.message = redact_urls(
                exc.message.replace("the engine", f"the upstream server {self.shown_base}")
            )
            raise


def _model_ids(listing: Any) -> list[str]:
    """Model ids from an OpenAI model list, base models (no ``parent``) first."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        raise ValueError("not an OpenAI model list")
    entries = [
        entry for entry in data if isinstance(entry, dict) and isinstance(entry.get("id"), str)
    ]
    entries.sort(key=lambda entry: entry.get("parent") is not None)
    return [entry["id"] for entry in entries]
