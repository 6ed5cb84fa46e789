"""How each difference of the table is recognised in one case's pair of observations.

Each function takes the body as sent, the Vi server's observation and loragate's (``Seen``:
status, headers, body, what the backend was handed), checks that the difference is what its
row in ``differences`` says, settles that aspect in both so the rest can be compared, and
answers whether it found the difference.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from loragate.gateway.requests.parameters import MAX_N
from tests.vi_side_by_side.corpus import PNG_URI

Seen = dict[str, Any]
"""One server's answer to one case: ``status``, ``headers``, ``body``, ``calls``."""

Explain = Callable[[dict[str, Any], Seen, Seen], bool]
"""(the body as sent, the Vi server's answer, loragate's) -> whether the row applied."""


def _settle(vi: Seen, lg: Seen, *aspects: str) -> None:
    for aspect in aspects:
        vi[aspect] = copy.deepcopy(lg[aspect])


def _settle_headers(vi: Seen, lg: Seen, *names: str) -> None:
    for name in names:
        if name in lg["headers"]:
            vi["headers"][name] = lg["headers"][name]
        else:
            vi["headers"].pop(name, None)


def _error(seen: Seen) -> dict[str, Any] | None:
    body = seen["body"]
    error = body.get("error") if isinstance(body, dict) and len(body) == 1 else None
    return error if isinstance(error, dict) and "code" in error else None


def _events(seen: Seen) -> list[Any] | None:
    body = seen["body"]
    return body["events"] if isinstance(body, dict) and "events" in body else None


def _chunks(events: list[Any]) -> list[dict[str, Any]]:
    return [e for e in events if isinstance(e, dict) and "choices" in e]


def _delta(event: Any) -> dict[str, Any] | None:
    """A chunk's first choice's delta; None for ``[DONE]``, errors and the usage chunk."""
    if isinstance(event, dict) and event.get("choices"):
        return event["choices"][0].get("delta")
    return None


def _content(seen: Seen) -> str | None:
    """The answer's text, whole or streamed (choice 0)."""
    events = _events(seen)
    if events is not None:
        return "".join((_delta(e) or {}).get("content") or "" for e in events)
    body = seen["body"]
    if isinstance(body, dict) and body.get("object") == "chat.completion":
        return str(body["choices"][0]["message"]["content"])
    return None


# ----- the shapes of a refusal ---------------------------------------------------------------


def _refusal(vi: Seen, lg: Seen, statuses: tuple[int, ...] = (400,)) -> dict[str, Any] | None:
    """loragate's error when it refused (one of ``statuses``) a request the Vi server served
    or failed on; the refusal settled (status, body, backend calls, content type)."""
    error = _error(lg)
    if error is None or lg["status"] not in statuses or 400 <= vi["status"] < 500:
        return None
    return error


def _settle_refusal(vi: Seen, lg: Seen) -> bool:
    _settle(vi, lg, "status", "body", "calls")
    _settle_headers(vi, lg, "content-type", "transfer-encoding")
    return True


