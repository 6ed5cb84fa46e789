"""Custom backends: the public ``InferenceBackend`` interface, and the adapter that serves one.

``loragate.create_server(backend=MyBackend())`` serves any ``InferenceBackend`` behind the
same routes, checks, auth and error shapes as the supervised engine. The interface is the
Datature Vi SDK's, so a Vi backend ports by changing its base class:

- ``available_models()``: the model ids clients may ask for, base model first;
- ``async generate(messages, response_format, generation_config, **kwargs)``: the whole
  answer, as a ``GenerationResult`` (or just its text);
- ``generate_stream(...)``: an async iterator of text pieces (``None`` pieces are skipped);
- ``generate_vi_format`` / ``generate_stream_vi_format(source, user_prompt, ...)``: what Vi
  requests reach; by default they build the OpenAI messages and call the two above.

``InferenceBackendAdapter`` turns one into the ``GatewayBackend`` the routes talk to: it
builds OpenAI ``chat.completion`` bodies (always with ``usage``) and ``chat.completion.chunk``
server-sent events, and gives ``n``, ``stop`` and ``stream_options.include_usage`` OpenAI's
meaning whatever the backend does with them.
"""

from __future__ import annotations

import inspect
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse

from loragate.gateway.backend import GatewayBackend
from loragate.gateway.chat_request import ChatRequest, ViRequest, vi_messages
from loragate.gateway.errors import OpenAIError

log = logging.getLogger("loragate.gateway")


