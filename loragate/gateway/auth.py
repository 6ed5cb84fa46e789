"""API keys: inference keys and a separate admin key, compared in constant time."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from loragate.gateway.errors import OpenAIError


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header and header[:7].lower() == "bearer ":
        return header[7:].strip()
    return request.headers.get("x-api-key")


def _matches(presented: str, keys: list[str]) -> bool:
    found = False
    for key in keys:  # no early exit: the time taken does not depend on which key matched
        found |= hmac.compare_digest(presented.encode(), key.encode())
    return found


class KeyChecker:
    def __init__(self, inference_keys: list[str], admin_key: str | None) -> None:
        self.inference_keys = inference_keys
        self.admin_key = admin_key

    def check_inference(self, request: Request) -> None:
        if not self.inference_keys:
            return
        presented = _bearer(request)
        allowed = self.inference_keys + ([self.admin_key] if self.admin_key else [])
        if presented is None or not _matches(presented, allowed):
            raise OpenAIError(
                401,
                "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )

    def check_admin(self, request: Request) -> None:
        if self.admin_key is None:
            return  # only allowed when bound to loopback; create_app enforces that
        presented = _bearer(request)
        if presented is None or not _matches(presented, [self.admin_key]):
            raise OpenAIError(
                401 if presented is None else 403,
                "This admin route needs the admin key: send 'Authorization: Bearer <admin key>'.",
                code="invalid_admin_key",
            )
