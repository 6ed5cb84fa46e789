"""The two servers and what each answered: one recording backend each, under real uvicorns.

``RecordingViBackend`` is a backend as a Vi SDK user writes it (the Vi SDK's own base class and
``GenerationResult``) that records every call as the server made it; ``serving`` runs an app
under a real uvicorn, ``serving_files`` a folder over plain HTTP; ``observe`` sends one corpus
case and keeps what came back and what the backend was handed, with only what is inherently
variable (completion ids, timestamps, uptime, the date, a request id the server made up)
replaced by placeholders.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from vi.deployment.local.backends.base import GenerationResult as ViGenerationResult
from vi.deployment.local.backends.base import InferenceBackend as ViInferenceBackend

from tests.vi_side_by_side.corpus import Case
from tools.harness import free_port


def handed(value: Any) -> Any:
    """What the backend got, comparable across servers: a Pydantic class by its schema."""
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        return {"pydantic_model": value.__name__, "schema": value.model_json_schema()}
    return value


def _prompt_text(kwargs: dict[str, Any]) -> str:
    """The text the answer is made from: ``user_prompt``, else the last message's text, so
    both servers' backends answer alike whatever form the image was handed in."""
    if kwargs.get("user_prompt") is not None:
        return str(kwargs["user_prompt"])
    messages = kwargs.get("messages") or [{}]
    content = messages[-1].get("content")
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


class RecordingViBackend(ViInferenceBackend):
    """A backend as a Vi SDK user writes it: the Vi SDK's base class, its five methods, its
    GenerationResult; it records each call as the server made it, and answers
    ``answer to <prompt>``. Words in the prompt make it misbehave as real backends do:
    ``explode`` raises ValueError before any output, ``fail-midway`` after the first piece,
    ``crash`` raises RuntimeError, ``no-usage`` reports zero tokens, ``cut-short`` finishes
    for ``length``, ``none-piece`` streams a None."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.models = ["vi-model"]
        self.models_fail = False  # available_models() raises, as a backend whose registry is down

    def available_models(self) -> list[str]:
        if self.models_fail:
            raise RuntimeError("the model registry is down")
        return list(self.models)

    def _record(self, method: str, **kwargs: Any) -> str:
        self.calls.append((method, {k: handed(v) for k, v in kwargs.items()}))
        prompt = _prompt_text(kwargs)
        if "explode" in prompt:
            raise ValueError("the backend refuses to explode")
        if "crash" in prompt:
            raise RuntimeError("the backend crashed")
        if "fail-midway" in prompt and not method.startswith("generate_stream"):
            raise ValueError("the backend failed midway")
        return f"answer to {prompt[:40]}"

    def _result(self, text: str) -> ViGenerationResult:
        if "no-usage" in text:
            return ViGenerationResult(text=text, prompt_tokens=0, completion_tokens=0)
        finish = "length" if "cut-short" in text else "stop"
        return ViGenerationResult(
            text=text, prompt_tokens=3, completion_tokens=4, finish_reason=finish
        )

    async def _pieces(self, text: str) -> AsyncIterator[str]:
        for index, word in enumerate(text.split(" ")):
            if index == 1 and "fail-midway" in text:
                raise ValueError("the backend failed midway")
            if index == 1 and "none-piece" in text:
                yield None  # type: ignore[misc]  # a piece real backends send at times
            yield word + " "

    async def generate(
        self, messages: Any, response_format: Any = None, generation_config: Any = None, **kw: Any
    ) -> ViGenerationResult:
        return self._result(
            self._record(
                "generate",
                messages=messages,
                response_format=response_format,
                generation_config=generation_config,
                **kw,
            )
        )

    async def generate_stream(
        self, messages: Any, response_format: Any = None, generation_config: Any = None, **kw: Any
    ) -> AsyncIterator[str]:
        text = self._record(
            "generate_stream",
            messages=messages,
            response_format=response_format,
            generation_config=generation_config,
            **kw,
        )
        async for piece in self._pieces(text):
            yield piece

    async def generate_vi_format(
        self,
        source: Any = None,
        user_prompt: Any = None,
        response_format: Any = None,
        generation_config: Any = None,
        **kw: Any,
    ) -> ViGenerationResult:
        return self._result(
            self._record(
                "generate_vi_format",
                source=source,
                user_prompt=user_prompt,
                response_format=response_format,
                generation_config=generation_config,
                **kw,
            )
        )

    async def generate_stream_vi_format(
        self,
        source: Any = None,
        user_prompt: Any = None,
        response_format: Any = None,
        generation_config: Any = None,
        **kw: Any,
    ) -> AsyncIterator[str]:
        text = self._record(
            "generate_stream_vi_format",
            source=source,
            user_prompt=user_prompt,
            response_format=response_format,
            generation_config=generation_config,
            **kw,
        )
        async for piece in self._pieces(text):
            yield piece


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` under a real uvicorn on a free loopback port."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def serving_files(directory: Path) -> Iterator[str]:
    """``directory`` over plain HTTP on a free loopback port: the corpus's image URLs."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# ----- one case, one server -----------------------------------------------------------------