@dataclass
class GenerationResult:
    """One complete answer and its token counts."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"


class InferenceBackend(ABC):
    """Answers chat requests for ``create_server(backend=...)``.

    Arguments every method gets:

    - ``messages``: OpenAI chat messages, checked; images are ``image_url`` parts whose URL
      is a data URI (local files were read from --allowed-media-dir) or an http(s) URL;
    - ``response_format``: OpenAI's ``response_format`` object as sent (``json_schema`` or
      ``json_object``; the schema is already checked), or None;
    - ``generation_config``: the sampling parameters the client set, under Hugging Face
      names as the Vi SDK passes them: ``max_new_tokens``, ``temperature`` (with
      ``do_sample``), ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop`` (a list),
      ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``, ``logit_bias``,
      ``min_new_tokens``;
    - ``model`` (keyword): the id the client asked for, one of ``available_models()``.

    ``n`` is served by calling a method ``n`` times, and output is cut at the first ``stop``
    string even when the backend ignores it.
    """

    @abstractmethod
    def available_models(self) -> list[str]:
        """The model ids clients may ask for, base model first."""

    @abstractmethod
    async def generate(
        self,
        messages: list[dict[str, Any]],
        response_format: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> GenerationResult | str:
        """The whole answer (a bare string counts its tokens with ``count_tokens``)."""

    @abstractmethod
    def generate_stream(
        self,
        messages: list[dict[str, Any]],
        response_format: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[str | None]:
        """The answer piece by piece (write it as an ``async def`` that ``yield``\\ s strings)."""

    async def generate_vi_format(
        self,
        source: str | None = None,
        user_prompt: str | None = None,
        response_format: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> GenerationResult | str:
        """A Vi request (``source`` is the checked image: a data URI or an http(s) URL).

        ``kwargs`` carry ``model`` and, when the client sent one, ``system_prompt``.
        By default: the OpenAI messages the Vi request stands for, through ``generate``.
        """
        messages = vi_messages(source, user_prompt, kwargs.pop("system_prompt", None))
        return await self.generate(messages, response_format, generation_config, **kwargs)

    async def generate_stream_vi_format(
        self,
        source: str | None = None,
        user_prompt: str | None = None,
        response_format: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[str | None]:
        """A streamed Vi request; by default through ``generate_stream``."""
        messages = vi_messages(source, user_prompt, kwargs.pop("system_prompt", None))
        async for piece in self.generate_stream(
            messages, response_format, generation_config, **kwargs
        ):
            yield piece

    async def start(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Called once before the first request (load models here)."""

    async def stop(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Called once when the server shuts down."""

    def count_tokens(self, text: str) -> int:
        """Token count for ``usage`` where the backend gives none; override with a tokenizer."""
        return len(text.split())


# OpenAI parameter -> the Hugging Face name backends get it under.
_OPENAI_TO_HF = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "logit_bias": "logit_bias",
}
_UNSUPPORTED = ("tools", "functions", "logprobs", "top_logprobs")


def generation_config_of(body: dict[str, Any]) -> dict[str, Any]:
    """The ``generation_config`` a backend gets for an OpenAI request body."""
    config: dict[str, Any] = {}
    for key, target in _OPENAI_TO_HF.items():
        value = body.get(key)
        if value is not None:
            config[target] = value
    if "stop" in config:
        config["stop"] = stop_strings(config["stop"])
    temperature = config.get("temperature")
    if isinstance(temperature, int | float):
        config["do_sample"] = temperature > 0
    return config


def stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise OpenAIError(
        400, "'stop' must be a string or an array of strings.", param="stop", code="invalid_type"
    )


class StopScanner:
    """Cuts streamed text at the first stop string, holding back only what could start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        if not self.stops:
            return piece
        text, self.stopped = cut_at_stop(self.pending + piece, self.stops)
        if self.stopped:
            self.pending = ""
            return text
        keep = min(self.hold, len(text))
        self.pending = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        rest, self.pending = self.pending, ""
        return rest


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
    response_format: dict[str, Any] | None
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
        return list(self.backend.available_models())

    def health(self) -> tuple[bool, dict[str, Any]]:
        try:
            models = self.model_ids()
        except Exception as exc:
            return False, {
                "status": "failed",
                "reason": f"the backend cannot list its models: {exc}",
            }
        if not models:
            return False, {"status": "starting", "reason": "the backend lists no models yet"}
        return True, {"status": "ok", "models": models}

    async def forward(
        self, path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
    ) -> Response:
        if path != "/v1/chat/completions":
            raise OpenAIError(
                404,
                f"This gateway's backend serves /v1/chat/completions only, not {path}.",
                code="not_supported",
            )
        call = self._call(payload, public_model)
        headers = {"X-Request-ID": request_id}
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        if stream:
            events = _Events(completion_id, public_model, call.include_usage)
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
            "usage": _usage(results[0].prompt_tokens, sum(r.completion_tokens for r in results)),
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
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 128:
            raise OpenAIError(
                400, "'n' must be an integer from 1 to 128.", param="n", code="invalid_value"
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

    async def _generate(self, call: _Call) -> GenerationResult:
        answer: Awaitable[GenerationResult | str]
        if call.vi is not None:
            answer = self.backend.generate_vi_format(
                call.vi.source,
                call.vi.user_prompt,
                call.response_format,
                dict(call.generation_config),
                **call.kwargs,
            )
        else:
            answer = self.backend.generate(
                call.messages, call.response_format, dict(call.generation_config), **call.kwargs
            )
        result = await answer
        if isinstance(result, str):
            result = GenerationResult(result)
        if not result.prompt_tokens:
            result.prompt_tokens = self.backend.count_tokens(_prompt_text(call.messages))
        if not result.completion_tokens:
            result.completion_tokens = self.backend.count_tokens(result.text)
        result.text, stopped = cut_at_stop(result.text, call.stops)
        if stopped:
            result.finish_reason = "stop"
        return result

    async def _pieces(self, call: _Call) -> AsyncGenerator[str, None]:
        """The backend's stream for one choice: strings only, None skipped."""
        if call.vi is not None:
            pieces = self.backend.generate_stream_vi_format(
                call.vi.source,
                call.vi.user_prompt,
                call.response_format,
                dict(call.generation_config),
                **call.kwargs,
            )
        else:
            pieces = self.backend.generate_stream(
                call.messages, call.response_format, dict(call.generation_config), **call.kwargs
            )
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
        events: _Events,
        first_pieces: AsyncGenerator[str, None],
        first: str | None,
    ) -> AsyncIterator[bytes]:
        prompt_tokens = self.backend.count_tokens(_prompt_text(call.messages))
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


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class _Events:
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
            {**self.base, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)}
        )

    def error(self, error: OpenAIError) -> bytes:
        return self._event(error.body()) + b"data: [DONE]\n\n"


def as_gateway_backend(backend: object) -> GatewayBackend:
    """``backend`` as the routes need it: an ``InferenceBackend`` is wrapped, a ``GatewayBackend`` kept."""
    if isinstance(backend, InferenceBackend):
        return InferenceBackendAdapter(backend)
    needed = ("start", "stop", "model_ids", "health", "forward")
    if all(callable(getattr(backend, name, None)) for name in needed):
        return backend  # type: ignore[return-value]
    if inspect.isclass(backend):
        raise TypeError(f"pass an instance of {backend.__name__}, not the class")
    raise TypeError(
        f"{type(backend).__name__} is not an InferenceBackend: subclass loragate.InferenceBackend "
        "and implement available_models(), generate() and generate_stream()"
    )