def refused_when(test: Callable[[dict[str, Any], dict[str, Any]], bool], *statuses: int) -> Explain:
    """A row for requests the Vi server serves and loragate refuses: ``test(sent, error)``."""

    def explain(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
        error = _refusal(vi, lg, statuses or (400,))
        return error is not None and test(sent, error) and _settle_refusal(vi, lg)

    return explain


def status_when(vi_status: int, lg_status: int, test: Callable[[Seen, Seen], bool]) -> Explain:
    """A row for a status that differs on both refusing or failing (the bodies are left to
    ``error-shape``)."""

    def explain(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
        if (vi["status"], lg["status"]) != (vi_status, lg_status) or not test(vi, lg):
            return False
        _settle(vi, lg, "status")
        return True

    return explain


def _param(error: dict[str, Any]) -> str:
    return str(error.get("param") or "")


# ----- headers ------------------------------------------------------------------------------

_SECURITY_HEADERS = {
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
}


def security_headers(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    found = False
    for name, value in _SECURITY_HEADERS.items():
        if lg["headers"].get(name) == value and name not in vi["headers"]:
            del lg["headers"][name]
            found = True
    csp = lg["headers"].get("content-security-policy", "")
    if csp.startswith("default-src 'none'") and "content-security-policy" not in vi["headers"]:
        del lg["headers"]["content-security-policy"]
        found = True
    return found


def request_id(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    # The value is "<generated>" (observe's placeholder) or the one the client sent.
    return "x-request-id" not in vi["headers"] and bool(lg["headers"].pop("x-request-id", None))


def stream_headers(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    headers = lg["headers"]
    if not headers.get("content-type", "").startswith("text/event-stream"):
        return False
    if (headers.get("cache-control"), headers.get("x-accel-buffering")) != ("no-cache", "no"):
        return False
    del headers["cache-control"], headers["x-accel-buffering"]
    return True


# ----- successful answers -------------------------------------------------------------------


def _drop_nulls(vi_node: Any, lg_node: Any) -> bool:
    """Drop from ``vi_node`` the null fields ``lg_node`` leaves out, at every depth."""
    found = False
    if isinstance(vi_node, dict) and isinstance(lg_node, dict):
        for key in list(vi_node):
            if vi_node[key] is None and key not in lg_node:
                del vi_node[key]
                found = True
            elif key in lg_node:
                found = _drop_nulls(vi_node[key], lg_node[key]) or found
    elif isinstance(vi_node, list) and isinstance(lg_node, list):
        for vi_item, lg_item in zip(vi_node, lg_node, strict=False):
            found = _drop_nulls(vi_item, lg_item) or found
    return found


def null_fields(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    return vi["status"] == lg["status"] and _drop_nulls(vi["body"], lg["body"])


def role_delta(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    vi_events, lg_events = _events(vi), _events(lg)
    if vi_events is None or lg_events is None:
        return False
    if any("role" in (_delta(e) or {}) for e in vi_events):
        return False
    kept = [e for e in lg_events if _delta(e) != {"role": "assistant", "content": ""}]
    lg["body"]["events"] = kept
    return len(kept) < len(lg_events)


def chunk_logprobs(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    vi_events, lg_events = _events(vi), _events(lg)
    if vi_events is None or lg_events is None:
        return False
    if any("logprobs" in c for e in _chunks(vi_events) for c in e["choices"]):
        return False
    found = False
    for event in _chunks(lg_events):
        for choice in event["choices"]:
            if "logprobs" in choice and choice["logprobs"] is None:
                del choice["logprobs"]
                found = True
    return found


def _joined(events: list[Any]) -> list[Any]:
    """``events`` with consecutive content pieces joined into one."""
    out: list[Any] = []
    for event in events:
        delta, before = _delta(event), _delta(out[-1]) if out else None
        if (
            delta is not None
            and set(delta) == {"content"}
            and before
            and set(before) == {"content"}
        ):
            before["content"] += delta["content"]
        else:
            out.append(copy.deepcopy(event))
    return out


def _pieces(events: list[Any]) -> list[str]:
    return [delta["content"] for delta in map(_delta, events) if delta and delta.get("content")]


def stop(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    stops = sent.get("stop")
    stops = [stops] if isinstance(stops, str) else stops
    if not stops or vi["status"] != 200 or lg["status"] != 200:
        return False
    text, lg_text = _content(vi), _content(lg)
    if text is None:
        return False
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    if lg_text != text[:cut]:
        return False
    vi_events, lg_events = _events(vi), _events(lg)
    if vi_events is None or lg_events is None:
        if cut == len(text):
            return False
        vi["body"]["choices"][0]["message"]["content"] = lg_text
        return True
    if cut == len(text) and _pieces(vi_events) == _pieces(lg_events):
        return False  # neither cut nor held back
    lg_events[:] = _joined(lg_events)
    vi_events[:] = _joined(vi_events)
    for event in vi_events:
        delta = _delta(event)
        if delta is not None and "content" in delta:
            delta["content"] = lg_text
    return True


def n_choices(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    n = sent.get("n")
    if not isinstance(n, int) or n == 1:
        return False
    error = _refusal(vi, lg)
    if error is not None:
        return _param(error) == "n" and not 1 <= n <= MAX_N and _settle_refusal(vi, lg)
    if (
        len(vi["calls"]) != 1
        or len(lg["calls"]) != n
        or any(call != lg["calls"][0] for call in lg["calls"])
    ):
        return False
    lg["calls"] = lg["calls"][:1]
    events = _events(lg)
    if events is not None:
        lg["body"]["events"] = [
            e for e in events if _delta(e) is None or e["choices"][0]["index"] == 0
        ]
        return True
    body = lg["body"]
    if [c["message"] for c in body["choices"]] != [body["choices"][0]["message"]] * n:
        return False
    usage = body["usage"]
    if usage["completion_tokens"] % n:
        return False  # not n answers' worth
    body["choices"] = body["choices"][:1]
    usage["completion_tokens"] //= n
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return True


def include_usage(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    options = sent.get("stream_options")
    events = _events(lg)
    if events is None or not isinstance(options, dict) or not options.get("include_usage"):
        return False
    last = [e for e in events if isinstance(e, dict) and e.get("choices") == [] and e.get("usage")]
    if len(last) != 1:
        return False
    events.remove(last[0])
    for event in _chunks(events):
        if "usage" in event and event["usage"] is None:
            del event["usage"]
    return True


def usage_counted(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    usage = vi["body"].get("usage") if isinstance(vi["body"], dict) else None
    counted = lg["body"].get("usage") if isinstance(lg["body"], dict) else None
    if not usage or usage.get("total_tokens") != 0 or not counted or not counted["total_tokens"]:
        return False
    lg["body"]["usage"] = {
        k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    return True


# ----- a backend that raises ----------------------------------------------------------------


def error_before_output(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    events, error = _events(vi), _error(lg)
    if vi["status"] != 200 or events is None or len(events) != 1 or error is None:
        return False
    message = events[0].get("error", {}).get("message") if isinstance(events[0], dict) else None
    if not message or message not in error["message"] or lg["status"] not in (400, 500):
        return False
    return _settle_refusal(vi, lg)


def error_midway(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    vi_events, lg_events = _events(vi), _events(lg)
    if (
        vi_events is None
        or lg_events is None
        or lg_events[-2:-1] == []
        or lg_events[-1] != "[DONE]"
    ):
        return False
    vi_error, lg_error = vi_events[-1], lg_events[-2]
    if not (
        isinstance(vi_error, dict) and set(vi_error) == {"error"} and _error({"body": lg_error})
    ):
        return False
    if vi_error["error"]["message"] != lg_error["error"]["message"]:
        return False
    vi_events[-1] = lg_error
    del lg_events[-1]
    return True


def _value_error(vi: Seen, lg: Seen) -> bool:
    error = _error(lg)
    return error is not None and error["code"] == "invalid_request" and not _param(error)


def error_shape(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    body = vi["body"]
    if vi["status"] != lg["status"] or not isinstance(body, dict) or set(body) != {"detail"}:
        return False
    error = _error(lg)
    if error is None or set(error) != {"message", "type", "param", "code"}:
        return False
    _settle(vi, lg, "body")
    return True


def listing_fails(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    if vi["body"] != {"text": "Internal Server Error"} or lg["status"] != 500 or not _error(lg):
        return False
    _settle(vi, lg, "body")
    _settle_headers(vi, lg, "content-type")
    return True


# ----- requests refused ---------------------------------------------------------------------

_INTEGERS = ("max_tokens", "top_k", "seed", "n")
_NUMBERS = (*_INTEGERS, "temperature", "top_p", "repetition_penalty", "min_p")


def _loose(sent: dict[str, Any], error: dict[str, Any]) -> bool:
    """A number sent as a string or a boolean (or an integer as ``5.0``), or ``stream`` as
    anything but a boolean: what Pydantic's lax mode turns into the field's type."""
    name, value = _param(error), sent.get(_param(error))
    if name == "stream":
        return not isinstance(value, bool)
    if name not in _NUMBERS:
        return False
    integral = name in _INTEGERS and isinstance(value, float) and value.is_integer()
    return isinstance(value, str | bool) or integral


def _own_bounds(sent: dict[str, Any], error: dict[str, Any]) -> bool:
    value = sent.get(_param(error))
    if error["code"] != "invalid_value" or not isinstance(value, int | float):
        return False
    if _param(error) in ("top_p", "repetition_penalty"):
        return value == 0  # the Vi schema's edge: ge=0
    return _param(error) in ("frequency_penalty", "presence_penalty") and abs(value) > 2


def _schema_refusal(vi: Seen, lg: Seen) -> bool:
    """Vi's 422 locates the field loragate's 400 names (``["body", "messages", 1, "role"]``
    is ``messages[1].role``)."""
    detail, error = vi["body"].get("detail"), _error(lg)
    if not isinstance(detail, list) or error is None or not _param(error):
        return False
    location = "".join(
        f"[{part}]" if isinstance(part, int) else f".{part}" for part in detail[0]["loc"][1:]
    )
    field = "." + _param(error)
    return location == field or location.startswith((field + ".", field + "["))


def _not_an_object(vi: Seen, lg: Seen) -> bool:
    detail, error = vi["body"].get("detail"), _error(lg)
    if not isinstance(detail, list) or error is None or error["code"] != "invalid_json":
        return False
    return detail[0]["loc"][0] == "body" and all(isinstance(p, int) for p in detail[0]["loc"][1:])


def _media_param(error: dict[str, Any]) -> bool:
    return _param(error) == "source" or _param(error).endswith(".image_url.url")


_MEDIA_CODES = ("invalid_image", "image_fetch_failed", "image_not_found")


# ----- what the backend is handed -----------------------------------------------------------


def _media_strings(call: list[Any]) -> list[tuple[dict[str, Any], str]]:
    """(the dict holding it, its key) for every image string in one backend call."""
    kwargs = call[1]
    found: list[tuple[dict[str, Any], str]] = []
    if isinstance(kwargs.get("source"), str):
        found.append((kwargs, "source"))
    for message in kwargs.get("messages") or []:
        for part in message["content"] if isinstance(message.get("content"), list) else []:
            if isinstance(part.get("image_url"), dict):
                found.append((part["image_url"], "url"))
    return found


def media_as_data_uri(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    found = False
    for vi_call, lg_call in zip(vi["calls"], lg["calls"], strict=False):
        pairs = zip(_media_strings(vi_call), _media_strings(lg_call), strict=False)
        for (vi_holder, vi_key), (lg_holder, lg_key) in pairs:
            if vi_holder[vi_key] != lg_holder[lg_key] and lg_holder[lg_key] == PNG_URI:
                lg_holder[lg_key] = vi_holder[vi_key]
                found = True
    return found


def vi_image_part(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    found = False
    for vi_call, lg_call in zip(vi["calls"], lg["calls"], strict=False):
        for vi_message, lg_message in zip(
            vi_call[1].get("messages") or [], lg_call[1].get("messages") or [], strict=False
        ):
            if not isinstance(vi_message["content"], list):
                continue
            for index, part in enumerate(vi_message["content"]):
                rewritten = {"type": "image_url", "image_url": {"url": PNG_URI}}
                if part.get("type") == "image" and lg_message["content"][index] == rewritten:
                    lg_message["content"][index] = part
                    found = True
    return found


def image_url_string(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    found = False
    for vi_call, lg_call in zip(vi["calls"], lg["calls"], strict=False):
        for vi_message, lg_message in zip(
            vi_call[1].get("messages") or [], lg_call[1].get("messages") or [], strict=False
        ):
            if not isinstance(vi_message["content"], list):
                continue
            for index, part in enumerate(vi_message["content"]):
                url = part.get("image_url")
                if isinstance(url, str) and lg_message["content"][index]["image_url"] == {
                    "url": url
                }:
                    lg_message["content"][index]["image_url"] = url
                    found = True
    return found


def guided_json(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    if "guided_json" not in sent or len(vi["calls"]) != 1 or len(lg["calls"]) != 1:
        return False
    handed = lg["calls"][0][1].get("response_format")
    if vi["calls"][0][1].get("response_format") is not None or not handed:
        return False
    if handed.get("pydantic_model") != "guided_json":
        return False
    lg["calls"][0][1]["response_format"] = None
    return True


# ----- the other routes ---------------------------------------------------------------------


def uptime(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    body = lg["body"]
    if not isinstance(body, dict) or body.get("uptime_s") != "<uptime_s>":
        return False
    if not isinstance(vi["body"], dict) or "uptime_s" in vi["body"]:
        return False
    del body["uptime_s"]
    return True


def not_ready(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    if vi["status"] != 200 or vi["body"].get("status") != "unhealthy" or lg["status"] != 503:
        return False
    if lg["body"].get("status") not in ("starting", "failed") or "retry-after" not in lg["headers"]:
        return False
    _settle(vi, lg, "status", "body")
    _settle_headers(vi, lg, "retry-after")
    return True


def model_entries(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    vi_body, lg_body = vi["body"], lg["body"]
    if not (isinstance(vi_body, dict) and vi_body.get("object") == "list"):
        return False
    vi_entries, lg_entries = vi_body["data"], lg_body["data"]
    if [e["id"] for e in vi_entries] != [e["id"] for e in lg_entries] or not vi_entries:
        return False
    loragate = {"object": "model", "created": "<created>", "owned_by": "loragate", "parent": None}
    if any(e != {"id": e["id"], **loragate} for e in lg_entries):
        return False
    _settle(vi, lg, "body")
    return True


def one_model_route(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    if (vi["status"], vi["body"]) != (404, {"detail": "Not Found"}) or lg["status"] != 200:
        return False
    if lg["body"].get("object") != "model":
        return False
    _settle(vi, lg, "status", "body")
    return True


def metrics(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    text = lg["body"].get("text", "") if isinstance(lg["body"], dict) else ""
    if vi["status"] != 404 or lg["status"] != 200 or "# TYPE loragate_" not in text:
        return False
    _settle(vi, lg, "status", "body")
    _settle_headers(vi, lg, "content-type")
    return True


def api_description(sent: dict[str, Any], vi: Seen, lg: Seen) -> bool:
    vi_body, lg_body = vi["body"], lg["body"]
    if vi["status"] == lg["status"] == 200 and isinstance(vi_body, dict):
        if vi_body.get("openapi") and lg_body.get("info", {}).get("title") == "loragate":
            _settle(vi, lg, "body")
            return True
        if "html page" in vi_body and "html page" in lg_body and vi_body != lg_body:
            _settle(vi, lg, "body")
            return True
    if vi["status"] == 200 and "html page" in vi_body and lg["status"] == 404:
        _settle(vi, lg, "status", "body")
        _settle_headers(vi, lg, "content-type")
        return True
    return False


# ----- the rows that are a refusal or a status -------------------------------------------

value_error = status_when(500, 400, _value_error)
schema_refusal = status_when(422, 400, _schema_refusal)
not_a_json_object = status_when(422, 400, _not_an_object)
content_type = status_when(
    422, 415, lambda vi, lg: (_error(lg) or {}).get("code") == "unsupported_media_type"
)
loose_types = refused_when(_loose)
own_bounds = refused_when(_own_bounds)
system_prompt = refused_when(lambda sent, error: _param(error) == "system_prompt")
not_supported = refused_when(lambda sent, error: error["code"] == "not_supported")
response_format_checked = refused_when(
    lambda sent, error: _param(error).startswith("response_format")
)
generation_config_keys = refused_when(
    lambda sent, error: _param(error).startswith("generation_config.")
)
media_checked = refused_when(
    lambda sent, error: (
        _media_param(error) and (error["code"] in _MEDIA_CODES or sent.get("source") == "")
    )
)
media_dir = refused_when(lambda sent, error: error["code"] == "media_path_forbidden", 403)
foreign_origin = refused_when(lambda sent, error: error["code"] == "origin_not_allowed", 403)
foreign_host = refused_when(lambda sent, error: error["code"] == "host_not_allowed", 403)
