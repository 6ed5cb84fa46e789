"""Schemathesis against the gateway alone (in-process, backend doubles): no 500, ever.

The quick sibling of tests/integration/test_fuzz.py: it needs no engine, so it runs with the
unit tests, and it checks what only the gateway decides (auth, body reading, request checks,
images, error shapes). Requests the gateway lets through reach the doubles: inference to a
recording backend, admin routes to adapter-manager and supervisor doubles, so the admin
routes are fuzzed for real, with the admin key and without it.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from loragate.gateway.app import create_app
from tests.backend_double import ManagedBackendDouble, settings_for

MAX_EXAMPLES = 25
REFUSAL_EXAMPLES = 10  # a refusal at the door does not depend on the body: fewer tries suffice
ADMIN_KEY = "admin"
API_KEY = "client"
LOOPBACK_HOST = {"Host": "127.0.0.1:8000"}  # admin routes answer the gateway's own names only
OPEN_PATHS = ("/health", "/v1/health", "/health/live", "/metrics", "/metrics/recent")

Check = Callable[[str, Any], str | None]  # (label, response) -> a failure or None
Variant = tuple[dict[str, str], Check]  # headers to send each generated request with, check


def _schema(tmp_path: Path, backend: ManagedBackendDouble) -> Any:
    settings = settings_for(
        tmp_path,
        allowed_media_dir=tmp_path,
        admin_key=ADMIN_KEY,
        api_key=[API_KEY],
        adapter_source_roots=["/"],  # generated local sources may name any path
    )
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(settings, backend=backend))


def _is_admin(label: str) -> bool:
    path = label.split()[1]
    return path.startswith("/admin") or "lora_adapter" in path


def _fuzz_all(schema: Any, variants: dict[str, Variant], examples: int) -> Counter[int]:
    """Every operation, valid and invalid requests, each sent once per variant; failures raised."""
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            fuzz = _fuzzer(operation, mode, variants, examples, failures, statuses)
            with contextlib.suppress(Unsatisfiable):  # nothing to make invalid
                fuzz()
    assert not failures, "\n".join(failures[:20])
    return statuses


def _fuzzer(
    operation: Any,
    mode: schemathesis.GenerationMode,
    variants: dict[str, Variant],
    examples: int,
    failures: list[str],
    statuses: Counter[int],
) -> Any:
    label = operation.label

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        for name, (headers, check) in variants.items():
            response = case.call(headers=headers)
            statuses[response.status_code] += 1
            failure = _no_server_error(response) or check(label, response)
            if failure:
                failures.append(f"{label} [{mode.value}, {name}] {failure}: {case.body!r:.300}")

    return fuzz


def _no_server_error(response: Any) -> str | None:
    if response.status_code >= 500:
        return f"{response.status_code}"
    if response.status_code >= 400 and "error" not in response.json():
        return f"{response.status_code} not OpenAI-shaped"
    return None


def _error_code(response: Any) -> str | None:
    return response.json().get("error", {}).get("code") if response.status_code >= 400 else None


def test_no_generated_request_makes_the_gateway_fail(tmp_path: Path) -> None:
    backend = ManagedBackendDouble()
    headers = {**LOOPBACK_HOST, "Authorization": f"Bearer {ADMIN_KEY}"}

    def passes_the_door(label: str, response: Any) -> str | None:
        # With the admin key and a loopback Host, no generated request is refused at the door.
        if _error_code(response) in ("invalid_admin_key", "invalid_api_key", "host_not_allowed"):
            return f"refused at the door: {response.text[:200]}"
        return None

    variants = {"admin key": (headers, passes_the_door)}
    statuses = _fuzz_all(_schema(tmp_path, backend), variants, MAX_EXAMPLES)
    assert statuses[200] > 0 and statuses[400] > 0, statuses
    assert backend.forwarded, "no generated request got through to the backend"
    changes = {change[0] for change in backend.adapters.changes}
    assert changes == {"put", "remove", "rollback"}, changes
    assert backend.supervisor.restart_requests > 0


def test_no_generated_request_gets_past_the_door_without_the_key_or_from_a_web_page(
    tmp_path: Path,
) -> None:
    """Admin routes with no key, a wrong key, an inference key; every route from a foreign
    web page (even with the admin key, which a page could not have); admin routes by a
    rebound host name. Each is refused by the door alone: nothing reaches a double."""
    backend = ManagedBackendDouble()
    admin = {**LOOPBACK_HOST, "Authorization": f"Bearer {ADMIN_KEY}"}
    no_key, wrong_key = (401, "invalid_admin_key"), (403, "invalid_admin_key")
    variants: dict[str, Variant] = {
        "no key": (LOOPBACK_HOST, _refused(no_key, (401, "invalid_api_key"))),
        "wrong key": (
            {**LOOPBACK_HOST, "Authorization": "Bearer wrong-key"},
            _refused(wrong_key, (401, "invalid_api_key")),
        ),
        "inference key": (
            {**LOOPBACK_HOST, "Authorization": f"Bearer {API_KEY}"},
            _refused(wrong_key, None),
        ),
        "foreign origin": (
            {**admin, "Origin": "http://evil.example"},
            _refused((403, "origin_not_allowed"), (403, "origin_not_allowed")),
        ),
        "rebound host": (
            {**admin, "Host": "evil.example:8000"},
            _refused((403, "host_not_allowed"), None),
        ),
    }
    _fuzz_all(_schema(tmp_path, backend), variants, REFUSAL_EXAMPLES)
    assert not backend.adapters.changes and not backend.supervisor.restart_requests
    # Only the inference key's and the rebound host's inference requests went through.
    assert backend.forwarded


def _refused(admin: tuple[int, str], other: tuple[int, str] | None) -> Check:
    """Admin routes answer ``admin`` (status, code), the others ``other`` (None: anything)."""

    def check(label: str, response: Any) -> str | None:
        expected = admin if _is_admin(label) else other
        if label.split()[1] in OPEN_PATHS or expected is None:
            return None
        # Only the door decides: a 400, 413 or 415 would mean the body was judged first.
        if (response.status_code, _error_code(response)) != expected:
            return f"{response.status_code} {response.text[:200]}"
        return None

    return check
