"""``gateway chat MODEL``: talk to a model from the terminal, as ``ollama run MODEL`` does.

Each line read is a turn: sent with the conversation so far to the gateway's
``/v1/chat/completions`` and answered token by token as the stream comes. On a terminal it
prompts (``>>> ``), and an error or a Ctrl-C ends only that turn; piped (``echo hi | gateway
chat base``) it prompts nothing, answers each line, stops at the end of its input, and an
error ends it with exit 1, as any other command's failure.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer

from loragate.cli_admin import (
    DEFAULT_URL,
    AdminKeyOption,
    CacheDirOption,
    UrlOption,
    error_answer,
    local_admin_token,
    unreachable,
)
from loragate.cli_errors import FAILURE, USAGE, fail, show_error
from loragate.http.sse import sse_data, sse_lines

if TYPE_CHECKING:
    import httpx

PROMPT = ">>> "
BYE = "/bye"
# An answer may take as long as the model generates: only connecting is bounded here (the
# gateway's --upstream-timeout bounds an engine that goes quiet).
CONNECT_SECONDS = 10.0


class ChatError(Exception):
    """A turn the gateway refused or broke off, in one line (its status and message)."""


class Conversation:
    """The messages so far, and each new turn streamed from the gateway's chat endpoint."""

    def __init__(
        self,
        client: httpx.Client,
        url: str,
        model: str,
        *,
        key: str | None = None,
        system: str | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.client = client
        self.url = url
        self.endpoint = url.rstrip("/") + "/v1/chat/completions"
        self.model = model
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.max_tokens = max_tokens
        self.messages: list[dict[str, str]] = (
            [{"role": "system", "content": system}] if system else []
        )

    def answer(self, prompt: str) -> Generator[str, None, None]:
        """The answer to ``prompt``, piece by piece as it streams. Once it has streamed whole,
        the turn joins the conversation; closed before (Ctrl-C), the turn is dropped and the
        stream closed, which stops the generation."""
        messages = [*self.messages, {"role": "user", "content": prompt}]
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        import httpx

        pieces: list[str] = []
        try:
            with self.client.stream(
                "POST", self.endpoint, json=body, headers=self.headers
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ChatError(error_answer(response))
                for piece in _pieces(response):
                    pieces.append(piece)
                    yield piece
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ChatError(unreachable(self.url, exc)) from None
        except httpx.HTTPError as exc:  # the connection failed mid-answer
            raise ChatError(f"the answer broke off: {exc}") from None
        self.messages = [*messages, {"role": "assistant", "content": "".join(pieces)}]


def _pieces(response: httpx.Response) -> Iterator[str]:
    """The answer's text as it comes: each event's delta; a gateway that answers whole (a
    backend that does not stream), its one message."""
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            payload = json.loads(response.read())
        except ValueError:
            raise ChatError("the gateway's answer is not JSON") from None
        yield _text_of(payload, "message")
        return
    for data in sse_data(sse_lines(response.iter_bytes())):
        if data.strip() == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise ChatError(f"the gateway sent an event that is not JSON: {data[:80]!r}") from None
        if isinstance(event, dict) and "error" in event:  # mid-stream: the engine failed
            error = event["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            raise ChatError(f"the answer broke off: {message}")
        text = _text_of(event, "delta")
        if text:
            yield text


def _text_of(payload: Any, part: str) -> str:
    try:
        content = payload["choices"][0][part].get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        return ""
    return content if isinstance(content, str) else ""


def converse(
    conversation: Conversation,
    read_line: Callable[[], str | None],
    echo: Callable[[str], None],
    *,
    interactive: bool,
) -> None:
    """Read a turn, stream its answer, until ``/bye`` or the end of the input (None).

    ``interactive`` (a terminal): an error or a Ctrl-C ends only the turn. Piped, an error
    fails the command (exit 1), a Ctrl-C ends it (exit 130)."""
    while True:
        try:
            line = read_line()
        except KeyboardInterrupt:
            if not interactive:
                raise typer.Exit(130) from None
            echo(f"\nUse Ctrl-D or {BYE} to leave.\n")
            continue
        if line is None:
            if interactive:
                echo("\n")
            return
        prompt = line.strip()
        if prompt == BYE:
            return
        if not prompt:
            continue
        answer = conversation.answer(prompt)
        shown = False
        try:
            for piece in answer:
                echo(piece)
                shown = True
        except KeyboardInterrupt:
            answer.close()  # closes the stream: the gateway cancels the generation
            echo("\n")
            if not interactive:
                raise typer.Exit(130) from None
            continue
        except ChatError as exc:
            if shown:
                echo("\n")
            if not interactive:
                fail(str(exc), FAILURE)
            show_error(str(exc))
            continue
        echo("\n")


def chat(
    model: Annotated[
        str, typer.Argument(metavar="MODEL", help="The base model or adapter to talk to.")
    ],
    system: Annotated[
        str | None, typer.Option(metavar="TEXT", help="A system prompt for the conversation.")
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(min=1, metavar="INT", help="Tokens an answer may have, at most."),
    ] = None,
    url: UrlOption = DEFAULT_URL,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="LORAGATE_API_KEY",
            metavar="KEY",
            help="An inference key of the gateway (its first, when the variable lists "
            "several); default: the admin key, which the gateway takes for inference too.",
        ),
    ] = None,
    admin_key: AdminKeyOption = None,
    cache_dir: CacheDirOption = None,
) -> None:
    """Talk to MODEL from the terminal, its answers streamed as they come.

    Each line is a turn, sent with the conversation so far; /bye or Ctrl-D ends, Ctrl-C
    stops an answer. Piped, it answers each line of its input and ends with it:
    `echo hi | gateway chat MODEL`."""
    import httpx

    key = _inference_key(api_key) or admin_key or local_admin_token(url, cache_dir)
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):  # not on every platform
            import readline  # noqa: F401  (input() then edits lines and recalls earlier ones)
    timeout = httpx.Timeout(None, connect=CONNECT_SECONDS)
    # The key goes to the gateway itself, never to an HTTP(S)_PROXY from the environment.
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        conversation = Conversation(
            client, url, model, key=key, system=system, max_tokens=max_tokens
        )
        converse(conversation, _prompted if interactive else _piped, _echo, interactive=interactive)


def _inference_key(given: str | None) -> str | None:
    """The first key of ``--api-key`` or ``LORAGATE_API_KEY``, read as the gateway reads the
    variable (a comma-separated or JSON list)."""
    if not given:
        return None
    from loragate.settings.sources import list_value

    try:
        keys = list_value("api_key", given)
    except ValueError as exc:  # a JSON list that is not one
        fail(f"--api-key (LORAGATE_API_KEY): {exc}", USAGE)
    return str(keys[0]) if keys else None


def _prompted() -> str | None:
    try:
        return input(PROMPT)
    except EOFError:  # Ctrl-D
        return None


def _piped() -> str | None:
    line = sys.stdin.readline()
    return line if line else None


def _echo(text: str) -> None:
    typer.echo(text, nl=False)
