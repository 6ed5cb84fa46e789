"""Custom backends: the public ``InferenceBackend`` interface a custom backend implements.

``loragate.create_server(backend=MyBackend())`` serves any ``InferenceBackend`` behind the
same routes, checks, auth and error shapes as the supervised engine. The interface is the
Datature Vi SDK's, so a Vi backend ports by changing its base class:

- ``available_models()``: the model ids clients may ask for, base model first;
- ``async generate(messages, response_format, generation_config, **kwargs)``: the whole
  answer, as a ``GenerationResult`` (or just its text);
- ``generate_stream(...)``: an async iterator of text pieces (``None`` pieces are skipped);
- ``generate_vi_format`` / ``generate_stream_vi_format(source, user_prompt, ...)``: what Vi
  requests reach; by default they build the OpenAI messages and call the two above.

``custom_adapter.InferenceBackendAdapter`` turns one into the ``GatewayBackend`` the
routes talk to.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from loragate.gateway.requests.vi import vi_messages


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
      is always a data URI (local files were read from --allowed-media-dir, http(s) URLs
      fetched by the gateway, raw base64 given its prefix);
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
        """A Vi request (``source`` is the checked image or video, as a data URI).

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
