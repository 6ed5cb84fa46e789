"""The server-sent ``chat.completion.chunk`` events a custom backend's stream is sent as."""

from __future__ import annotations

import time
from typing import Any

import orjson

from loragate.gateway.errors import OpenAIError


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
