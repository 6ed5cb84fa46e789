"""Schemathesis against the shared gateway's own OpenAPI schema, engine up: no 500, no hang.

Every operation in ``/openapi.json`` gets generated requests, valid ones (positive mode) and
invalid ones (negative mode), up to ``LORAGATE_FUZZ_EXAMPLES`` each and within
``LORAGATE_FUZZ_SECONDS`` in all. Admin operations get the admin key, so their own checks are
fuzzed rather than the key check; ``POST /admin/engine/restart`` is left out (it restarts the
shared engine by design, whatever its input).

Generated bodies are bounded before they are sent, without changing whether they are valid:
a large valid ``max_tokens`` or ``n`` is lowered, an invalid one stays invalid (``n`` above the
limit becomes the smallest invalid value), and most requests name a model that exists, so
they reach the engine instead of stopping at the 404. Adapter names of the shared demo are
never deleted: the fuzzer's names get a prefix when they collide.

Afterwards the engine must still be the same process, and every demo adapter still served.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable

from loragate.gateway.requests.parameters import MAX_N
from tests.conftest import PHRASES
from tests.gateway_process import ADMIN_KEY, GatewayProcess

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

MAX_EXAMPLES = int(os.environ.get("LORAGATE_FUZZ_EXAMPLES", "100"))
TIME_BUDGET_S = float(os.environ.get("LORAGATE_FUZZ_SECONDS", "420"))
REQUEST_TIMEOUT_S = 60.0  # a request still unanswered after this counts as a hang
SKIPPED = {"POST /admin/engine/restart"}
MAX_TOKENS = 8  # enough to exercise generation; keeps one request well under a second


@dataclass
class FuzzRun:
    started: float = field(default_factory=time.monotonic)
    sent: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    out_of_time: bool = False

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def summary(self) -> str:
        lines = [f"{sum(self.sent.values())} requests in {self.elapsed():.0f} s"]
        lines += [f"  {label}: {count}" for label, count in sorted(self.sent.items())]
        lines.append(
            "  statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items()))
        )
        return "\n".join(lines)


def _bounded(body: Any, models: list[str]) -> Any:
    """The same request, valid or invalid as it was, but cheap for the engine to answer."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    model = body.get("model")
    if not (isinstance(model, str) and model in models):
        # Three requests in four name a real model, so they get past the 404 to the engine.
        digest = zlib.crc32(repr(sorted(body, key=str)).encode())
        if digest % 4:
            body["model"] = models[digest % len(models)]
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and value > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS
    config = body.get("generation_config")
    if isinstance(config, dict) and type(config.get("max_new_tokens")) is int:
        body["generation_config"] = {
            **config,
            "max_new_tokens": min(config["max_new_tokens"], MAX_TOKENS),
        }
    n = body.get("n")
    if type(n) is int and n > 2:
        body["n"] = 2 if n <= MAX_N else MAX_N + 1
    return body


def _is_openai_error(response: Any) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def test_no_generated_request_gets_a_server_error_or_hangs(gateway: GatewayProcess) -> None:
    spec = httpx.get(f"{gateway.url}/openapi.json", timeout=30).json()
    assert "/v1/chat/completions" in spec["paths"]
    schema = schemathesis.openapi.from_dict(spec)
    models = [m["id"] for m in httpx.get(f"{gateway.url}/v1/models", timeout=30).json()["data"]]
    protected = {*models, *PHRASES}
    engine_before = gateway.engine_info()
    served_before = _engine_served(gateway)
    run_seed = int(os.environ.get("LORAGATE_FUZZ_SEED", random.randrange(2**32)))
    run = FuzzRun()

    operations = [result.ok() for result in schema.get_all_operations()]
    labels = [op.label for op in operations if op.label not in SKIPPED]
    assert len(labels) >= 12, labels
    for operation in operations:
        if operation.label in SKIPPED:
            continue
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            fuzz = _fuzzer(operation, mode, run, run_seed, gateway.url, models, protected)
            # Unsatisfiable: nothing to make invalid (no parameters, no body); positive covered it.
            with contextlib.suppress(Unsatisfiable):
                fuzz()

    reached = _engine_served(gateway) - served_before
    report = f"seed {run_seed}; {run.summary()}\n  reached the engine: {reached} inference requests"
    print(report)
    assert not run.failures, "\n".join([report, *run.failures[:20]])
    assert not run.out_of_time, (
        f"the time budget ran out before every operation was fuzzed\n{report}"
    )
    assert set(run.sent) == set(labels), report

    # The engine did not crash or restart, and the shared demo is intact.
    engine_after = gateway.engine_info()
    assert (engine_after["pid"], engine_after["restarts"]) == (
        engine_before["pid"],
        engine_before["restarts"],
    )
    assert httpx.get(f"{gateway.url}/health", timeout=30).status_code == 200
    served = {m["id"] for m in httpx.get(f"{gateway.url}/v1/models", timeout=30).json()["data"]}
    assert set(PHRASES) <= served


