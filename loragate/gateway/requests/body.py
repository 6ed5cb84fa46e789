"""Reading and checking a JSON request body before anything reaches a backend.

Every JSON body the gateway takes (inference, pass-through and admin routes, the hot path's
too) is parsed here, once, under one shape limit: at most ``MAX_BODY_CONTAINERS`` objects and
arrays and ``MAX_BODY_DEPTH`` levels, past which checking a JSON Schema in the body or writing
it again for the engine would fail. Both are read on the bytes (``brackets_of``), in C, the
count before any value becomes a Python object (a million small objects would be ~300 MiB of
them); past either, a 400 that says so, as for a malformed body. What the gateway walks
afterwards (``containers``) costs a step per object or array, numbers and strings passed over
inside C, and names a field only for what it reports.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import compress
from typing import Any

import orjson
from starlette.requests import Request

from loragate.gateway.errors import OpenAIError

# How deep a body may nest: far past any real request (a JSON Schema included), and short of
# the depths where jsonschema (~200 levels) and orjson's writer (254) fail.
MAX_BODY_DEPTH = 64
# How many objects and arrays a body may hold: past any real request (2,048 embedding inputs
# of token ids are 2,049; a chat of 1,024 messages, 40 parts each, ~43,000), and it bounds
# the gateway's work and memory per body whatever --max-body-bytes allows. Numbers and
# strings are not counted: a big array of them is one array, cheap to walk.
MAX_BODY_CONTAINERS = 100_000


async def read_json_object(
    request: Request, max_bytes: int, limit_name: str = "--max-body-bytes"
) -> dict[str, Any]:
    """The body as a JSON object; 415 unless declared JSON, 413 past ``max_bytes`` (the limit
    ``limit_name`` names), 400 for anything that is not one. A client that leaves midway
    raises starlette's ``ClientDisconnect``: a 499 (``errors.install_error_handlers``)."""
    check_json_content_type(request.headers.get("content-type"))
    check_declared_length(request.headers.get("content-length"), max_bytes, limit_name)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes, limit_name)
        chunks.append(chunk)
    return parse_json_object(b"".join(chunks))


def check_json_content_type(content_type: str | None) -> None:
    """415 unless the body is declared ``application/json``.

    A web page may send a text/plain, form or untyped body to any address without a CORS
    preflight, so such a body could come from any page the user has open; a JSON one cannot.
    """
    if content_type is not None:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type == "application/json":
            return
    raise OpenAIError(
        415,
        "Send the request body as JSON with the header 'Content-Type: application/json' "
        "(curl: -H 'Content-Type: application/json').",
        code="unsupported_media_type",
    )


