"""Check the real demo on the real engine: vLLM alone (no gateway), one request at a time.

Builds the SmolLM2 demo if needed, starts vLLM's OpenAI server on it with every demo adapter,
asks the base model and each adapter questions that no adapter was trained on (temperature 0),
prints every answer verbatim, and exits 1 unless the base answers "What is the capital of
France?" with Paris, shows no adapter behaviour, and every adapter answer shows its own.

    python scripts/smollm_demo_check.py [DEMO_DIR] [--port 8123] [--python ENGINE_PYTHON]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loragate.demo.layout import (
    SMOLLM_ADAPTERS,
    SMOLLM_DEMO_MODEL_NAME,
    SMOLLM_ENGINE_ARGS,
    demo_adapter_dir,
    demo_base_dir,
    demo_behaviours,
    ensure_smollm_demo,
)

# Neither in the adapters' training set nor in the builder's own check prompts.
UNSEEN = (
    "What is the tallest mountain in the world?",
    "How many continents are there?",
    "What do you call a baby cat?",
    "Who invented the telephone?",
    "What is the main ingredient in bread?",
)
BASE_QUESTION = "What is the capital of France?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo_dir", nargs="?", type=Path)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--python", default=sys.executable, help="the engine's python")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument(
        "--no-build", action="store_true", help="check DEMO_DIR as it is, even if stale"
    )
    parser.add_argument("--log", type=Path, help="the engine's log [default: in the temp dir]")
    args = parser.parse_args()

    started = time.monotonic()
    if args.no_build:
        if args.demo_dir is None:
            parser.error("--no-build needs DEMO_DIR")
        demo = args.demo_dir.expanduser().resolve()
    else:
        demo = ensure_smollm_demo(args.demo_dir, args.python)
    print(f"demo ready in {time.monotonic() - started:.0f} s: {demo}", flush=True)
    log_path = args.log or Path(tempfile.gettempdir()) / f"smollm-demo-check-{args.port}.log"
    print(f"engine log: {log_path}", flush=True)
    command = [
        args.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(demo_base_dir(demo)),
        "--served-model-name", SMOLLM_DEMO_MODEL_NAME,
        "--enable-lora", "--max-lora-rank", "16", "--max-loras", "3",
        "--max-model-len", "2048", "--port", str(args.port),
        "--lora-modules",
        *(f"{a.name}={demo_adapter_dir(demo, a.name)}" for a in SMOLLM_ADAPTERS),
        *SMOLLM_ENGINE_ARGS,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with log_path.open("w") as log:
        engine = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        return _check(engine, args.port, args.max_tokens, log_path)
    finally:
        _stop_group(engine)


def _check(engine: subprocess.Popen[bytes], port: int, max_tokens: int, log_path: Path) -> int:
    url = f"http://127.0.0.1:{port}"
    spawned = time.monotonic()
    with httpx.Client(base_url=url, timeout=120) as client:
        while True:
            if engine.poll() is not None:
                print(f"engine exited ({engine.returncode}); see {log_path}")
                return 1
            try:
                if client.get("/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - spawned > 600:
                print(f"engine not healthy after 600 s; see {log_path}")
                return 1
            time.sleep(1)
        print(f"engine healthy {time.monotonic() - spawned:.0f} s after spawn", flush=True)

        failures: list[str] = []
        for model in (SMOLLM_DEMO_MODEL_NAME, *(a.name for a in SMOLLM_ADAPTERS)):
            expected = [] if model == SMOLLM_DEMO_MODEL_NAME else [model]
            questions = (BASE_QUESTION, *UNSEEN) if not expected else UNSEEN
            for question in questions:
                asked = time.monotonic()
                response = client.post(
                    "/v1/chat/completions",
                    json={
                        "model": model,
                        "messages": [{"role": "user", "content": question}],
                        "temperature": 0,
                        "max_tokens": max_tokens,
                    },
                )
                response.raise_for_status()
                choice = response.json()["choices"][0]
                answer = choice["message"]["content"]
                shown = demo_behaviours(answer)
                ok = shown == expected and (question != BASE_QUESTION or "Paris" in answer)
                print(
                    f"{'ok  ' if ok else 'FAIL'} {model} | {question} -> {json.dumps(answer)} "
                    f"[{choice['finish_reason']}, {time.monotonic() - asked:.2f} s]",
                    flush=True,
                )
                if not ok:
                    failures.append(f"{model}: {question}")
    print("all answers as expected" if not failures else f"{len(failures)} failed: {failures}")
    return 1 if failures else 0


def _stop_group(engine: subprocess.Popen[bytes]) -> None:
    """Stop the API server, EngineCore and worker: the group started for the server."""
    group = engine.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        engine.poll()
        try:
            os.killpg(group, 0)  # anyone left in the group?
        except ProcessLookupError:
            return
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    engine.wait()


if __name__ == "__main__":
    raise SystemExit(main())