def _fuzzer(
    operation: Any,
    mode: schemathesis.GenerationMode,
    run: FuzzRun,
    run_seed: int,
    url: str,
    models: list[str],
    protected: set[str],
) -> Any:
    """A Hypothesis test that sends ``operation``'s generated requests and records failures."""
    label = operation.label
    admin = label.split()[1].startswith("/admin") or "lora_adapter" in label
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"} if admin else {}

    @seed(run_seed)
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # failures are collected, not shrunk: the time stays bounded
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        if run.elapsed() > TIME_BUDGET_S:
            run.out_of_time = True
            return
        name = (case.path_parameters or {}).get("name")
        if isinstance(name, str) and name in protected:
            case.path_parameters = {**case.path_parameters, "name": f"fuzz-{name}"}
        if isinstance(case.body, dict):
            case.body = _bounded(case.body, models)
        run.sent[label] += 1
        try:
            response = case.call(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S)
        except Exception as exc:  # a timeout is a hang; anything else, a broken answer
            run.failures.append(f"{label} [{mode.value}]: {exc!r} for {_excerpt(case)}")
            return
        run.statuses[str(response.status_code)] += 1
        if response.status_code >= 500:
            run.failures.append(
                f"{label} [{mode.value}]: {response.status_code} {response.text[:300]!r} "
                f"for {_excerpt(case)}"
            )
        elif response.status_code >= 400 and not _is_openai_error(response):
            run.failures.append(
                f"{label} [{mode.value}]: {response.status_code} without OpenAI's error shape: "
                f"{response.text[:200]!r}"
            )

    return fuzz


def _engine_served(gateway: GatewayProcess) -> int:
    """Inference requests in the engine's own access log."""
    log = (gateway.cache_dir / "logs" / "engine.log").read_text(errors="replace")
    return len(re.findall(r'"POST /v1/(?:chat/)?completions HTTP/1\.[01]"', log))


def _excerpt(case: Any) -> str:
    return repr({"path": case.path_parameters, "query": case.query, "body": case.body})[:400]


KEYLESS_EXAMPLES = int(os.environ.get("LORAGATE_FUZZ_KEYLESS_EXAMPLES", "15"))


def test_admin_operations_without_the_admin_key_are_refused_whatever_the_input(
    gateway: GatewayProcess,
) -> None:
    """Every admin operation (restart included: it cannot get that far), generated valid and
    invalid, with no key and with a wrong one: a 401 or 403 with OpenAI's error shape, and
    nothing changes."""
    spec = httpx.get(f"{gateway.url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(spec)
    admin_ops = [
        op
        for op in (result.ok() for result in schema.get_all_operations())
        if op.label.split()[1].startswith("/admin") or "lora_adapter" in op.label
    ]
    assert len(admin_ops) >= 6, [op.label for op in admin_ops]
    before = (gateway.engine_info(), gateway.admin("GET", "/admin/adapters").json()["data"])
    wrong: list[str] = []
    sent: Counter[str] = Counter()

    for operation in admin_ops:
        for headers in ({}, {"Authorization": "Bearer not-the-admin-key"}):
            _keyless_fuzzer(operation, headers, gateway.url, sent, wrong)()

    assert not wrong, wrong[:10]
    assert set(sent) == {op.label for op in admin_ops}
    engine_after = gateway.engine_info()
    assert (engine_after["pid"], engine_after["restarts"]) == (
        before[0]["pid"],
        before[0]["restarts"],
    )
    assert gateway.admin("GET", "/admin/adapters").json()["data"] == before[1]


def _keyless_fuzzer(
    operation: Any, headers: dict[str, str], url: str, sent: Counter[str], wrong: list[str]
) -> Any:
    @settings(
        max_examples=KEYLESS_EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE))
    def refused(case: Any) -> None:
        sent[operation.label] += 1
        response = case.call(base_url=url, headers=headers, timeout=60)
        if response.status_code not in (401, 403) or not _is_openai_error(response):
            wrong.append(f"{operation.label}: {response.status_code} {_excerpt(case)}")

    return refused
