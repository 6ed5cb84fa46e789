"""What a custom backend's OpenAI parameters mean: ``generation_config`` under the Hugging Face
names the Vi SDK passes, and ``stop`` strings, which cut the output whatever the backend does
with them."""

from __future__ import annotations

from typing import Any

from loragate.gateway.errors import OpenAIError

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


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)
