"""API keys: inference keys and a separate admin key, compared in constant time.

Keys are kept only as SHA-256 digests, and a presented key is hashed before it is compared:
every comparison is between two 32-byte strings, so neither a key's content nor its length
shows in the time an answer takes. No key, presented or configured, is ever logged or echoed
in an error.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Mapping
from typing import Protocol

from loragate.gateway.errors import OpenAIError
from loragate.settings import Settings

logger = logging.getLogger(__name__)
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="loragate"'}


class KeyConfigError(RuntimeError):
    """The configured keys are unusable; the gateway refuses to start and says why."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class HasHeaders(Protocol):
    """A request, as far as keys go: Starlette's, or the hot path's (``server.hot_routes``)."""

    @property
    def headers(self) -> Mapping[str, str]: ...


def presented_key(request: HasHeaders) -> str | None:
    """The key a client sent: ``Authorization: Bearer KEY``, else ``X-API-Key: KEY``."""
    header = request.headers.get("authorization")
    if header and header[:7].lower() == "bearer ":
        return header[7:].strip()
    return request.headers.get("x-api-key")


def _matches(presented: str, digests: list[bytes]) -> bool:
    candidate = _digest(presented)
    found = False
    for digest in digests:  # no early exit: the time taken does not depend on which key matched
        found |= hmac.compare_digest(candidate, digest)
    return found


class KeyChecker:
    """Checks requests against the inference keys (any may be used) and the admin key."""

    def __init__(
        self, inference_keys: list[str], admin_key: str | None, *, per_start_token: bool = False
    ) -> None:
        # The admin key works on the inference routes too: whoever administers may also ask.
        self._inference = [_digest(key) for key in inference_keys]
        if inference_keys and admin_key:
            self._inference.append(_digest(admin_key))
        self._admin = [_digest(admin_key)] if admin_key else []
        self._admin_missing = (
            "This admin route needs the admin key: send 'Authorization: Bearer <admin key>'."
        )
        if per_start_token:
            self._admin_missing += (
                " This gateway was started without --admin-key: its key is the token in the "
                "admin-token file of its cache dir, which the gateway CLI on its machine reads."
            )

    @property
    def inference_open(self) -> bool:
        return not self._inference

    @property
    def admin_open(self) -> bool:
        return not self._admin

    def check_inference(self, request: HasHeaders) -> None:
        if not self._inference:
            return
        presented = presented_key(request)
        if not presented or not _matches(presented, self._inference):
            raise OpenAIError(
                401,
                "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
                headers=_CHALLENGE,
            )

    def check_admin(self, request: HasHeaders) -> None:
        if not self._admin:
            return  # open_admin: Gateway.check_admin_key lets only this machine's clients here
        presented = presented_key(request)
        if not presented:
            raise OpenAIError(
                401, self._admin_missing, code="invalid_admin_key", headers=_CHALLENGE
            )
        if not _matches(presented, self._admin):
            raise OpenAIError(
                403,
                "The key sent is not this gateway's admin key; admin routes need the admin key.",
                code="invalid_admin_key",
            )


def check_key_settings(settings: Settings) -> list[str]:
    """The inference keys, read and checked; ``KeyConfigError`` when they cannot be used.

    Refused: an ``--api-key-file`` that cannot be read or holds no key (that would leave the
    API open while its owner believes it closed), empty keys (a bare ``Bearer`` would match),
    and an admin key that is also an inference key (every client would be an admin); and
    ``--open-admin`` beside ``--cors-origin '*'``, which asks for admin routes without a key
    and for every web page to call the gateway at once. A key taken from ``VLLM_API_KEY`` (no
    other key setting given, as vLLM reads it) is said in one log line, never shown.
    """
    if settings.key_from_vllm_env:
        logger.info(
            "inference API key: VLLM_API_KEY (no --api-key, --api-key-file or LORAGATE_API_KEY "
            "is set); the inference routes need it, as vLLM's do"
        )
    if settings.open_admin and "*" in (origin.strip() for origin in settings.cors_origins):
        raise KeyConfigError(
            "--open-admin and --cors-origin '*' together would let any web page try the admin "
            "routes without a key: list the origins that may call the gateway, or drop "
            "--open-admin (the gateway CLI reads the per-start admin token)"
        )
    try:
        keys = settings.inference_keys()
    except OSError as exc:
        raise KeyConfigError(
            f"cannot read the API key file {settings.api_key_file}: {exc.strerror or exc}"
        ) from None
    except UnicodeDecodeError:
        raise KeyConfigError(
            f"the API key file {settings.api_key_file} is not UTF-8 text: one key per line"
        ) from None
    if settings.api_key_file is not None and len(keys) == len(settings.api_key):
        raise KeyConfigError(
            f"the API key file {settings.api_key_file} holds no key: write one key per line "
            "(lines starting with # are comments)"
        )
    if any(not key.strip() for key in keys):
        raise KeyConfigError("an API key is empty: pass --api-key with a non-empty value")
    if settings.admin_key is not None:
        if not settings.admin_key.strip():
            raise KeyConfigError("the admin key is empty: pass --admin-key with a non-empty value")
        if _matches(settings.admin_key, [_digest(key) for key in keys]):
            raise KeyConfigError(
                "the admin key is also an inference API key: every client could change adapters; "
                "use a separate --admin-key"
            )
    return keys