# What is inherently variable, and only that: completion ids, creation times, the gateway's
# uptime, the date a response was sent (and its length, which the id's length changes), a
# request id the server made up.
_COMPLETION_ID = re.compile(r"chatcmpl-[0-9a-f]+")
_VARIABLE_HEADERS = ("date", "content-length")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _placeholders(value: Any) -> Any:
    if isinstance(value, list):
        return [_placeholders(item) for item in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        if key == "id" and isinstance(item, str) and _COMPLETION_ID.fullmatch(item):
            out[key] = "<id>"
        elif key in ("created", "uptime_s") and _is_number(item):
            out[key] = f"<{key}>"
        else:
            out[key] = _placeholders(item)
    return out


def _events(text: str) -> list[Any]:
    events: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
        elif line:
            events.append({"not an SSE data line": line})
    return events


def _body(response: httpx.Response) -> Any:
    if not response.content:
        return None
    kind = response.headers.get("content-type", "")
    if kind.startswith("text/event-stream"):
        return {"events": _events(response.text)}
    if kind.startswith("application/json"):
        return response.json()
    if kind.startswith("text/html"):
        title = re.search(r"<title>(.*?)</title>", response.text, re.S)
        return {"html page": title.group(1).strip() if title else None}
    return {"text": response.text}


def fill(value: Any, places: dict[str, str]) -> Any:
    """``value`` with each ``{NAME}`` of ``places`` written in (the run's URLs and dirs)."""
    if isinstance(value, str):
        for name, place in places.items():
            value = value.replace("{" + name + "}", place)
        return value
    if isinstance(value, dict):
        return {key: fill(item, places) for key, item in value.items()}
    if isinstance(value, list):
        return [fill(item, places) for item in value]
    return value


def observe(
    client: httpx.Client,
    url: str,
    case: Case,
    backend: RecordingViBackend,
    places: dict[str, str],
) -> dict[str, Any]:
    """What ``url``'s server answered to ``case`` and handed ``backend``, normalised."""
    backend.calls.clear()
    saved = {name: getattr(backend, name) for name in case.backend}
    for name, value in case.backend.items():
        setattr(backend, name, value)
    headers = fill(dict(case.headers), places)
    kwargs: dict[str, Any] = {"headers": headers}
    if case.content is not None:
        kwargs["content"] = fill(case.content, places).encode()
    elif case.body is not None:
        kwargs["content"] = json.dumps(fill(case.body, places)).encode()
        headers.setdefault("Content-Type", "application/json")
    try:
        response = client.request(case.method, url + case.path, **kwargs)
    finally:
        for name, value in saved.items():
            setattr(backend, name, value)
    sent_id = headers.get("X-Request-ID")
    seen_headers = {}
    for name, value in sorted(response.headers.items()):
        if name in _VARIABLE_HEADERS:
            continue
        if name == "x-request-id" and value != sent_id:
            value = "<generated>"
        seen_headers[name] = value
    return {
        "status": response.status_code,
        "headers": seen_headers,
        "body": _placeholders(_body(response)),
        "calls": [[method, kwargs] for method, kwargs in backend.calls],
    }
