"""Schemathesis against the gateway alone (in-process, a recording backend): no 500, ever.

The quick sibling of tests/integration/test_fuzz.py: it needs no engine, so it runs with the
unit tests, and it checks what only the gateway decides (auth, body reading, request checks,
images, error shapes). Requests the gateway lets through reach the recording backend.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from loragate.gateway.app import create_app
from tests.backend_double import RecordingBackend, settings_for

MAX_EXAMPLES = 25


def test_no_generated_request_makes_the_gateway_fail(tmp_path: Path) -> None:
    backend = RecordingBackend()
    app = create_app(
        settings_for(tmp_path, allowed_media_dir=tmp_path, admin_key="admin"), backend=backend
    )
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            fuzz = _fuzzer(operation, mode, failures, statuses)
            with contextlib.suppress(Unsatisfiable):  # nothing to make invalid
                fuzz()
    assert not failures, "\n".join(failures[:20])
    assert statuses[200] > 0 and statuses[400] > 0, statuses
    assert backend.forwarded, "no generated request got through to the backend"


def _fuzzer(
    operation: Any, mode: schemathesis.GenerationMode, failures: list[str], statuses: Counter[int]
) -> Any:
    label = operation.label
    headers = {"Authorization": "Bearer admin"}

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        response = case.call(headers=headers)
        statuses[response.status_code] += 1
        if response.status_code >= 500:
            failures.append(f"{label} [{mode.value}] {response.status_code}: {case.body!r:.300}")
        elif response.status_code >= 400 and "error" not in response.json():
            failures.append(f"{label} [{mode.value}] {response.status_code} not OpenAI-shaped")

    return fuzz
