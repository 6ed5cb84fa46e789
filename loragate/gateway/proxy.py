"""Forwarding requests to an OpenAI-compatible upstream with one pooled keep-alive client.

The body goes out as bytes; the answer comes back as bytes. The only rewrite is the
``model`` field (engine id -> the public name the client asked for), done on raw bytes, event
by event for streams, so nothing is buffered beyond one server-sent event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
from starlette.responses import Response, StreamingResponse

from loragate.gateway.errors import OpenAIError, error_event

_EVENT_END = b"\n\n"


@dataclass(frozen=True)
class Rename:
    """Rewrite engine id ``internal`` to ``public`` in answers."""

    internal: bytes
    public: bytes

    @classmethod
    def of(cls, internal: str, public: str) -> Rename | None:
        if internal == public:
            return None
        return cls(internal.encode(), public.encode())

    def model_field(self, data: bytes) -> bytes:
        return data.replace(b'"model":"' + self.internal + b'"', b'"model":"' + self.public + b'"')

    def everywhere(self, data: bytes) -> bytes:
        return data.replace(self.internal, self.public)


class UpstreamUnreachable(OpenAIError):
    """The request never reached the upstream (connection refused): safe to send again."""


class ProxyClient:
    def __init__(self, connect_timeout: float = 10.0) -> None:
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def forward(
        self,
        url: str,
        body: bytes,
        headers: dict[str, str],
        *,
        stream: bool,
        rename: Rename | None,
        on_done: Callable[[], None],
        response_headers: dict[str, str] | None = None,
    ) -> Response:
        """POST ``body`` to ``url``; ``on_done`` runs exactly once, when the answer is complete."""
        extra = response_headers or {}
        request = self._http.build_request("POST", url, content=body, headers=headers)
        try:
            upstream = await self._http.send(request, stream=stream)
        except httpx.ConnectError as exc:
            on_done()
            raise UpstreamUnreachable(
                503, "the engine is not reachable; retry shortly", code="engine_unavailable",
                headers={"Retry-After": "5", **extra},
            ) from exc
        except httpx.HTTPError as exc:
            on_done()
            raise OpenAIError(
                503,
                f"the engine did not answer ({type(exc).__name__}); retry shortly",
                code="engine_unavailable",
                headers={"Retry-After": "5", **extra},
            ) from exc
        if not stream or upstream.status_code != 200:
            try:
                content = await upstream.aread() if stream else upstream.content
            except httpx.HTTPError as exc:
                on_done()
                raise OpenAIError(
                    503, "the engine stopped while answering; retry", code="engine_unavailable",
                    headers={"Retry-After": "5", **extra},
                ) from exc
            finally:
                if stream:
                    await upstream.aclose()
            on_done()
            if rename is not None:
                ok = upstream.status_code < 400
                content = rename.model_field(content) if ok else rename.everywhere(content)
            return Response(
                content,
                status_code=upstream.status_code,
                media_type=upstream.headers.get("content-type", "application/json"),
                headers=extra,
            )
        return StreamingResponse(
            _relay_events(upstream, rename, on_done),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **extra},
        )


async def _relay_events(
    upstream: httpx.Response, rename: Rename | None, on_done: Callable[[], None]
) -> AsyncIterator[bytes]:
    pending = b""
    try:
        async for chunk in upstream.aiter_raw():
            if rename is None:
                yield chunk
                continue
            # Rewrite whole events only: a chunk may end in the middle of one.
            pending += chunk
            cut = pending.rfind(_EVENT_END)
            if cut < 0:
                continue
            cut += len(_EVENT_END)
            complete, pending = pending[:cut], pending[cut:]
            yield rename.model_field(complete)
        if pending:
            yield rename.model_field(pending) if rename else pending
    except httpx.HTTPError:
        yield error_event(
            "the engine stopped while streaming this answer; it is being restarted, retry the request",
            code="engine_stream_interrupted",
        )
    finally:
        await upstream.aclose()
        on_done()