def check_declared_length(
    declared: str | None, max_bytes: int, limit_name: str = "--max-body-bytes"
) -> None:
    """413 now for a Content-Length past ``max_bytes``, before a byte of the body is read."""
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes, limit_name)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object within the shape limits; 400 for anything else."""
    if not raw:
        raise OpenAIError(
            400, "The request body is empty; send a JSON object.", code="invalid_json"
        )
    body = parse_json(raw, "The request body")
    if not isinstance(body, dict):
        raise OpenAIError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


def parse_json(raw: bytes | str, what: str, param: str | None = None) -> Any:
    """``raw`` parsed within the shape limits (``MAX_BODY_CONTAINERS``, ``MAX_BODY_DEPTH``);
    a 400 naming ``what`` (and ``param``, where a field holds the text) when it is not."""
    data = raw.encode() if isinstance(raw, str) else raw
    # Fewer openers than levels allowed (most requests): nothing to count or measure.
    few = data.count(b"{") + data.count(b"[") <= MAX_BODY_DEPTH
    brackets = b"" if few else brackets_of(data, MAX_BODY_CONTAINERS)
    if brackets is None or brackets.count(b"[") > MAX_BODY_CONTAINERS:
        raise OpenAIError(
            400,
            f"{what} holds more than {MAX_BODY_CONTAINERS} JSON objects and arrays; no "
            "request needs that many: send a batch that large as several requests.",
            param=param,
            code="body_too_wide",
        )
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise OpenAIError(
            400, f"{what} is not valid JSON: {exc}", param=param, code="invalid_json"
        ) from None
    if not few and nesting(brackets, MAX_BODY_DEPTH + 1) > MAX_BODY_DEPTH + 1:
        # Where, for the message: the walk stops at the first object or array too deep.
        keys = next(keys for _, keys in containers(value) if len(keys) > MAX_BODY_DEPTH)
        where = json_path([param, *keys] if param else keys)
        raise OpenAIError(
            400,
            f"{what} nests deeper than {MAX_BODY_DEPTH} levels (at {where}); no request "
            "needs that.",
            param=where,
            code="body_too_deep",
        )
    return value


def too_large(max_bytes: int, limit_name: str = "--max-body-bytes") -> OpenAIError:
    return OpenAIError(
        413,
        f"The request body is larger than {max_bytes} bytes ({limit_name}).",
        code="request_too_large",
    )


# ----- the shape of a body: counted on its bytes, walked without a step per value ---------------

# Every byte but a quote and a bracket, for ``bytes.translate`` to delete; and all brackets
# as square ones.
_NOT_MARKS = bytes(b for b in range(256) if b not in b'"[]{}')
_SQUARE = bytes.maketrans(b"{}", b"[]")


def brackets_of(raw: bytes, limit: int) -> bytes | None:
    """The brackets of the JSON text ``raw`` outside its strings, in order, all made square
    (``{"a": [1, "]"]}`` is ``[[]]``); None when it surely opens more than ``limit`` objects
    and arrays. Only bytes operations, so C's speed, no Python object per value, and memory
    within a few copies of ``raw``. For text that is not JSON, a guess; the parser then says
    what is wrong with it."""
    # Escapes first (escaped backslashes, then escaped quotes): every quote left delimits a
    # string. Then only the quotes and brackets are kept, and pairs of adjacent quotes
    # dropped: there is nothing between them, and dropping two keeps every other quote's
    # parity.
    marks = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(_SQUARE, _NOT_MARKS)
    marks = marks.replace(b'""', b"")
    strings = marks.count(b'"') // 2
    if not strings:
        return marks
    # No two quotes are adjacent now, so between one string and the next stands a bracket
    # outside both; each object or array has two: the strings bound the count, and the
    # pieces split below.
    if strings - 1 > 2 * limit:
        return None
    return b"".join(marks.split(b'"')[::2])  # outside strings: the even pieces


def nesting(brackets: bytes, most: int) -> int:
    """How deeply the square ``brackets`` (``brackets_of``) nest, or ``most + 1`` when deeper
    than ``most``: each round drops the innermost pairs, inside C."""
    depth = 0
    while brackets:
        if depth == most:
            return most + 1
        brackets = brackets.replace(b"[]", b"")
        depth += 1
    return depth


_CONTAINER_TYPES = frozenset({dict, list})
_IS_CONTAINER = _CONTAINER_TYPES.__contains__
_NOTHING: Iterator[Any] = iter(())
Key = str | int


def _inner(node: Any) -> Iterator[tuple[Key, Any]]:
    """The objects and arrays directly in ``node``, with their keys; its other values are
    passed over inside C (``map``, ``compress``), not a Python step each."""
    values = node.values() if type(node) is dict else node
    if _CONTAINER_TYPES.isdisjoint(set(map(type, values))):
        return _NOTHING  # all numbers and strings (token ids, embeddings): the quick way
    pairs = node.items() if type(node) is dict else enumerate(node)
    return compress(pairs, map(_IS_CONTAINER, map(type, values)))


def containers(body: Any) -> Iterator[tuple[Any, list[Key]]]:
    """Every object and array in ``body`` (``body`` first, if it is one), depth first in the
    body's order, with the keys and indexes that lead to it: one list that the walk changes
    as it goes, so ``json_path`` it before the next step. No recursion: any depth walks."""
    if type(body) not in (dict, list):
        return
    keys: list[Key] = []
    yield body, keys
    stack = [_inner(body)]
    while stack:
        for key, child in stack[-1]:
            keys.append(key)
            yield child, keys
            stack.append(_inner(child))
            break
        else:
            stack.pop()
            if stack:
                keys.pop()


def json_path(keys: list[Key] | tuple[Key, ...]) -> str:
    """``messages[0].content[3]``: where in a body the ``keys`` lead."""
    out: list[str] = []
    for key in keys:
        if type(key) is int:
            out.append(f"[{key}]")
        else:
            out.append(f".{key}" if out else str(key))
    return "".join(out)
