"""The generation routes: the requests that make the engine generate text, declared once.

Two the gateway answers itself (``hot``): chat and legacy completions. Their generation
parameters are checked by ``kind`` (``requests.parameters``), a version's preset shapes them
(``requests.presets``), their streams are asked for a usage chunk (``metrics``), and
``routes.inference`` serves them, on the hot path under ``gateway serve``. Two more pass
through from the engine's allow-list (``engine_allow_list``): OpenAI's Responses API and
Anthropic's Messages API. On all four ``--max-tokens-cap`` bounds how many tokens a request
may ask for (``Gateway.cap_tokens``). Every other module reads these rows; none names these
paths again (``tests/unit/test_generation_routes.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# A route of the generation-parameter table: what the gateway checks and a preset shapes.
Route = Literal["chat", "completions"]


@dataclass(frozen=True)
class GenerationRoute:
    path: str
    # What bounds a generation's length, as vLLM's request models name it: the token limits
    # (a request that asks none gets the first, filled in) and the fewest tokens a request may
    # make the engine generate.
    token_limits: tuple[str, ...]
    min_tokens: str | None = None
    # The parameter table's route (its checks, a preset's shaping); None: the engine's checks.
    kind: Route | None = None
    hot: bool = False  # answered by the gateway's own endpoint, not passed through
    # False: the request must name its limit (Anthropic's API: the engine refuses it without),
    # so none is filled in.
    fills_limit: bool = True
    # What the engine generates when no limit is asked, if less than up to the context:
    # a filled-in limit is never above it.
    engine_default: int | None = None


CHAT = GenerationRoute(
    "/v1/chat/completions",
    ("max_tokens", "max_completion_tokens"),
    "min_tokens",
    kind="chat",
    hot=True,
)
COMPLETIONS = GenerationRoute(
    "/v1/completions",
    ("max_tokens",),
    "min_tokens",
    kind="completions",
    hot=True,
    engine_default=16,  # vLLM's (as OpenAI's) for a completion without max_tokens
)
GENERATION_ROUTES: tuple[GenerationRoute, ...] = (
    CHAT,
    COMPLETIONS,
    GenerationRoute("/v1/responses", ("max_output_tokens",)),
    GenerationRoute("/v1/messages", ("max_tokens",), fills_limit=False),
)

BY_PATH: dict[str, GenerationRoute] = {route.path: route for route in GENERATION_ROUTES}
BY_KIND: dict[Route, GenerationRoute] = {
    route.kind: route for route in GENERATION_ROUTES if route.kind is not None
}
HOT_PATHS = frozenset(route.path for route in GENERATION_ROUTES if route.hot)


def kind_of(path: str) -> Route | None:
    """The parameter-table route ``path`` is, a query string after it or not (None: it is
    no route of the table)."""
    return next((r.kind for r in BY_KIND.values() if path.startswith(r.path)), None)
