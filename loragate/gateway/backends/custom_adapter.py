"""Serving a custom ``InferenceBackend`` as the ``GatewayBackend`` the routes talk to.

``InferenceBackendAdapter`` builds OpenAI ``chat.completion`` bodies (always with ``usage``)
and ``chat.completion.chunk`` server-sent events (``custom_events``), and gives ``n``,
``stop`` and ``stream_options.include_usage`` OpenAI's meaning whatever the backend does with
them (``custom_parameters``). A Vi request reaches the backend's Vi entry points.
"""

from __future__ import annotations

import inspect
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse

from loragate.gateway.backends.base import GatewayBackend
from loragate.gateway.backends.custom import GenerationResult, InferenceBackend
from loragate.gateway.backends.custom_parameters import (
    StopScanner,
    check_vi_schema,
    cut_at_stop,
    generation_config_of,
    stop_strings,
    vi_generation_config,
    vi_response_model,
)
from loragate.gateway.errors import OpenAIError
from loragate.gateway.generation_routes import CHAT
from loragate.gateway.requests.chat import ChatRequest
from loragate.gateway.requests.parameters import MAX_N
from loragate.gateway.requests.vi import ViRequest


# The server-sent ``chat.completion.chunk`` events a custom backend's stream is sent as.
def openai_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ChunkEvents:
    """Server-sent ``chat.completion.chunk`` events of one completion."""

    def __init__(self, completion_id: str, model: str, include_usage: bool) -> None:
        self.base = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        self.include_usage = include_usage

    def _event(self, body: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def chunk(self, index: int, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        body: dict[str, Any] = {**self.base, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None  # as OpenAI: only the last event carries usage
        return self._event(body)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self._event(
            {**self.base, "choices": [], "usage": openai_usage(prompt_tokens, completion_tokens)}
        )

    def error(self, error: OpenAIError) -> bytes:
        return self._event(error.body()) + b"data: [DONE]\n\n"


log = logging.getLogger("loragate.gateway")

_UNSUPPORTED = ("tools", "functions", "logprobs", "top_logprobs")


def _prompt_text(messages: list[dict[str, Any]]) -> str:
    texts: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            ]
    return "\n".join(texts)


def _backend_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, NotImplementedError):
        return OpenAIError(
            400, f"This backend cannot do that: {exc or 'not implemented'}", code="not_supported"
        )
    if isinstance(exc, ValueError):  # Vi backends' way of saying "bad request"
        return OpenAIError(400, str(exc), code="invalid_request")
    log.exception("the inference backend failed", exc_info=exc)
    return OpenAIError(
        500, f"The backend failed: {type(exc).__name__}: {exc}", code="backend_error"
    )


@dataclass
class _Call:
    """One request, ready to hand to the backend."""

    vi: ViRequest | None
    messages: list[dict[str, Any]]
    response_format: Any  # OpenAI's object; a Pydantic model class for a Vi SDK backend
    generation_config: dict[str, Any]
    kwargs: dict[str, Any]
    n: int
    stops: list[str]
    include_usage: bool


class InferenceBackendAdapter:
    """Serves an ``InferenceBackend`` as the ``GatewayBackend`` the routes talk to."""

    def __init__(self, backend: InferenceBackend) -> None:
        self.backend = backend

    async def start(self) -> None:
        await self.backend.start()

    async def stop(self) -> None:
        await self.backend.stop()

    def model_ids(self) -> list[str]:
        """The backend's ``available_models()``; a 500 in OpenAI's shape (one log line, no
        traceback) when it raises, as the Vi server answers it, never the ASGI server's
        plain-text one."""
        try:
            return list(self.backend.available_models())
        except Exception as exc:
            log.error(
                "the inference backend cannot list its models: %s: %s", type(exc).__name__, exc
            )
            raise OpenAIError(
                500,
                f"The backend cannot list its models: {type(exc).__name__}: {exc}",
                code="backend_error",
            ) from None

    def _count_tokens(self, text: str) -> int:
        return self.backend.count_tokens(text)

    def health(self) -> tuple[bool, dict[str, Any]]:
        try:  # not model_ids(): a probe's failure is its answer, not a line in the log
            models = list(self.backend.available_models())
        except Exception as exc:
            return False, {
                "status": "failed",
                "reason": f"the backend cannot list its models: {exc}",
            }
        if not models:
            return False, {"status": "starting", "reason": "the backend lists no models yet"}
        return True, {"status": "healthy", "models": models}

    async def forward(
        self, path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
    ) -> Response:
        if path != CHAT.path:
            raise OpenAIError(
                404,
                f"This gateway's backend serves /v1/chat/completions only, not {path}.",
                code="not_supported",
            )
        call = self._call(payload, public_model)
        headers = {"X-Request-ID": request_id}
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        if stream:
            events = ChunkEvents(completion_id, public_model, call.include_usage)
            first_pieces = self._pieces(call)
            try:
                # Wait for the first piece: a failure before any output gets a proper status.
                first = await anext(first_pieces, None)
            except Exception as exc:
                await first_pieces.aclose()
                raise _backend_error(exc) from None
            return StreamingResponse(
                self._stream(call, events, first_pieces, first),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
            )
        try:
            results = [await self._generate(call) for _ in range(call.n)]
        except Exception as exc:
            raise _backend_error(exc) from None
        body = {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": public_model,
            "choices": [
                {
                    "index": index,
                    "message": {"role": "assistant", "content": result.text},
                    "logprobs": None,
                    "finish_reason": result.finish_reason,
                }
                for index, result in enumerate(results)
            ],
            "usage": openai_usage(
                results[0].prompt_tokens, sum(r.completion_tokens for r in results)
            ),
        }
        return Response(orjson.dumps(body), media_type="application/json", headers=headers)

    # ----- one request -------------------------------------------------------------------

    def _call(self, payload: dict[str, Any], public_model: str) -> _Call:
        for field in _UNSUPPORTED:
            if payload.get(field):
                raise OpenAIError(
                    400,
                    f"'{field}' is not supported by this gateway's backend.",
                    param=field,
                    code="not_supported",
                )
        n = payload.get("n", 1)
        if n is None:
            n = 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            raise OpenAIError(
                400, f"'n' must be an integer from 1 to {MAX_N}.", param="n", code="invalid_value"
            )
        options = payload.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        vi = payload.vi if isinstance(payload, ChatRequest) else None
        kwargs: dict[str, Any] = {"model": public_model}
        if vi is not None and vi.system_prompt:
            kwargs["system_prompt"] = vi.system_prompt
        return _Call(
            vi=vi,
            messages=payload["messages"],
            response_format=payload.get("response_format"),
            generation_config=generation_config_of(payload),
            kwargs=kwargs,
            n=n,
            stops=stop_strings(payload.get("stop")),
            include_usage=include_usage,
        )

    def _answer(self, call: _Call) -> Awaitable[Any]:
        """The backend's whole answer to ``call`` (its Vi entry point for a Vi request)."""
        if call.vi is not None:
            return self.backend.generate_vi_format(
                call.vi.source,
                call.vi.user_prompt,
                call.response_format,
                dict(call.generation_config),
                **call.kwargs,
            )
        return self.backend.generate(
            call.messages, call.response_format, dict(call.generation_config), **call.kwargs
        )

    def _answer_stream(self, call: _Call) -> AsyncIterator[Any]:
        """The backend's streamed answer to ``call`` (its Vi entry point for a Vi request)."""
        if call.vi is not None:
            return self.backend.generate_stream_vi_format(
                call.vi.source,
                call.vi.user_prompt,
                call.response_format,
                dict(call.generation_config),
                **call.kwargs,
            )
        return self.backend.generate_stream(
            call.messages, call.response_format, dict(call.generation_config), **call.kwargs
        )

    async def _generate(self, call: _Call) -> GenerationResult:
        result = await self._answer(call)
        if isinstance(result, str):
            result = GenerationResult(result)
        elif not isinstance(result, GenerationResult):  # the Vi SDK's own GenerationResult
            result = GenerationResult(
                result.text, result.prompt_tokens, result.completion_tokens, result.finish_reason
            )
        if not result.prompt_tokens:
            result.prompt_tokens = self._count_tokens(_prompt_text(call.messages))
        if not result.completion_tokens:
            result.completion_tokens = self._count_tokens(result.text)
        result.text, stopped = cut_at_stop(result.text, call.stops)
        if stopped:
            result.finish_reason = "stop"
        return result

    async def _pieces(self, call: _Call) -> AsyncGenerator[str, None]:
        """The backend's stream for one choice: strings only, None skipped."""
        pieces = self._answer_stream(call)
        try:
            async for piece in pieces:
                if piece is None:
                    continue
                yield piece if isinstance(piece, str) else str(piece)
        finally:
            closer = getattr(pieces, "aclose", None)
            if closer is not None:
                await closer()

    async def _stream(
        self,
        call: _Call,
        events: ChunkEvents,
        first_pieces: AsyncGenerator[str, None],
        first: str | None,
    ) -> AsyncIterator[bytes]:
        prompt_tokens = self._count_tokens(_prompt_text(call.messages))
        completion_tokens = 0
        try:
            for index in range(call.n):
                pieces = _peeked(first, first_pieces) if index == 0 else self._pieces(call)
                scanner = StopScanner(call.stops)
                yield events.chunk(index, {"role": "assistant", "content": ""})
                try:
                    async for piece in pieces:
                        completion_tokens += 1 if piece else 0
                        text = scanner.feed(piece)
                        if text:
                            yield events.chunk(index, {"content": text})
                        if scanner.stopped:
                            break
                finally:
                    await pieces.aclose()
                rest = scanner.flush()
                if rest:
                    yield events.chunk(index, {"content": rest})
                yield events.chunk(index, {}, finish_reason="stop")
            if call.include_usage:
                yield events.usage(prompt_tokens, completion_tokens)
            yield b"data: [DONE]\n\n"
        except Exception as exc:
            yield events.error(_backend_error(exc))


async def _peeked(first: str | None, rest: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    """``rest`` with its already-taken first piece put back in front."""
    try:
        if first is not None:
            yield first
        async for piece in rest:
            yield piece
    finally:
        await rest.aclose()


VI_BACKEND_METHODS = (
    "available_models",
    "generate",
    "generate_stream",
    "generate_vi_format",
    "generate_stream_vi_format",
)
"""The abstract methods of the Vi SDK's ``InferenceBackend``
(``vi/deployment/local/backends/base.py``): a backend with all five is served as the Vi
SDK's server serves it, whatever its base class."""


class ViBackendAdapter(InferenceBackendAdapter):
    """Serves a backend written for the Vi SDK's own server (an instance of the Vi SDK's
    ``InferenceBackend``, or anything with its five methods) as it is, handing it what that
    server hands it (``vi/deployment/local/server.py``: ``chat_completions`` and
    ``stream_completion``): keyword arguments ``messages`` (role and content) or ``source``
    and ``user_prompt``, ``response_format`` as a Pydantic model class and
    ``generation_config`` built from the request as sent, and no other keyword; what that
    server's request schema refuses is a 400 before it is asked (``check_vi_schema``).
    loragate's optional hooks (``start``, ``stop``, ``count_tokens``) are used where it has
    them."""

    backend: Any

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    async def start(self) -> None:
        await _maybe_await(getattr(self.backend, "start", None))

    async def stop(self) -> None:
        await _maybe_await(getattr(self.backend, "stop", None))

    def _count_tokens(self, text: str) -> int:
        count = getattr(self.backend, "count_tokens", None)
        return int(count(text)) if callable(count) else len(text.split())

    def model_entries(self) -> list[dict[str, Any]]:
        """``/v1/models`` as the Vi server lists it: every model on its own, none an adapter
        of the first (the routes would read the models after the first as its adapters)."""
        return [{"id": model, "parent": None} for model in self.model_ids()]

    def _call(self, payload: dict[str, Any], public_model: str) -> _Call:
        call = super()._call(payload, public_model)
        sent = getattr(payload, "sent", payload)
        check_vi_schema(sent, call.messages)
        if "system_prompt" in call.kwargs:
            raise OpenAIError(
                400,
                "This backend is written for the Vi SDK's server, whose generate_vi_format "
                "takes no 'system_prompt'; send 'messages' with a system message instead.",
                param="system_prompt",
                code="not_supported",
            )
        call.kwargs = {}
        call.generation_config = vi_generation_config(sent)
        call.response_format = vi_response_model(call.response_format)
        call.messages = [{"role": m["role"], "content": m.get("content")} for m in call.messages]
        return call

    def _answer(self, call: _Call) -> Awaitable[Any]:
        if call.vi is not None:
            return self.backend.generate_vi_format(
                source=call.vi.source,
                user_prompt=call.vi.user_prompt,
                response_format=call.response_format,
                generation_config=dict(call.generation_config),
            )
        return self.backend.generate(
            messages=call.messages,
            response_format=call.response_format,
            generation_config=dict(call.generation_config),
        )

    def _answer_stream(self, call: _Call) -> AsyncIterator[Any]:
        if call.vi is not None:
            return self.backend.generate_stream_vi_format(
                source=call.vi.source,
                user_prompt=call.vi.user_prompt,
                response_format=call.response_format,
                generation_config=dict(call.generation_config),
            )
        return self.backend.generate_stream(
            messages=call.messages,
            response_format=call.response_format,
            generation_config=dict(call.generation_config),
        )


async def _maybe_await(hook: Any) -> None:
    if callable(hook):
        result = hook()
        if inspect.isawaitable(result):
            await result


def as_gateway_backend(backend: object) -> GatewayBackend:
    """``backend`` as the routes need it: an ``InferenceBackend`` (loragate's, or the Vi SDK's
    by its five methods) is wrapped, a ``GatewayBackend`` kept."""
    if isinstance(backend, InferenceBackend):
        return InferenceBackendAdapter(backend)
    if not inspect.isclass(backend) and all(
        callable(getattr(backend, name, None)) for name in VI_BACKEND_METHODS
    ):
        return ViBackendAdapter(backend)
    needed = ("start", "stop", "model_ids", "health", "forward")
    if all(callable(getattr(backend, name, None)) for name in needed):
        return backend  # type: ignore[return-value]
    if inspect.isclass(backend):
        raise TypeError(f"pass an instance of {backend.__name__}, not the class")
    raise TypeError(
        f"{type(backend).__name__} is not an InferenceBackend: subclass loragate.InferenceBackend "
        "and implement available_models(), generate() and generate_stream(), or pass a Vi SDK "
        "backend (the five methods of vi.deployment.local.backends.InferenceBackend)"
    )
